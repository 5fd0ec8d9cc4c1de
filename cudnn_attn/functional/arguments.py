"""The functional form's arguments: checked as torch's SDPA would check them, then brought to
what cuDNN reads (an additive 4-D bias from any mask, q/k/v in readable layouts).

torch's own conventions come first: under ``torch.autocast`` floating inputs are cast to the
autocast dtype (``autocast_inputs``), and torch's ``CausalBias`` mask objects become causal
variants, never dense memory (``causal_from_mask``).
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import Any

import torch

from ..core.dtypes import FLOATING_IO, dtype_name
from ..core.mask import Causal, default_scale
from ..errors import ValidationError, shown

# What torch's SDPA takes; float64 runs on torch's own kernel (torch_kernel.py).
TORCH_FLOATING = (*FLOATING_IO, torch.float64)

# How errors from the graph name sdpa's own arguments.
ARGUMENT_NAMES = {"q": "query", "k": "key", "v": "value", "attn_bias": "attn_mask", "attn_scale": "scale",
                  "dropout": "dropout_p", "o": "output"}  # fmt: skip


def causal_from_mask(attn_mask: Any, is_causal: Any, query: Any, key: Any) -> tuple[Any, Any]:
    """``(attn_mask, is_causal)`` with torch's ``CausalBias`` objects read as what they mean.

    ``causal_upper_left(L, S)`` is top-left causal and ``causal_lower_right(L, S)`` bottom-right
    (the same when L == S, as torch maps it); either becomes ``is_causal=Causal.X`` with no mask.
    Any other tensor subclass is refused by name: its storage is not the values it stands for.
    """
    if not isinstance(attn_mask, torch.Tensor) or type(attn_mask) is torch.Tensor:
        return attn_mask, is_causal  # None, plain, or not a tensor (refused by check_arguments)
    # A CausalBias exists only once its module is imported; importing it here would load
    # torch._dynamo with it (about 1 s of start-up).
    bias = sys.modules.get("torch.nn.attention.bias")
    if bias is not None and isinstance(attn_mask, bias.CausalBias):
        problems = []
        if is_causal is not False and is_causal != 0:
            problems.append("is_causal: True together with a CausalBias attn_mask; the bias already is the causal mask")
        if isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and query.dim() >= 2 and key.dim() >= 2:
            given, expected = (attn_mask.seq_len_q, attn_mask.seq_len_kv), (query.shape[-2], key.shape[-2])
            if given != expected:
                problems.append(
                    f"attn_mask: CausalBias for L={given[0]}, S={given[1]} but query and key have L={expected[0]}, "
                    f"S={expected[1]}"
                )
        if problems:
            raise ValidationError(problems, context="sdpa")
        upper_left = attn_mask.variant == bias.CausalVariant.UPPER_LEFT or attn_mask.seq_len_q == attn_mask.seq_len_kv
        return None, Causal.TOP_LEFT if upper_left else Causal.BOTTOM_RIGHT
    if _readable(attn_mask):
        return attn_mask, is_causal
    raise ValidationError([_subclass_problem("attn_mask", attn_mask)], context="sdpa")


def _readable(t: torch.Tensor) -> bool:
    """A tensor whose storage holds its values: plain tensors, parameters, the tensors torch's
    tracers substitute (fake and functional tensors), and nested tensors."""
    if type(t) is torch.Tensor or isinstance(t, _PLAIN_SUBCLASSES) or torch.compiler.is_compiling():
        return True
    return t.is_nested  # read through its values() by the nested door


def _subclass_problem(name: str, t: torch.Tensor) -> str:
    return (
        f"{name}: a {type(t).__name__} (a torch.Tensor subclass whose storage cudnn_attn cannot read as its values); "
        "pass a plain torch.Tensor"
    )


def autocast_inputs(query: Any, key: Any, value: Any, attn_mask: Any) -> tuple[Any, Any, Any, Any]:
    """The inputs as torch's SDPA sees them under ``torch.autocast``: every floating tensor but
    float64 cast to the autocast dtype (torch's lower-precision op list), masks included."""
    # torch's one-call check first: reading query.device costs more than the whole check.
    if not torch._C._is_any_autocast_enabled() or not isinstance(query, torch.Tensor):
        return query, key, value, attn_mask
    if not torch.is_autocast_enabled(query.device.type):
        return query, key, value, attn_mask
    dtype = torch.get_autocast_dtype(query.device.type)

    def cast(t: Any) -> Any:
        eligible = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype not in (torch.float64, dtype)
        return t.to(dtype) if eligible else t

    return cast(query), cast(key), cast(value), cast(attn_mask)


def causal_kind(is_causal: Any) -> Causal:
    """``is_causal`` as a variant: a bool (top-left when true) or a ``Causal`` from a CausalBias."""
    if isinstance(is_causal, Causal):
        return is_causal
    return Causal.TOP_LEFT if is_causal else Causal.NONE


def check_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> None:
    """What torch's SDPA would refuse, refused here with one line per argument."""
    problems = []
    tensors = {"query": query, "key": key, "value": value}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            problems.append(f"{name}: {type(t).__name__}; expected a torch tensor")
        elif not _readable(t):
            problems.append(_subclass_problem(name, t))
        elif t.dtype not in TORCH_FLOATING:
            problems.append(f"{name}: dtype {dtype_name(t.dtype)}; expected float16, bfloat16, float32 or float64")
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
        if name == "is_causal" and isinstance(flag, Causal):
            continue  # a variant read from a CausalBias mask
        if not isinstance(flag, (bool, int)) or flag not in (0, 1):
            problems.append(f"{name}: {shown(flag)}; expected True or False")
    if problems:
        raise ValidationError(problems, context="sdpa")
    devices = {name: t.device for name, t in {**tensors, "attn_mask": attn_mask}.items() if t is not None}
    if len(set(devices.values())) > 1:
        where = ", ".join(f"{name} on {device}" for name, device in devices.items())
        problems.append(f"device: tensors are on several devices ({where}); put them on one device")
    if len({query.dtype, key.dtype, value.dtype}) > 1:
        problems.append(
            f"query: dtype {dtype_name(query.dtype)} but key is {dtype_name(key.dtype)} and value "
            f"{dtype_name(value.dtype)}; query, key and value must share one dtype"
        )
    if query.dim() != key.dim() or query.dim() != value.dim():
        problems.append(f"key: {key.dim()}-D and value: {value.dim()}-D; query is {query.dim()}-D, they must match")
    elif not enable_gqa and key.shape[-3] != query.shape[-3]:
        problems.append(
            f"key: {key.shape[-3]} heads differ from query's {query.shape[-3]}; pass enable_gqa=True for GQA/MQA"
        )
    if causal_kind(is_causal) is not Causal.NONE and attn_mask is not None:
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


def _plain_subclasses() -> tuple[type, ...]:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return (torch.nn.Parameter, FakeTensor, FunctionalTensor)


_PLAIN_SUBCLASSES = _plain_subclasses()


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


def batched(query, key, value, attn_mask, scale) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any, float, bool]:
    """A checked call's tensors as the plans take them: ``[B, H, S, D]`` (``[H, S, D]`` gets a batch
    of one: ``squeeze`` says to drop it from the output), each a layout cuDNN reads, the scale
    resolved and the mask as an additive bias."""
    squeeze = query.dim() == 3
    if squeeze:
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        attn_mask = attn_mask if attn_mask is None or attn_mask.dim() < 3 else attn_mask.unsqueeze(0)
    query, key, value = (materialised(t) for t in (query, key, value))
    scale = float(scale) if scale is not None else default_scale(query.shape[-1])
    bias = None if attn_mask is None else mask_as_bias(attn_mask, query, key.shape[-2])
    return query, key, value, bias, scale, squeeze
