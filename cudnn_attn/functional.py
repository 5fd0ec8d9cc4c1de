"""``cudnn_attn.sdpa``: a drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

Same signature and semantics, differentiable, backed by cached graphs (cuDNN on CUDA
tensors, the reference backend on CPU tensors)::

    out = cudnn_attn.sdpa(q, k, v, is_causal=True)
    # == torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

``attn_mask`` may be boolean (True = takes part) or additive, broadcastable to
``[B, H, L, S]``. Inputs are fp16/bf16 ``[B, H, L, E]`` (or ``[H, L, E]``). Dropout draws a
fresh seed from torch's default generator on each call, so ``torch.manual_seed`` makes it
repeatable; the backward reuses the forward's mask.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from .data_type import FLOATING_IO, dtype_name
from .errors import GraphStateError, ShapeMismatchError, UnsupportedError, ValidationError, shown
from .graph_cache import GraphCache
from .options import default_scale
from .problem import TensorSpec, strides_like

_graphs = GraphCache()


def _spec(t: torch.Tensor | None) -> TensorSpec | None:
    return None if t is None else TensorSpec.of(t)


def _mask_as_bias(attn_mask: torch.Tensor, q: torch.Tensor, s_kv: int) -> torch.Tensor:
    """torch's attn_mask as an additive 4-D bias cuDNN can read."""
    if attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(~attn_mask, float("-inf"))
    elif attn_mask.dtype != q.dtype:
        attn_mask = attn_mask.to(q.dtype)
    while attn_mask.dim() < 4:
        attn_mask = attn_mask.unsqueeze(0)
    if attn_mask.shape[-1] != s_kv:  # keys are never broadcast in a cuDNN bias
        attn_mask = attn_mask.expand(*attn_mask.shape[:-1], s_kv)
    if attn_mask.stride(-1) != 1 or any(st == 0 and n > 1 for st, n in zip(attn_mask.stride(), attn_mask.shape)):
        attn_mask = attn_mask.contiguous()
    return attn_mask


# The fused op is a torch custom op: torch.compile treats it as one opaque node (no graph
# break), autograd goes through register_autograd, and fake tensors get the right strides.


def _forward_options(scale: float, is_causal: bool, dropout_p: float, seed, offset) -> dict:
    options = dict(attn_scale=scale, use_causal_mask=is_causal)
    if dropout_p > 0:
        options.update(dropout=dropout_p, dropout_seed=seed, dropout_offset=offset)
    return options


@torch.library.custom_op("cudnn_attn::sdpa_forward", mutates_args=())
def _sdpa_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    is_causal: bool,
    dropout_p: float,
    seed: torch.Tensor | None,
    offset: torch.Tensor | None,
    train: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    options = _forward_options(scale, is_causal, dropout_p, seed, offset)
    inputs = [t for t in (q, k, v, bias) if t is not None] + ([seed, offset] if dropout_p > 0 else [])
    key = ("forward", *map(_spec, (q, k, v, bias)), _aliasing(inputs), scale, is_causal, dropout_p, train)
    graph = _graphs.get_or_build(key, lambda g: g.sdpa(q, k, v, attn_bias=bias, generate_stats=train, **options))
    result = graph(*_distinct(inputs))
    if train:
        return result
    return result, q.new_empty(0, dtype=torch.float32)


@_sdpa_forward.register_fake
def _(q, k, v, bias, scale, is_causal, dropout_p, seed, offset, train):
    shape = (*q.shape[:-1], v.shape[-1])
    out = q.new_empty_strided(shape, strides_like(shape, q.stride()))
    stats = q.new_empty((*q.shape[:-1], 1), dtype=torch.float32) if train else q.new_empty(0, dtype=torch.float32)
    return out, stats


@torch.library.custom_op("cudnn_attn::sdpa_backward", mutates_args=())
def _sdpa_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    d_out: torch.Tensor,
    stats: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    is_causal: bool,
    dropout_p: float,
    seed: torch.Tensor | None,
    offset: torch.Tensor | None,
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    d_out = d_out if d_out.stride() == out.stride() else _like(d_out, out)
    options = _forward_options(scale, is_causal, dropout_p, seed, offset)
    inputs: list[Any] = [q, k, v, out, d_out, stats] + ([bias] if bias is not None else [])
    if dropout_p > 0:
        inputs += [seed, offset]
    key = (
        "backward",
        *map(_spec, (q, k, v, bias, out, d_out)),
        _aliasing(inputs),
        scale,
        is_causal,
        dropout_p,
        bias_grad,
    )
    graph = _graphs.get_or_build(
        key, lambda g: g.sdpa_backward(q, k, v, out, d_out, stats, attn_bias=bias, bias_grad=bias_grad, **options)
    )
    grads = graph(*_distinct(inputs))
    return (*grads[:3], grads[3] if bias_grad else q.new_empty(0))


@_sdpa_backward.register_fake
def _(q, k, v, out, d_out, stats, bias, scale, is_causal, dropout_p, seed, offset, bias_grad):
    grads = [t.new_empty_strided(t.shape, strides_like(tuple(t.shape), t.stride())) for t in (q, k, v)]
    d_bias = (
        bias.new_empty_strided(bias.shape, strides_like(tuple(bias.shape), bias.stride()))
        if bias_grad
        else q.new_empty(0)
    )
    return (*grads, d_bias)


def _setup_context(ctx, inputs, output):
    q, k, v, bias, scale, is_causal, dropout_p, seed, offset, train = inputs
    out, stats = output
    ctx.save_for_backward(q, k, v, bias, out, stats, seed, offset)
    ctx.scalars = (scale, is_causal, dropout_p)


