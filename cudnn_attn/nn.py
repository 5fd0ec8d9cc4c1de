"""``cudnn_attn.nn``: attention as a module, for models and training.

``Attention`` is self-attention with one fused QKV projection, grouped-query heads, an
optional causal mask and dropout, and an output projection. Q, K and V stay views of the
projection's output (BSHD, no copies) all the way into the fused kernel.

Equivalent plain torch::

    qkv = self.qkv(x).view(B, S, H + 2 * H_kv, D)
    q, k, v = qkv.split([H, H_kv, H_kv], dim=2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=causal, enable_gqa=True)
    return self.out(o.transpose(1, 2).reshape(B, S, H * D))
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .core.dtypes import dtype_name
from .core.finite import finite_real, flag, integer
from .errors import ShapeMismatchError, UnsupportedError, ValidationError, shown
from .fp8 import sdpa_fp8
from .fp8_scaling import Fp8Scaling
from .functional import sdpa


class Attention(nn.Module):
    """Multi-head (or grouped-query) self-attention on ``[B, S, embed_dim]`` (or unbatched
    ``[S, embed_dim]``) inputs.

    One fused QKV projection, attention through ``cudnn_attn.sdpa`` (or ``sdpa_fp8``), and an
    output projection. Q, K and V stay views of the projection's output (BSHD, no copies) all
    the way into the fused kernel. Errors speak of the layer's arguments (``x``, ``dropout``,
    ``num_kv_heads``).

    Equivalent plain torch (``forward``; ``B, S = x.shape[:2]``):

    ```python
    qkv = self.qkv(x).view(B, S, H + 2 * H_kv, D)
    q, k, v = (t.transpose(1, 2) for t in qkv.split([H, H_kv, H_kv], dim=2))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p=dropout if self.training else 0.0,
                                       is_causal=causal and attn_mask is None, enable_gqa=H_kv != H)
    return self.out(o.transpose(1, 2).reshape(B, S, H * D))
    ```

    Args:
        embed_dim: model width; ``num_heads`` must divide it (head dim ``embed_dim // num_heads``;
            cuDNN takes multiples of 8, the reference backend any).
        num_heads: query heads ``H``.
        num_kv_heads: K/V heads ``H_kv`` (None: ``num_heads``); an int >= 1 dividing ``num_heads``.
        bias: whether the projections have biases.
        causal: apply a causal mask by default (``forward(is_causal=...)`` overrides).
        dropout: attention dropout probability ``0 <= p < 1``, applied in training mode only.
        fp8: attend through FP8 kernels (``cudnn_attn.sdpa_fp8`` with delayed scaling: the
            layer keeps the amax history of its Q, K, V in ``fp8_scaling``; gradients from the
            16-bit inputs); takes no dropout, sinks, window or softcap.
        sinks: learned attention sinks (gpt-oss): a float32 parameter ``sinks`` of one logit per
            head, zeros at first, in every softmax denominator.
        window: a causal sliding window of this many tokens, the query's own included
            (transformers' ``sliding_window``; ``sdpa(window_size=(window - 1, 0))``); needs
            ``causal=True``; a call's ``attn_mask`` replaces it, as it replaces the causal mask.
        softcap: logit soft-capping (Gemma-2): scores ``softcap * tanh(s / softcap)``.
        device: the parameters' device.
        dtype: the parameters' dtype (float16 or bfloat16 for cuDNN on a GPU).

    Raises:
        ValidationError: sizes that are not ints >= 1, heads that do not divide, a dropout outside
            ``[0, 1)``, a softcap that is not > 0, or options that do not combine; every problem,
            each naming its argument.

    Example:
        ```python
        import torch

        import cudnn_attn

        layer = cudnn_attn.nn.Attention(256, 8, num_kv_heads=2, causal=True, dtype=torch.bfloat16)
        x = torch.randn(2, 100, 256, dtype=torch.bfloat16, requires_grad=True)  # [B, S, embed_dim]
        y = layer(x)
        y.float().square().mean().backward()
        assert y.shape == x.shape and x.grad is not None
        ```
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        bias: bool = True,
        causal: bool = False,
        dropout: float = 0.0,
        fp8: bool = False,
        sinks: bool = False,
        window: int | None = None,
        softcap: float | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        problems = _construction_problems(embed_dim, num_heads, num_kv_heads, dropout, softcap)
        if num_kv_heads is None:
            num_kv_heads = num_heads
        if fp8 and dropout:
            problems.append(f"dropout: {dropout}; FP8 attention (fp8=True) takes no dropout")
        if fp8 and dtype is not None and dtype not in (torch.float16, torch.bfloat16):
            problems.append(f"dtype: {dtype}; fp8=True attends from float16 or bfloat16 activations")
        if fp8 and (sinks or window is not None or softcap is not None):
            problems.append("fp8: True with sinks, window or softcap; FP8 attention takes none of them here")
        if window is not None and (not integer(window) or window < 1):
            problems.append(f"window: {window!r}; expected an int >= 1 (tokens, the query's own included)")
        if window is not None and not causal:
            problems.append("window: a sliding window needs causal=True (it is a left bound beside the causal mask)")
        problems += _factory_problems(causal, bias, device, dtype)
        if problems:
            raise ValidationError(problems, context="Attention")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.causal, self.dropout, self.fp8 = causal, dropout, fp8
        self.window, self.softcap = window, softcap
        self.fp8_scaling = Fp8Scaling() if fp8 else None
        factory = {"device": device, "dtype": dtype}
        self.qkv = nn.Linear(embed_dim, (num_heads + 2 * num_kv_heads) * self.head_dim, bias=bias, **factory)
        self.out = nn.Linear(num_heads * self.head_dim, embed_dim, bias=bias, **factory)
        self.sinks = nn.Parameter(torch.zeros(num_heads, device=device, dtype=torch.float32)) if sinks else None

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool | None = None
    ) -> torch.Tensor:
        """Self-attention of ``x``.

        Args:
            x: ``[B, S, embed_dim]``, or unbatched ``[S, embed_dim]`` (as ``nn.MultiheadAttention``
                takes it), in the parameters' dtype and on their device.
            attn_mask: a bool (True takes part) or additive mask broadcastable to
                ``[B, num_heads, S, S]``; replaces the causal mask and the sliding window, as
                torch's ``attn_mask`` replaces ``is_causal`` (put them in the mask to keep them).
            is_causal: overrides the layer's ``causal`` for this call.

        Returns:
            ``[B, S, embed_dim]`` (``[S, embed_dim]`` unbatched).

        Raises:
            ValidationError: a malformed input (rank, last dimension, dtype, device), in the
                layer's terms.
            UnsupportedError: a call this GPU or cuDNN cannot run.
        """
        problems = self._input_problems(x)
        if is_causal is not None and not flag(is_causal):
            problems.append(f"is_causal: {shown(is_causal)}; expected True, False or None (the layer's causal)")
        if problems:
            raise ValidationError(problems, context="Attention")
        if self.fp8 and attn_mask is not None:
            raise UnsupportedError(
                ["attn_mask: fp8=True attention takes no mask tensor (cuDNN's FP8 op has no bias)"],
                context="Attention",
                alternatives=["causal=True (or is_causal=True)", "fp8=False"],
            )
        if x.dim() == 2:  # unbatched [S, E], as torch's nn.MultiheadAttention takes it
            return self.forward(x.unsqueeze(0), attn_mask, is_causal).squeeze(0)
        b, s, _ = x.shape
        h, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x).view(b, s, h + 2 * h_kv, d)
        q, k, v = (t.transpose(1, 2) for t in qkv.split([h, h_kv, h_kv], dim=2))
        causal = self.causal if is_causal is None else is_causal
        if self.fp8 and x.numel() > 0:  # an empty batch or sequence has no amax: the 16-bit path below
            try:
                o = sdpa_fp8(q, k, v, attn_mask, is_causal=causal, enable_gqa=h_kv != h, scaling=self.fp8_scaling)
            except (ValidationError, UnsupportedError, ShapeMismatchError) as error:
                raise _in_layer_terms(error) from None
            return self.out(o.transpose(1, 2).reshape(b, s, h * d))
        terms: dict[str, Any] = {}
        if self.sinks is not None:
            terms["sinks"] = self.sinks
        if self.softcap is not None:
            terms["softcap"] = self.softcap
        if self.window is not None and causal and attn_mask is None:  # a mask replaces both (forward's doc)
            terms["window_size"] = (self.window - 1, 0)
        try:
            o = sdpa(
                q,
                k,
                v,
                attn_mask=attn_mask,
                is_causal=causal and attn_mask is None,
                dropout_p=self.dropout if self.training else 0.0,
                enable_gqa=h_kv != h,
                **terms,
            )
        except (ValidationError, UnsupportedError, ShapeMismatchError) as error:
            raise _in_layer_terms(error) from None
        return self.out(o.transpose(1, 2).reshape(b, s, h * d))

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        if self.fp8_scaling is None:  # an FP8 layer's weights: its amax history means nothing here
            state_dict.pop(prefix + "fp8_scaling._extra_state", None)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def _input_problems(self, x: Any) -> list[str]:
        """What is wrong with ``x`` for this layer (before the projection's own matmul errors)."""
        weight = self.qkv.weight
        if not isinstance(x, torch.Tensor):
            return [f"x: {type(x).__name__}; expected a torch tensor [B, S, {self.embed_dim}] or [S, {self.embed_dim}]"]
        problems = []
        if x.dim() not in (2, 3) or x.shape[-1] != self.embed_dim:
            problems.append(
                f"x: shape {list(x.shape)}; expected [B, S, {self.embed_dim}] or unbatched [S, {self.embed_dim}] "
                f"(the last dimension is embed_dim={self.embed_dim})"
            )
        if x.dtype != weight.dtype:
            problems.append(f"x: dtype {dtype_name(x.dtype)}; the layer's parameters are {dtype_name(weight.dtype)}")
        if x.device != weight.device:
            problems.append(f"x: on {x.device}; the layer's parameters are on {weight.device}")
        if self.fp8 and x.dtype not in (torch.float16, torch.bfloat16):
            problems.append(
                f"x: dtype {dtype_name(x.dtype)}; fp8=True attends from float16 or bfloat16 activations "
                "(layer.to(torch.bfloat16))"
            )
        return problems

    def extra_repr(self) -> str:
        extra = ", fp8=True" if self.fp8 else ""
        extra += ", sinks=True" if self.sinks is not None else ""
        extra += f", window={self.window}" if self.window is not None else ""
        extra += f", softcap={self.softcap}" if self.softcap is not None else ""
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, causal={self.causal}{extra}"


