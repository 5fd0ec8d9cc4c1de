"""``cudnn_attn.sdpa`` on jagged nested tensors, torch's ``[B, H, (S), D]``, through the varlen door.

A jagged nested tensor (``torch.nested``, ``layout=torch.jagged``) already holds what
``varlen.varlen_attention`` takes: transposed to ``[B, (S), H, D]``, its ``values()`` are the
packed ``[T, H, D]`` tokens and its ``offsets()`` the cumulative lengths. So nested attention
is a repacking, not a kernel of its own: no padding is computed, gradients flow back through
torch's own views (``values()``, ``nested_tensor_from_jagged``), and ``is_causal=True`` works,
aligned top-left per sequence (torch's SDPA refuses causal nested inputs)::

    x = torch.nested.nested_tensor([a, b, c], layout=torch.jagged)  # [B, (S), E]
    q = q_proj(x).unflatten(-1, (H, D)).transpose(1, 2)             # [B, H, (S), D]
    out = cudnn_attn.sdpa(q, k, v, is_causal=True)                  # [B, H, (S), D_v], q's lengths
    # == for each i: F.scaled_dot_product_attention(q[i], k[i], v[i], is_causal=True)

k and v may have lengths of their own (cross-attention); they must share one ragged structure.
``sinks``, ``softcap`` and ``window_size`` act per sequence exactly as in the dense call (the window
measured from each sequence's top-left diagonal); what the packed door cannot take (dropout
beside sinks or softcap) is refused by name.
The longest length comes from torch's cache on the nested tensor where it has one; otherwise it
is computed once (a host sync on a GPU) and cached there for the tensors derived from it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..core.dtypes import dtype_name
from ..core.mask import Causal, unbounded_window, window_band
from ..errors import ShapeMismatchError, UnsupportedError, ValidationError
from ..varlen import varlen_attention
from .arguments import ARGUMENT_NAMES, causal_kind, check_arguments, materialised

# How the varlen door's errors name sdpa's arguments: each sequence tensor speaks for its lengths.
_NAMES = {
    **ARGUMENT_NAMES,
    "cu_seqlens_q": "query",
    "cu_seqlens_k": "key",
    "max_seqlen_q": "query",
    "max_seqlen_k": "key",
    "causal": "is_causal",
}


def nested_sdpa(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any,
    dropout_p: Any,
    is_causal: Any,
    scale: Any,
    enable_gqa: Any,
    sinks: Any = None,
    softcap: Any = None,
    window_size: Any = (-1, -1),
) -> torch.Tensor:
    """``cudnn_attn.sdpa`` where one of query/key/value/attn_mask is nested: checked, then run on
    the packed tokens; returns a jagged ``[B, H, (S_q), D_v]`` with q's lengths."""
    q, k, v = _checked(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    plain = sinks is None and softcap is None and unbounded_window(window_size)
    if plain and (float(dropout_p) >= 1 or (scale is not None and not math.isfinite(float(scale)))):
        # Degenerate calls torch answers (zeros for dropout_p=1, NaN for an inf or NaN scale) and
        # no kernel should: torch's own nested SDPA, as the dense door takes torch's math kernel.
        return torch.nn.functional.scaled_dot_product_attention(
            query,
            key,
            value,
            dropout_p=float(dropout_p),
            is_causal=bool(is_causal),
            scale=scale,
            enable_gqa=bool(enable_gqa),
        )
    causal, window_left, window_right = _band(window_size, is_causal)
    try:
        out = varlen_attention(
            _packed(q),
            _packed(k),
            _packed(v),
            q.offsets(),
            k.offsets(),
            _max_seqlen(q),
            _max_seqlen(k),
            causal=None if causal is Causal.NONE else causal.value,
            window_left=window_left,
            window_right=window_right,
            scale=scale,
            dropout_p=float(dropout_p),
            enable_gqa=bool(enable_gqa),
            sinks=sinks,
            softcap=softcap,
            context="sdpa",
        )
    except (ValidationError, UnsupportedError, ShapeMismatchError) as error:
        raise error.renamed(_NAMES, context="sdpa") from None
    nested = _jagged(out, q.offsets(), getattr(q, "_maybe_max_seqlen", None), getattr(q, "_maybe_min_seqlen", None))
    return nested.transpose(1, 2)


def _jagged(values: torch.Tensor, offsets: torch.Tensor, max_seqlen: Any, min_seqlen: Any) -> Any:
    """``values`` as a ``[B, (S), H, D]`` jagged view with ``offsets``. torch's public
    ``nested_tensor_from_jagged`` logs an fx-tracing warning on its first call; its body does not."""
    try:
        from torch.nested._internal.nested_tensor import nested_view_from_values_offsets_lengths
    except ImportError:  # a torch without it: the public door
        return torch.nested.nested_tensor_from_jagged(values, offsets, max_seqlen=max_seqlen, min_seqlen=min_seqlen)
    return nested_view_from_values_offsets_lengths(values, offsets, None, min_seqlen=min_seqlen, max_seqlen=max_seqlen)


def _band(window_size: Any, is_causal: Any) -> tuple[Causal, int | None, int | None]:
    """The dense call's causal mask and ``window_size`` as the packed door's ``(causal,
    window_left, window_right)``: all top-left per sequence, as the dense call measures them."""
    if window_size is None:
        window_size = (-1, -1)
    try:
        causal, window, right = window_band(window_size, causal_kind(is_causal))
    except ValueError as error:
        raise ValidationError([str(error)], context="sdpa") from None
    return causal, None if window is None else window - 1, right


def _checked(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> tuple[Any, Any, Any]:
    """query, key and value as ``[B, (S), H, D]`` (their ``values()`` packed ``[T, H, D]``), once
    every argument is checked; what the varlen door checks itself is left to it."""
    invalid, unsupported = _form_problems({"query": query, "key": key, "value": value}, attn_mask)
    if invalid:
        raise ValidationError(invalid, context="sdpa")
    if unsupported:
        raise UnsupportedError(
            unsupported,
            context="sdpa",
            alternatives=[
                "nested query/key/value of layout=torch.jagged, [B, H, (S), D], no attn_mask",
                "dense [B, H, S, D] tensors padded, with attn_mask",
            ],
        )
    check_arguments(query, key, value, None, dropout_p, is_causal, scale, enable_gqa)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    problems = []
    if not query.dtype == key.dtype == value.dtype:  # said as dense sdpa says it, naming query
        problems.append(
            f"query: dtype {dtype_name(query.dtype)} but key is {dtype_name(key.dtype)} and value "
            f"{dtype_name(value.dtype)}; query, key and value must share one dtype"
        )
    problems += [
        f"{name}: batch {t.shape[0]} differs from query's {q.shape[0]}; one sequence per query sequence"
        for name, t in (("key", k), ("value", v))
        if t.shape[0] != q.shape[0]
    ]
    # An empty packing would run on a warm plan and be refused by a cold one: refused here, as dense sdpa does.
    problems += [
        f"{name}: no tokens (every sequence is empty); at least one is needed, as in dense sdpa"
        for name, t in (("query", q), ("key", k), ("value", v))
        if t.values().shape[0] == 0
    ]
    if not problems and k.offsets() is not v.offsets() and not torch.equal(k.offsets(), v.offsets()):
        problems.append("value: sequence lengths differ from key's; key and value must share their lengths")
    if problems:
        raise ValidationError(problems, context="sdpa")
    return q, k, v


def _form_problems(tensors: dict[str, Any], attn_mask: Any) -> tuple[list[str], list[str]]:
    """(malformed, unsupported): one line per problem, naming the argument."""
    invalid: list[str] = []
    unsupported: list[str] = []
    nested = [name for name, t in tensors.items() if _is_nested(t)]
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            invalid.append(f"{name}: {type(t).__name__}; expected a torch tensor")
        elif not t.is_nested:
            if nested:
                invalid.append(
                    f"{name}: a dense tensor, but {nested[0]} is nested; give query, key and value "
                    "all nested (layout=torch.jagged) or all dense"
                )
        elif t.layout is not torch.jagged:
            unsupported.append(f"{name}: a nested tensor of layout {t.layout}; expected layout=torch.jagged")
        elif t.device.type == "meta":  # torch's own call fails on it too
            unsupported.append(f"{name}: a nested tensor on the meta device; its sequence lengths have no values")
        elif t.dim() != 4:
            invalid.append(f"{name}: {t.dim()}-D nested tensor; expected 4-D [B, H, (S), D]")
        elif t._ragged_idx != 2:  # type: ignore[attr-defined]
            invalid.append(
                f"{name}: ragged dim {t._ragged_idx} (shape {list(t.shape)}); expected the sequence dim, "  # type: ignore[attr-defined]
                "[B, H, (S), D]: a [B, (S), H, D] tensor needs .transpose(1, 2)"
            )
        elif t.lengths() is not None:  # type: ignore[attr-defined]
            unsupported.append(f"{name}: a nested tensor with holes (offsets and lengths); call .contiguous() first")
    if attn_mask is not None:
        if nested:
            unsupported.append(
                "attn_mask: not supported with nested query/key/value (as in torch's SDPA); "
                "is_causal=True gives a causal mask per sequence"
            )
        elif _is_nested(attn_mask):
            invalid.append(
                "attn_mask: a nested tensor; expected a dense bool or float tensor broadcastable to [B, H, L, S]"
            )
    return invalid, unsupported


def _is_nested(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_nested


def _packed(nt: Any) -> torch.Tensor:
    """The packed ``[T, H, D]`` tokens of a ``[B, (S), H, D]`` nested tensor, token-major (as the
    ragged layout reads them: torch's own nested SDPA makes the same copy)."""
    values = materialised(nt.values())
    if values.stride(0) < max(values.stride(1), values.stride(2)):
        values = values.contiguous()
    return values


def _max_seqlen(nt: Any) -> int:
    """The longest sequence (at least 1, as the varlen door takes it): torch's cached value where
    it has one, else computed from the offsets (a host sync on a GPU) and cached by torch."""
    get = getattr(nt, "_get_max_seqlen", None)
    longest = get() if get is not None else int((nt.offsets()[1:] - nt.offsets()[:-1]).max())
    return max(int(longest), 1)


__all__ = ["nested_sdpa"]
