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
from collections.abc import Callable
from typing import Any

import torch

from ..core.dtypes import FLOATING_IO, dtype_name
from ..core.finite import flag as is_flag
from ..core.finite import integer
from ..core.mask import Causal, default_scale, unbounded_window
from ..errors import ValidationError, shown

# What torch's SDPA takes; float64 runs on torch's own kernel (ops/torch/reasons.py).
TORCH_FLOATING = (*FLOATING_IO, torch.float64)

# How errors from the graph name sdpa's own arguments.
ARGUMENT_NAMES = {
    "q": "query",
    "k": "key",
    "v": "value",
    "attn_bias": "attn_mask",
    "attn_scale": "scale",
    "dropout": "dropout_p",
    "o": "output",
}


def causal_from_mask(attn_mask: Any, is_causal: Any, query: Any, key: Any) -> tuple[Any, Any]:
    """``(attn_mask, is_causal)`` with torch's ``CausalBias`` objects read as what they mean.

    ``causal_upper_left(L, S)`` is top-left causal and ``causal_lower_right(L, S)`` bottom-right
    (the same when L == S, as torch maps it); either becomes ``is_causal=Causal.X`` with no mask.
    Any other tensor subclass is refused by name: its storage is not the values it stands for.
    ``is_causal=True`` beside a mask tensor is folded into the mask (torch 2.13 applies both).
    """
    if not isinstance(attn_mask, torch.Tensor) or type(attn_mask) is torch.Tensor:
        if _causal_beside(attn_mask, is_causal, query, key):
            return _with_causal(attn_mask, query, key), False
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
        if _causal_beside(attn_mask, is_causal, query, key):
            return _with_causal(attn_mask, query, key), False
        return attn_mask, is_causal
    raise ValidationError([_subclass_problem("attn_mask", attn_mask)], context="sdpa")


def _with_causal(attn_mask: torch.Tensor, query: Any, key: Any) -> torch.Tensor:
    """``attn_mask`` and the top-left causal mask as one mask, as torch 2.13 applies the two
    together (its math kernel alone refuses the pair, so every route gets the one mask)."""
    l, s = query.shape[-2], key.shape[-2]  # noqa: E741
    keep = torch.ones(l, s, dtype=torch.bool, device=attn_mask.device).tril()
    if attn_mask.dtype == torch.bool:
        return attn_mask & keep
    return attn_mask.masked_fill(~keep, float("-inf"))


def _causal_beside(attn_mask: Any, is_causal: Any, query: Any, key: Any) -> bool:
    """Whether a well-formed call gives ``is_causal=True`` together with a plain mask."""
    if attn_mask is None or not isinstance(attn_mask, torch.Tensor) or attn_mask.is_nested:
        return False
    if isinstance(is_causal, bool) and is_causal or type(is_causal) is int and is_causal == 1:
        floating = attn_mask.dtype == torch.bool or attn_mask.dtype.is_floating_point
        tensors = all(isinstance(t, torch.Tensor) and not t.is_nested and t.dim() >= 2 for t in (query, key))
        if not (floating and tensors):
            return False  # refused by check_arguments
        rows = attn_mask.shape[-2] if attn_mask.dim() >= 2 else 1
        cols = attn_mask.shape[-1] if attn_mask.dim() >= 1 else 1
        return rows in (1, query.shape[-2]) and cols in (1, key.shape[-2])  # else its shape is refused
    return False


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
    kind = query.device.type
    if not torch.amp.is_autocast_available(kind) or not torch.is_autocast_enabled(kind):
        return query, key, value, attn_mask  # meta and other devices have no autocast to ask about
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


def _layout(t: torch.Tensor) -> str:
    return str(t.layout).removeprefix("torch.")