def _backward(ctx, d_out, _d_stats):
    q, k, v, bias, out, stats, seed, offset = ctx.saved_tensors
    if stats.numel() == 0:
        raise GraphStateError("cudnn_attn.sdpa: backward of a call made without gradients enabled")
    bias_grad = bias is not None and ctx.needs_input_grad[3]
    d_q, d_k, d_v, d_bias = _sdpa_backward(q, k, v, out, d_out, stats, bias, *ctx.scalars, seed, offset, bias_grad)
    return d_q, d_k, d_v, (d_bias if bias_grad else None), None, None, None, None, None, None


torch.library.register_autograd("cudnn_attn::sdpa_forward", _backward, setup_context=_setup_context)


def _like(t: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    out = torch.empty_strided(template.shape, template.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(t)


def _aliasing(tensors: list[Any]) -> tuple[int, ...]:
    """Which inputs are the same tensor: graphs count a tensor given twice once."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(id(t), i) for i, t in enumerate(tensors))


def _distinct(tensors: list[Any]) -> list[Any]:
    seen: set[int] = set()
    return [t for t in tensors if not (id(t) in seen or seen.add(id(t)))]  # type: ignore[func-returns-value]


# How errors from the graph name sdpa's own arguments.
_ARGUMENTS = {"q": "query", "k": "key", "v": "value", "attn_bias": "attn_mask", "attn_scale": "scale",
              "dropout": "dropout_p", "o": "output"}  # fmt: skip


def sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Scaled dot-product attention with torch's signature, on cached cuDNN graphs."""
    _check_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    squeeze = query.dim() == 3
    if squeeze:
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        attn_mask = attn_mask if attn_mask is None or attn_mask.dim() < 3 else attn_mask.unsqueeze(0)
    # cuDNN reads no broadcast (stride-0) q/k/v; torch's SDPA accepts them, so materialise.
    query, key, value = (_materialised(t) for t in (query, key, value))
    scale = float(scale) if scale is not None else default_scale(query.shape[-1])
    bias = None if attn_mask is None else _mask_as_bias(attn_mask, query, key.shape[-2])
    train = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, bias))
    seed = offset = None
    if dropout_p > 0:
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        offset = torch.zeros(1, dtype=torch.int64)
    try:
        out, _ = _sdpa_forward(query, key, value, bias, scale, bool(is_causal), float(dropout_p), seed, offset, train)
    except (ValidationError, UnsupportedError, ShapeMismatchError) as error:
        raise error.renamed(_ARGUMENTS, context="sdpa") from None
    return out.squeeze(0) if squeeze else out


def _check_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> None:
    """What torch's SDPA would refuse, refused here with one line per argument."""
    problems = []
    tensors = {"query": query, "key": key, "value": value}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            problems.append(f"{name}: {type(t).__name__}; expected a torch tensor")
        elif t.dtype not in FLOATING_IO:
            problems.append(f"{name}: dtype {dtype_name(t.dtype)}; expected float16 or bfloat16")
        elif t.dim() not in (3, 4):
            problems.append(f"{name}: {t.dim()}-D (shape {list(t.shape)}); expected [B, H, L, E] or [H, L, E]")
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        problems.append(f"attn_mask: {type(attn_mask).__name__}; expected a torch tensor (bool or float) or None")
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or not 0.0 <= dropout_p < 1.0:
        problems.append(f"dropout_p: {shown(dropout_p)}; expected a probability 0 <= p < 1")
    if scale is not None and (
        not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not math.isfinite(_as_float(scale))
    ):
        problems.append(f"scale: {shown(scale)}; expected a finite float or None")
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if not isinstance(flag, (bool, int)) or flag not in (0, 1):
            problems.append(f"{name}: {shown(flag)}; expected True or False")
    if problems:
        raise ValidationError(problems, context="sdpa")
    devices = {name: t.device for name, t in {**tensors, "attn_mask": attn_mask}.items() if t is not None}
    if len(set(devices.values())) > 1:
        where = ", ".join(f"{name} on {device}" for name, device in devices.items())
        problems.append(f"device: tensors are on several devices ({where}); put them on one device")
    if query.dim() != key.dim() or query.dim() != value.dim():
        problems.append(f"key: {key.dim()}-D and value: {value.dim()}-D; query is {query.dim()}-D, they must match")
    elif not enable_gqa and key.shape[-3] != query.shape[-3]:
        problems.append(
            f"key: {key.shape[-3]} heads differ from query's {query.shape[-3]}; pass enable_gqa=True for GQA/MQA"
        )
    if is_causal and attn_mask is not None:
        problems.append("is_causal: True together with attn_mask; give one (as torch requires)")
    if attn_mask is not None and not problems:
        target = (*query.shape[:-1], key.shape[-2])
        try:
            broadcast = torch.broadcast_shapes(attn_mask.shape, target)
        except RuntimeError:
            broadcast = None
        if broadcast != torch.Size(target) or attn_mask.dim() > len(target):
            problems.append(f"attn_mask: shape {list(attn_mask.shape)} does not broadcast to {list(target)}")
        if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            problems.append(f"attn_mask: dtype {attn_mask.dtype}; expected bool or a floating dtype")
    if problems:
        raise ValidationError(problems, context="sdpa")


def _as_float(value: Any) -> float:
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _materialised(t: torch.Tensor) -> torch.Tensor:
    """``t`` in a layout cuDNN reads: torch's SDPA takes any strides, the kernels need a
    contiguous head dim and no broadcast (stride-0) dims."""
    if t.stride(-1) != 1 and t.shape[-1] != 1 or any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        return t.contiguous()
    return t


def _clear_graphs() -> None:
    """Drop the functional form's graphs (their plans stay in the plan cache)."""
    _graphs.clear()


__all__ = ["sdpa"]
