"""The functional form's arguments: checked as torch's SDPA would check them, then brought to
what cuDNN reads (an additive 4-D bias from any mask, q/k/v in readable layouts)."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from .data_type import FLOATING_IO, dtype_name
from .errors import ValidationError, shown

# How errors from the graph name sdpa's own arguments.
ARGUMENT_NAMES = {"q": "query", "k": "key", "v": "value", "attn_bias": "attn_mask", "attn_scale": "scale",
                  "dropout": "dropout_p", "o": "output"}  # fmt: skip


def check_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> None:
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


def materialised(t: torch.Tensor) -> torch.Tensor:
    """``t`` in a layout cuDNN reads: torch's SDPA takes any strides, the kernels need a
    contiguous head dim and no broadcast (stride-0) dims."""
    if t.stride(-1) != 1 and t.shape[-1] != 1 or any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        return t.contiguous()
    return t


def mask_as_bias(attn_mask: torch.Tensor, q: torch.Tensor, s_kv: int) -> torch.Tensor:
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