def check_arguments(
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, *, sinks=None, softcap=None, window_size=None
) -> None:
    """What torch's SDPA would refuse, refused here in one ``ValidationError`` listing every problem.

    Only a problem that makes another undecidable hides it: a tensor that is not a float tensor
    of a taken rank is left out of the checks between tensors (devices, dtypes, batch, heads,
    head dims, lengths), and the mask's shape is checked once query and key are."""
    problems = []
    tensors = {"query": query, "key": key, "value": value}
    usable = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            problems.append(f"{name}: {type(t).__name__}; expected a torch tensor")
        elif not _readable(t):
            problems.append(_subclass_problem(name, t))
        elif t.layout != torch.strided and not t.is_nested:
            problems.append(f"{name}: a {_layout(t)} tensor; expected a dense (strided) one (.to_dense())")
        elif t.dtype not in TORCH_FLOATING:
            problems.append(f"{name}: dtype {dtype_name(t.dtype)}; expected float16, bfloat16, float32 or float64")
        elif t.dim() < 2:
            problems.append(f"{name}: {t.dim()}-D (shape {list(t.shape)}); expected [..., H, L, E] or [L, E]")
        else:
            usable[name] = t
    mask = attn_mask if isinstance(attn_mask, torch.Tensor) else None
    if attn_mask is not None and mask is None:
        problems.append(f"attn_mask: {type(attn_mask).__name__}; expected a torch tensor (bool or float) or None")
    if mask is not None and mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        problems.append(f"attn_mask: dtype {mask.dtype}; expected bool or a floating dtype")
    if mask is not None and mask.layout != torch.strided and not mask.is_nested:
        problems.append(f"attn_mask: a {_layout(mask)} tensor; expected a dense (strided) one (.to_dense())")
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or not 0.0 <= dropout_p <= 1.0:
        problems.append(f"dropout_p: {shown(dropout_p)}; expected a probability 0 <= p <= 1")
    if scale is not None and not _scalar(scale):
        problems.append(f"scale: {shown(scale)}; expected a float (or a 0-d tensor) or None")
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if name == "is_causal" and isinstance(flag, Causal):
            continue  # a variant read from a CausalBias mask
        if not is_flag(flag):
            problems.append(f"{name}: {shown(flag)}; expected True or False")
    problems += score_term_problems(sinks, softcap, window_size, query if "query" in usable else None)
    if len(usable) == 3 and not any(t.is_nested for t in usable.values()):
        problems += _geometry_problems(query, key, value, mask, bool(enable_gqa))
    if problems:
        raise ValidationError(problems, context="sdpa")


def broadcast_shapes(query: Any, key: Any, value: Any, enable_gqa: Any) -> list[torch.Size] | None:
    """The shapes query, key and value take over the batch and head dims torch's SDPA
    broadcasts (a size of 1 against n, as its matmuls broadcast them, a missing leading dim
    counting as 1); None where they agree already, or do not broadcast (the checks then name
    what differs). With enable_gqa the heads are left as they are, as torch leaves them."""
    tensors = (query, key, value)
    if not all(type(t) is torch.Tensor for t in tensors) or min(t.dim() for t in tensors) < 2:
        return None
    rank = max(t.dim() for t in tensors)
    if rank < 3 or query.shape[:-2] == key.shape[:-2] == value.shape[:-2]:
        return None
    dims = [(1,) * (rank - t.dim()) + tuple(t.shape) for t in tensors]  # expand() prepends them
    heads = [d[-3] for d in dims]
    try:
        batch = torch.broadcast_shapes(*(d[:-3] for d in dims))
        # With enable_gqa torch groups heads and broadcasts none (it refuses counts that do not divide).
        shared = None if enable_gqa else torch.broadcast_shapes(*((h,) for h in heads))[0]
    except RuntimeError:
        return None
    shapes = [torch.Size((*batch, d[-3] if shared is None else shared, *d[-2:])) for d in dims]
    return None if shapes == [t.shape for t in tensors] else shapes


Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def broadcast(tensors: Triple, shapes: list[torch.Size]) -> Triple:
    """query, key and value expanded to ``shapes``: views, copied on CUDA (torch never hands its
    fused CUDA kernels stride-0 inputs; the graphs copy them in any case)."""
    q, k, v = (t.expand(shape) for t, shape in zip(tensors, shapes))
    return (q.contiguous(), k.contiguous(), v.contiguous()) if q.is_cuda else (q, k, v)