def _factory_problems(causal: Any, bias: Any, device: Any, dtype: Any) -> list[str]:
    """The flags, device and dtype ``Attention`` is built with, checked by name."""
    problems = [
        f"{name}: {shown(v)}; expected True or False" for name, v in (("causal", causal), ("bias", bias)) if not flag(v)
    ]
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        problems.append(f"dtype: {shown(dtype)}; expected a floating torch dtype (torch.bfloat16, ...) or None")
    if device is not None:
        try:
            torch.device(device)
        except (RuntimeError, TypeError) as error:
            problems.append(f"device: {shown(device)}; not a torch device ({error})")
    return problems


def _construction_problems(embed_dim: Any, num_heads: Any, num_kv_heads: Any, dropout: Any, softcap: Any) -> list[str]:
    """The sizes and probabilities ``Attention`` is built from, checked by name (every problem)."""
    problems = []
    for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if name == "num_kv_heads" and value is None:
            continue
        if not integer(value) or value < 1:
            problems.append(f"{name}: {shown(value)}; expected an int >= 1")
    sizes_ok = not problems
    if sizes_ok and embed_dim % num_heads:
        problems.append(f"num_heads: {num_heads} does not divide embed_dim={embed_dim}")
    if sizes_ok and num_kv_heads is not None and num_heads % num_kv_heads:
        problems.append(f"num_kv_heads: {num_kv_heads} does not divide num_heads={num_heads}")
    if not finite_real(dropout) or not 0.0 <= dropout < 1.0:
        problems.append(f"dropout: {shown(dropout)}; expected a probability 0 <= p < 1")
    if softcap is not None and (not finite_real(softcap) or softcap <= 0):
        problems.append(f"softcap: {shown(softcap)}; expected a finite number > 0 or None")
    return problems


# sdpa's arguments as the layer's user knows them: q, k and v are projections of x.
_LAYER_NAMES = {"query": "x", "key": "x", "value": "x", "dropout_p": "dropout", "enable_gqa": "num_kv_heads"}


def _in_layer_terms(error: ValidationError | UnsupportedError | ShapeMismatchError) -> Exception:
    """``error`` speaking of the layer's arguments (one line per problem, repeats merged)."""
    renamed = error.renamed(_LAYER_NAMES)
    lines = list(dict.fromkeys(renamed.problems))
    extra = {"alternatives": renamed.alternatives} if isinstance(renamed, UnsupportedError) else {}
    return type(renamed)(lines, "Attention", **extra)
