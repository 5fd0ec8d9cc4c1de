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

import torch

from .errors import UnsupportedError, ValidationError
from .fp8_cast import E4M3_MAX, to_fp8

TENSORS = 3  # Q, K, V


class Fp8Scaling:
    """The amax history of one attention site's Q, K and V (float32, on their device)."""

    def __init__(self, history: int = 16):
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ValidationError([f"history: {history!r}; must be an int >= 1"], context="Fp8Scaling")
        self.history = history
        self.amaxes: torch.Tensor | None = None  # [3, history]
        self.calls = 0
        # For sdpa_fp8(backward="fp8"): the amaxes cuDNN reports for dQ, dK, dV and dS.
        self.grad_amaxes: torch.Tensor | None = None  # [4, history]
        self.grad_calls = 0

    def gradient_scales(self, device: torch.device) -> torch.Tensor | None:
        """Scales for dQ, dK, dV and dS from their amax history ([4]); None before the first
        backward (no history yet: the caller measures the amaxes first)."""
        if self.grad_amaxes is None or self.grad_amaxes.device != device or self.grad_calls == 0:
            return None
        return _scales(self.grad_amaxes.amax(dim=1))

    def record_gradients(self, amaxes: list[torch.Tensor]) -> None:
        """This backward's amaxes of dQ, dK, dV and dS (float32 [1, 1, 1, 1] each)."""
        device = amaxes[0].device
        if self.grad_amaxes is None or self.grad_amaxes.device != device:
            self.grad_amaxes = torch.zeros(len(amaxes), self.history, dtype=torch.float32, device=device)
            self.grad_calls = 0
        self.grad_amaxes[:, self.grad_calls % self.history] = torch.cat([a.reshape(1) for a in amaxes])
        self.grad_calls += 1

    def quantise(self, tensors: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each tensor in E4M3 and the descale that undoes its scale (float32 [1, 1, 1, 1])."""
        device = tensors[0].device
        if _capturing(tensors[0]):
            raise UnsupportedError(
                ["scaling: an Fp8Scaling cannot be captured in a CUDA graph (its history advances on the host, "
                 "so every replay would write one slot); capture with scaling=None (current scaling)"],
                context="sdpa_fp8",
            )  # fmt: skip
        if self.amaxes is None or self.amaxes.device != device:
            self.amaxes = torch.zeros(TENSORS, self.history, dtype=torch.float32, device=device)
            self.calls = 0
        slot = self.calls % self.history
        if self.calls == 0:  # no history yet: this call's own amaxes
            for i, x in enumerate(tensors):
                self.amaxes[i, slot] = x.detach().abs().amax().float()
        scales = _scales(self.amaxes.amax(dim=1))
        if self.calls > 0:
            self.amaxes[:, slot] = 0.0  # the oldest entry makes room for this call's
        quantised = []
        for i, x in enumerate(tensors):
            record = self.amaxes[i, slot : slot + 1] if self.calls > 0 else None
            quantised.append((to_fp8(x.detach(), scales[i], record), (1.0 / scales[i]).reshape(1, 1, 1, 1)))
        self.calls += 1
        return quantised


def current_scale(x: torch.Tensor) -> torch.Tensor:
    """The scale that maps ``x``'s largest magnitude onto E4M3's largest value (float32 [1, 1, 1, 1])."""
    low, high = torch.aminmax(x.detach())
    return _scales(torch.maximum(-low, high).float().reshape(1)).reshape(1, 1, 1, 1)


def _scales(amaxes: torch.Tensor) -> torch.Tensor:
    # An all-zero tensor keeps scale 1 (any scale would do; 0 would divide by zero).
    return torch.where(amaxes > 0, E4M3_MAX / amaxes, torch.ones_like(amaxes))


def _capturing(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()