def probability(dropout_p: Any) -> Any:
    """``dropout_p`` as the float torch's SDPA reads from a real number or a 0-d real tensor (its
    value checked later); anything else as given, for the checks to name."""
    if _scalar(dropout_p) and not isinstance(dropout_p, bool):
        return float(dropout_p)
    return dropout_p


def _scalar(value: Any) -> bool:
    """A scale torch's SDPA takes: any real number (inf and NaN included, as there), or a 0-d
    real tensor, which it reads as a float."""
    if isinstance(value, torch.Tensor):  # 0-d, as torch reads it (a [1] tensor it refuses)
        return value.dim() == 0 and not value.is_complex() and value.dtype != torch.bool
    if not isinstance(value, numbers.Real):
        return False
    try:  # 10**400 is a real number no float holds (torch refuses it too)
        float(value)
    except OverflowError:
        return False
    return True


def _geometry_problems(query, key, value, mask, enable_gqa: bool) -> list[str]:
    """What must agree between query, key, value and the mask: every disagreement, once each."""
    problems = []
    named = (("query", query), ("key", key), ("value", value), ("attn_mask", mask))
    devices = {name: t.device for name, t in named if t is not None}
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
        return problems  # which dimension is which is undecidable
    h_q = heads_of(query)
    for name, t in (("key", key), ("value", value)):
        h = heads_of(t)
        if not enable_gqa and h != h_q:
            problems.append(f"{name}: {h} heads differ from query's {h_q}; pass enable_gqa=True for GQA/MQA")
        elif enable_gqa and h_q and (h == 0 or h_q % h):  # no query heads: torch's empty output
            problems.append(f"{name}: {h} heads do not divide query's {h_q} (enable_gqa=True needs H_kv to divide H_q)")
        if t.shape[:-3] != query.shape[:-3]:
            problems.append(f"{name}: batch {list(t.shape[:-3])} differs from query's {list(query.shape[:-3])}")
    if key.shape[-1] != query.shape[-1]:
        problems.append(f"key: head dim {key.shape[-1]} differs from query's {query.shape[-1]}; they must match")
    if value.shape[-2] != key.shape[-2]:
        problems.append(f"value: {value.shape[-2]} keys but key has {key.shape[-2]}; they must match")
    if mask is not None:
        target = (*query.shape[:-1], key.shape[-2])
        try:
            broadcast = torch.broadcast_shapes(mask.shape, target)
        except RuntimeError:
            broadcast = None
        if broadcast != torch.Size(target) or mask.dim() > len(target):
            problems.append(f"attn_mask: shape {list(mask.shape)} does not broadcast to {list(target)}")
    return problems


def score_term_problems(sinks: Any, softcap: Any, window_size: Any, query: torch.Tensor | None) -> list[str]:
    """``sinks``, ``softcap`` and ``window_size`` as ``sdpa`` takes them (None: not given)."""
    problems = []
    if window_size is not None and not _is_window(window_size):
        problems.append(
            f"window_size: {shown(window_size)}; expected a (left, right) pair of ints (negative: no bound), or None"
        )
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap <= 0
    ):
        problems.append(f"softcap: {shown(softcap)}; expected a finite number > 0 (scores become cap * tanh(s / cap))")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            problems.append(f"sinks: {type(sinks).__name__}; expected a tensor of one logit per query head")
        elif query is not None:
            heads = heads_of(query)
            if sinks.numel() != heads or sinks.dim() not in (1, 4) or not sinks.is_floating_point():
                problems.append(
                    f"sinks: shape {list(sinks.shape)} dtype {sinks.dtype}; expected a real tensor of "
                    f"[{heads}] or [1, {heads}, 1, 1] (one logit per query head)"
                )
            if sinks.device != query.device:
                problems.append(f"sinks: on {sinks.device}; query is on {query.device}")
    return problems


