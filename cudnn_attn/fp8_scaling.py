"""Delayed scaling for ``sdpa_fp8``: each of Q, K, V cast to FP8 in one pass.

Current scaling reads every tensor twice before the attention starts (its amax, then the
cast). Delayed scaling, as TransformerEngine's recipe does it, takes the scale from the
largest amax of the last ``history`` calls and records this call's amax during the cast, so
each tensor is read once. The first call has no history yet: it scales by the current amax.

The price: a tensor whose magnitude outgrows its history is saturated (clipped to E4M3's
largest value) on that call, and the call after it sees the new amax. Keep one
``Fp8Scaling`` per attention site (``nn.Attention(..., fp8=True)`` does), since the
history is that site's.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .errors import UnsupportedError, ValidationError
from .kernels.fp8_cast import (
    TENSORS,
    advance_history,
    amax_qkv,
    finite_amaxes,
    quantise_qkv,
    scale_buffer,
    scale_view,
    scales_for,
)

# The history's tensors: the forward's four, then the gradients' amaxes.
_TENSORS = ("amaxes", "_current", "_slot", "_scales", "grad_amaxes")


# get_extra_state's layout: a header (format, history, calls, gradient calls, whether the forward
# and the gradient histories exist, the next slot), then the amaxes [3, H], this call's amaxes [3],
# the scales [3] and the gradient amaxes [4, H].
_FORMAT = 1.0
_HEADER = 7


def _into(held: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """``value`` written into ``held`` where it has the same shape (its device and dtype kept),
    else ``value`` itself as a new tensor (moved to the tensors' device on their next call)."""
    if held is not None and held.shape == value.shape:
        return held.copy_(value)
    return value.clone()


class Fp8Scaling(torch.nn.Module):
    """Delayed FP8 scaling: the amax history of one attention site's Q, K and V.

    Pass it as ``sdpa_fp8(..., scaling=)``: each call scales Q, K and V by the largest amax of
    the last ``history`` calls and records its own amax during the cast, so each tensor is
    read once (current scaling reads it twice). The first call has no history and scales by its
    current amaxes. A tensor whose magnitude outgrows its history is saturated on that call.
    The history lives on the device and advances there: after one call outside capture, calls
    can be captured in a CUDA graph. Keep one per attention site (``nn.Attention(fp8=True)``
    does); ``backward="fp8"`` keeps the gradients' histories here too. It is a module without
    parameters whose history is its ``state_dict``'s extra state, so a model's checkpoint
    resumes with the scales it left off with (as TransformerEngine keeps its FP8 metadata);
    the history follows the tensors to another device on their next call.

    Args:
        history: how many calls' amaxes decide the scale (>= 1).

    Raises:
        ValidationError: ``history`` is not an int >= 1.

    Example:
        ```python
        import torch

        import cudnn_attn

        scaling = cudnn_attn.Fp8Scaling(history=16)
        q, k, v = (torch.randn(1, 4, 64, 64, dtype=torch.bfloat16) for _ in range(3))
        for _ in range(3):
            out = cudnn_attn.sdpa_fp8(q, k, v, is_causal=True, scaling=scaling)
        assert scaling.calls == 3
        ```
    """

    def __init__(self, history: int = 16):
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ValidationError([f"history: {history!r}; must be an int >= 1"], context="Fp8Scaling")
        super().__init__()
        self.history = history
        self.amaxes: torch.Tensor | None = None  # [3, history]
        self.calls = 0  # calls made eagerly or captured (a replay is not counted)
        self._current: torch.Tensor | None = None  # [3]: this call's amaxes, raised by the cast
        self._slot: torch.Tensor | None = None  # int32 [1]: the history column the next call fills
        self._scales: torch.Tensor | None = None  # [3, SCALE_STRIDE]: the next call's scales
        # For sdpa_fp8(backward="fp8"): the amaxes cuDNN reports for dQ, dK, dV and dS.
        self.grad_amaxes: torch.Tensor | None = None  # [4, history]
        self.grad_calls = 0

    def get_extra_state(self) -> torch.Tensor:
        """The history as a ``state_dict`` holds it: one float64 CPU tensor (safetensors, which
        Hugging Face and accelerate save with, takes tensors only), laid out by ``_HEADER``."""
        h = self.history
        forward, backward = self.amaxes is not None, self.grad_amaxes is not None
        header = [_FORMAT, h, self.calls, self.grad_calls, forward, backward]
        slot = self._slot if forward and self._slot is not None and self._slot.device.type != "meta" else None
        header.append(float(slot.item()) if slot is not None else 0.0)  # a meta history has no values
        parts = [torch.tensor(header, dtype=torch.float64, device="cpu")]  # not a default device's (meta)
        if forward:
            assert self.amaxes is not None and self._current is not None and self._scales is not None
            parts += [self.amaxes.flatten(), self._current.flatten(), self._scales[:, 0]]
        else:
            parts.append(torch.zeros(3 * h + 6, dtype=torch.float64, device="cpu"))
        grads = self.grad_amaxes
        parts.append(grads.flatten() if grads is not None else torch.zeros(4 * h, dtype=torch.float64, device="cpu"))
        return torch.cat([part.detach().double().cpu() for part in parts])

    def set_extra_state(self, state: Any) -> None:
        """Resume from ``get_extra_state``'s history (``load_state_dict`` calls it). Tensors the
        history already has are written in place, so a CUDA graph captured with them reads it."""
        h = self.history
        if not isinstance(state, torch.Tensor) or state.dim() != 1 or state.numel() < _HEADER:
            raise ValidationError(["state: not an Fp8Scaling's history"], context="Fp8Scaling")
        if state.dtype != torch.float64:  # a cast state rounds its counts (1001 calls read as 1000)
            raise ValidationError([f"state: {state.dtype}; an Fp8Scaling's history is float64"], context="Fp8Scaling")
        header = [float(x) for x in state[:_HEADER]]
        integral = all(math.isfinite(x) and x == int(x) for x in header[1:])
        if header[0] != _FORMAT or not integral or state.numel() != _HEADER + 7 * int(header[1]) + 6:
            raise ValidationError(["state: not an Fp8Scaling's history (another layout)"], context="Fp8Scaling")
        if not 0 <= header[6] < max(header[1], 1):  # the next column a call writes, on the device
            raise ValidationError(
                [f"state: slot {int(header[6])} outside a history of {int(header[1])}"], context="Fp8Scaling"
            )
        if int(header[1]) != h:
            raise ValidationError(
                [f"state: a history of {int(header[1])} calls; this one keeps {h}"], context="Fp8Scaling"
            )
        self.calls, self.grad_calls = int(header[2]), int(header[3])
        body = state[_HEADER:].float()
        amaxes, current, scales, grads = body.split([3 * h, 3, 3, 4 * h])
        if header[4]:
            self.amaxes = _into(self.amaxes, amaxes.view(3, h))
            self._current = _into(self._current, current)
            self._slot = _into(self._slot, torch.tensor([int(header[6])], dtype=torch.int32, device="cpu"))
            buffer = scale_buffer("cpu")
            buffer[:, 0] = scales
            self._scales = _into(self._scales, buffer)
        else:
            self.amaxes = self._current = self._slot = self._scales = None
        self.grad_amaxes = _into(self.grad_amaxes, grads.view(4, h)) if header[5] else None

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args)
        missing = args[2]  # (local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        if prefix + "_extra_state" in missing:  # a 16-bit layer's weights: the history starts afresh
            missing.remove(prefix + "_extra_state")

    def _follow(self, device: torch.device) -> None:
        """Move the history to ``device`` (a model moved, or a checkpoint loaded elsewhere)."""
        for attribute in _TENSORS:
            value = getattr(self, attribute)
            if value is not None and value.device != device:
                _refuse_capture(device, "the history lies on another device; run one call before capture")
                setattr(self, attribute, value.to(device))

    def gradient_scales(self, device: torch.device) -> torch.Tensor | None:
        """Scales for dQ, dK, dV and dS from their amax history ([4]); None before the first
        backward (no history yet: the caller measures the amaxes first)."""
        _refuse_capture(device, "the FP8 backward's gradient history advances on the host")
        if self.grad_amaxes is None or self.grad_calls == 0:
            return None
        if self.grad_amaxes.device != device:
            self._follow(device)
        assert self.grad_amaxes is not None
        return scales_for(self.grad_amaxes.amax(dim=1))

    def record_gradients(self, amaxes: list[torch.Tensor]) -> None:
        """This backward's amaxes of dQ, dK, dV and dS (float32 [1, 1, 1, 1] each)."""
        device = amaxes[0].device
        if self.grad_amaxes is None:
            self.grad_amaxes = torch.zeros(len(amaxes), self.history, dtype=torch.float32, device=device)
            self.grad_calls = 0
        elif self.grad_amaxes.device != device:
            self._follow(device)
        # An overflowing backward's inf or NaN is not recorded: it would set the scales of the next ones.
        self.grad_amaxes[:, self.grad_calls % self.history] = finite_amaxes(torch.cat([a.reshape(1) for a in amaxes]))
        self.grad_calls += 1

    def quantise_qkv(self, tensors: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Q, K, V in E4M3 under the history's scales, with the scales used and their descales
        (``[3, SCALE_STRIDE]``, this call's own tensors); this call's amaxes join the history."""
        staged = self.stage(tensors)
        self.commit()
        return staged

    def stage(self, tensors: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """``quantise_qkv`` with this call's amaxes held aside: ``commit`` folds them into the
        history once the call has run, ``discard`` forgets them if it failed (a refused call
        must not set the scales of the calls after it)."""
        device = tensors[0].device
        if self.amaxes is not None and self.amaxes.device != device:  # one comparison a steady call
            self._follow(device)
        if self.amaxes is None:
            _refuse_capture(device, "an Fp8Scaling's first call measures its amaxes; run one call before capture")
            self.amaxes = torch.zeros(TENSORS, self.history, dtype=torch.float32, device=device)
            self._current = torch.zeros(TENSORS, dtype=torch.float32, device=device)
            self._slot = torch.zeros(1, dtype=torch.int32, device=device)
            self._scales = scale_buffer(device)
            self._current.copy_(amax_qkv(tensors))  # no history yet: this call's own amaxes
            self._scales[:, 0] = scales_for(self._current)
            record = None  # measured already
        else:
            record = self._current
        assert self._current is not None and self._scales is not None
        return quantise_qkv(tensors, scales=self._scales, record=record)

    def commit(self) -> None:
        """Fold the staged call's amaxes into the history (inf and NaN are not recorded)."""
        assert self.amaxes is not None and self._current is not None and self._slot is not None
        assert self._scales is not None
        advance_history(self.amaxes, self._current, self._slot, self._scales)
        self.calls += 1

    def discard(self) -> None:
        """Forget the staged call's amaxes: a first call leaves no history at all."""
        if self.calls == 0:
            for attribute in _TENSORS[:4]:
                setattr(self, attribute, None)
        elif self._current is not None:
            self._current.zero_()

    def quantise(self, tensors: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each of Q, K, V in E4M3 and the descale that undoes its scale (float32 [1, 1, 1, 1])."""
        quantised, _, descales = self.quantise_qkv(tensors)
        return [(x8, scale_view(descales, i)) for i, x8 in enumerate(quantised)]


def current_scale(x: torch.Tensor) -> torch.Tensor:
    """The scale that maps ``x``'s largest magnitude onto E4M3's largest value (float32 [1, 1, 1, 1])."""
    low, high = torch.aminmax(x.detach())
    return scales_for(torch.maximum(-low, high).float().reshape(1)).reshape(1, 1, 1, 1)


def _refuse_capture(device: torch.device, why: str) -> None:
    if _capturing(device):
        raise UnsupportedError([f"scaling: cannot be captured in a CUDA graph here: {why}"], context="sdpa_fp8")


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