def _is_window(window_size: Any) -> bool:
    return isinstance(window_size, (tuple, list)) and len(window_size) == 2 and all(integer(w) for w in window_size)


def score_terms_given(sinks: Any, softcap: Any, window_size: Any) -> bool:
    """Whether a call takes the score-terms path: any of the three given (None or two negative
    bounds is no window; anything else, malformed included, is checked there)."""
    if sinks is not None or softcap is not None:
        return True
    return window_size is not None and not unbounded_window(window_size)


def _plain_subclasses() -> tuple[type, ...]:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return (torch.nn.Parameter, FakeTensor, FunctionalTensor)


_PLAIN_SUBCLASSES = _plain_subclasses()


def materialised(t: torch.Tensor) -> torch.Tensor:
    """``t`` in a layout cuDNN reads: torch's SDPA takes any strides, the kernels need a
    contiguous head dim and no broadcast (stride-0) dims."""
    if t.stride(-1) != 1 and t.shape[-1] != 1 or any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        return dense(t)
    return t


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` row-major: ``contiguous()`` keeps an empty tensor's strides (torch calls every empty
    tensor contiguous), which the layout checks would refuse."""
    return t.clone(memory_format=torch.contiguous_format) if t.numel() == 0 else t.contiguous()


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
        attn_mask = dense(attn_mask)
    return attn_mask


def batched(
    query, key, value, attn_mask, scale
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any, float, Restore]:
    """A checked call's tensors as the plans take them: ``[B, H, S, D]`` (torch's ``[L, E]`` is one
    head of a batch of one, ``[H, L, E]`` a batch of one, ``[N, ..., H, L, E]`` a batch of N x ...;
    ``restore`` gives the output back the caller's rank), each a layout cuDNN reads, the scale
    resolved and the mask as an additive bias."""
    lead = query.shape[:-3]
    restore = _restore(query.dim(), lead)
    if query.dim() != 4:
        query, key, value = (_as_4d(t) for t in (query, key, value))
        if attn_mask is not None and attn_mask.dim() > 3 and len(lead) > 1:
            # broadcast over the caller's batch dims, then flattened with them
            flat = math.prod(lead)  # not -1: ambiguous for an empty mask
            attn_mask = attn_mask.expand(*lead, *attn_mask.shape[-3:]).reshape(flat, *attn_mask.shape[-3:])
    query, key, value = (materialised(t) for t in (query, key, value))
    scale = float(scale) if scale is not None else default_scale(query.shape[-1])
    bias = None if attn_mask is None else mask_as_bias(attn_mask, query, key.shape[-2])
    return query, key, value, bias, scale, restore


Restore = Callable[[torch.Tensor], torch.Tensor]


def heads_of(t: torch.Tensor) -> int:
    """Heads of a torch-style ``[..., H, L, E]`` tensor (``[L, E]``: one)."""
    return t.shape[-3] if t.dim() >= 3 else 1


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """``[L, E]``, ``[H, L, E]`` or ``[N, ..., H, L, E]`` as ``[B, H, L, E]`` (a view where it can be)."""
    if t.dim() <= 3:
        return t[(None,) * (4 - t.dim())]
    return t.reshape(math.prod(t.shape[:-3]), *t.shape[-3:])  # not -1: a dim of 0 leaves it undefined


def _restore(rank: int, lead: torch.Size) -> Restore:
    """The output ``[B, H, L, Ev]`` back in the caller's rank."""
    if rank == 4:
        return lambda out: out
    if rank <= 3:
        return lambda out: out[(0,) * (4 - rank)]
    return lambda out: out.reshape(*lead, *out.shape[1:])
