"""Graph nodes: the arguments of one op, parsed into handles and problem fields.

Parsing never raises for bad input: every problem becomes a line in ``node.errors`` and
the graph reports all of them together when it is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .handles import InputHandle, OutputHandle
from .problem import AttentionProblem, Causal, KVCacheLayout, Op, TensorSpec, strides_like

if TYPE_CHECKING:
    from .graph import Graph
    from .ops.base import Plan

# Positional order of each op's inputs (API: "each node's in the order its signature lists them").
FORWARD_INPUTS = (
    "q", "k", "v", "bias", "seq_len_q", "seq_len_kv",
    "dropout_seed", "dropout_offset", "page_table_k", "page_table_v",
)  # fmt: skip
BACKWARD_INPUTS = (
    "q", "k", "v", "o", "d_o", "stats", "bias", "seq_len_q", "seq_len_kv", "dropout_seed", "dropout_offset",
)  # fmt: skip

# How roles are spelled to users (argument names of the ops).
USER_NAMES = {"bias": "attn_bias", "d_o": "dO", "d_q": "dQ", "d_k": "dK", "d_v": "dV", "d_bias": "dBias", "o": "o"}
OUTPUT_NAMES = {"o": "O", "stats": "Stats", "d_q": "dQ", "d_k": "dK", "d_v": "dV", "d_bias": "dBias"}


def user_name(role: str) -> str:
    return USER_NAMES.get(role, role)


@dataclass
class Node:
    op: Op
    name: str
    inputs: dict[str, InputHandle | OutputHandle] = field(default_factory=dict)
    outputs: dict[str, OutputHandle] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)  # scalar problem fields
    runtime: dict[str, int] = field(default_factory=dict)  # int dropout seed/offset
    errors: list[str] = field(default_factory=list)
    scale: float | None = None  # None: 1/sqrt(d_qk)
    problem: AttentionProblem | None = None
    plan: Plan | None = None
    backend: str | None = None


@dataclass
class MaskArgs:
    """The mask, bias and dropout keywords shared by sdpa and sdpa_backward."""

    attn_scale: Any = None
    use_causal_mask: bool = False
    use_causal_mask_bottom_right: bool = False
    sliding_window_length: Any = None
    diagonal_alignment: Any = None
    diagonal_band_left_bound: Any = None
    diagonal_band_right_bound: Any = None
    attn_bias: Any = None
    bias: Any = None
    use_alibi_mask: bool = False
    use_padding_mask: bool = False
    seq_len_q: Any = None
    seq_len_kv: Any = None
    max_seq_len_q: Any = None
    max_seq_len_kv: Any = None
    dropout: Any = None
    dropout_seed: Any = None
    dropout_offset: Any = None


def parse_masks(graph: Graph, node: Node, args: MaskArgs, q_is_thd: bool) -> None:
    """Fill ``node`` with the mask/bias/dropout inputs and options; errors go to node.errors."""
    e = node.errors
    node.scale = _scale(args.attn_scale, e)
    node.options["causal"] = _causal(args, e)
    node.options["sliding_window"] = _window(args, e)
    if args.attn_bias is not None and args.bias is not None:
        e.append("attn_bias: given twice (attn_bias= and its alias bias=); give one")
    graph._bind_input(node, "bias", args.attn_bias if args.attn_bias is not None else args.bias)
    node.options["alibi"] = _flag(args.use_alibi_mask, "use_alibi_mask", e)
    node.options["padding"] = _flag(args.use_padding_mask, "use_padding_mask", e) or q_is_thd
    graph._bind_input(node, "seq_len_q", args.seq_len_q)
    graph._bind_input(node, "seq_len_kv", args.seq_len_kv)
    node.options["max_seq_len_q"] = _positive_int(args.max_seq_len_q, "max_seq_len_q", e)
    node.options["max_seq_len_kv"] = _positive_int(args.max_seq_len_kv, "max_seq_len_kv", e)
    _dropout(graph, node, args)


def _flag(value: Any, name: str, errors: list[str]) -> bool:
    if not isinstance(value, (bool, int)) and value is not None:
        errors.append(f"{name}: {value!r}; expected True or False")
        return False
    return bool(value)


def _positive_int(value: Any, name: str, errors: list[str]) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        errors.append(f"{name}: {value!r}; expected an int >= 1")
        return None
    return value


def _scale(value: Any, errors: list[str]) -> float | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            errors.append(f"attn_scale: tensor of shape {list(value.shape)}; give a float or a one-element tensor")
            return None
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        errors.append(f"attn_scale: {value!r}; expected a float")
        return None
    if not math.isfinite(value):
        errors.append(f"attn_scale: {value}; must be finite")
        return None
    return float(value)


def _alignment_name(value: Any) -> str | None:
    if value is None:
        return None
    name = getattr(value, "name", value)
    return str(name).upper()


def _causal(args: MaskArgs, errors: list[str]) -> Causal:
    top = _flag(args.use_causal_mask, "use_causal_mask", errors)
    bottom = _flag(args.use_causal_mask_bottom_right, "use_causal_mask_bottom_right", errors)
    if top and bottom:
        errors.append(
            "use_causal_mask: both use_causal_mask and use_causal_mask_bottom_right are set; choose one diagonal"
        )
    alignment = _alignment_name(args.diagonal_alignment)
    if alignment not in (None, "TOP_LEFT", "BOTTOM_RIGHT"):
        errors.append(f"diagonal_alignment: {args.diagonal_alignment!r}; allowed TOP_LEFT or BOTTOM_RIGHT")
        alignment = None
    right = args.diagonal_band_right_bound
    if right is not None:
        if right != 0:
            errors.append(f"diagonal_band_right_bound: {right!r}; only 0 (a causal diagonal) is supported")
        elif not (top or bottom):
            top, bottom = alignment != "BOTTOM_RIGHT", alignment == "BOTTOM_RIGHT"
    elif alignment == "BOTTOM_RIGHT" and not bottom:
        errors.append(
            "diagonal_alignment: BOTTOM_RIGHT needs diagonal_band_right_bound=0 (or use_causal_mask_bottom_right)"
        )
    if bottom:
        return Causal.BOTTOM_RIGHT
    return Causal.TOP_LEFT if top else Causal.NONE


def _window(args: MaskArgs, errors: list[str]) -> int | None:
    window, left = args.sliding_window_length, args.diagonal_band_left_bound
    if window is not None and left is not None and window != left:
        errors.append(f"sliding_window_length: {window} disagrees with diagonal_band_left_bound={left}; give one")
    value = window if window is not None else left
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        errors.append(f"sliding_window_length: {value!r}; expected an int >= 1")
        return None
    return value  # range checked by validation, which sees the sequence lengths


def _dropout(graph: Graph, node: Node, args: MaskArgs) -> None:
    e = node.errors
    value, seed, offset = args.dropout, args.dropout_seed, args.dropout_offset
    p: Any = 0.0
    if isinstance(value, (tuple, list)):
        if len(value) == 3:
            p, tuple_seed, tuple_offset = value
            if seed is not None or offset is not None:
                e.append("dropout: a (p, seed, offset) tuple and dropout_seed/dropout_offset are both given; give one")
            seed, offset = tuple_seed, tuple_offset
        else:
            e.append(
                f"dropout: a tuple of {len(value)} items; give a probability or a (p, seed, offset) tuple "
                "(custom (mask, scale) dropout is not supported)"
            )
    elif value is not None:
        p = value
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        e.append(f"dropout: {p!r}; expected a probability in [0, 1)")
        p = 0.0
    node.options["dropout_p"] = float(p)
    for role, rng in (("dropout_seed", seed), ("dropout_offset", offset)):
        if rng is None or not p:
            continue
        if isinstance(rng, bool):
            e.append(f"{role}: {rng!r}; expected an int or a one-element int64 tensor")
        elif isinstance(rng, int):
            node.runtime[role] = rng
        else:
            graph._bind_input(node, role, rng)


def infer_cache_layout(k: TensorSpec, q: TensorSpec, explicit: Any, errors: list[str]) -> KVCacheLayout | None:
    """Which of [num_pages, page_size, H_kv, D] / [num_pages, H_kv, page_size, D] the cache is."""
    if explicit is not None:
        try:
            return KVCacheLayout(str(getattr(explicit, "value", explicit)).upper())
        except ValueError:
            errors.append(f"kv_cache_layout: {explicit!r}; allowed 'NPHD' ([pages, page_size, H_kv, D]) or 'NHPD'")
            return None
    if k.rank != 4 or q.rank != 4:
        return KVCacheLayout.NPHD  # validation reports the ranks
    h_q = q.shape[1]
    fits = [
        layout
        for layout, heads in ((KVCacheLayout.NPHD, k.shape[2]), (KVCacheLayout.NHPD, k.shape[1]))
        if h_q % heads == 0
    ]
    if len(fits) == 1:
        return fits[0]
    if not fits:
        errors.append(
            f"k: paged cache shape {list(k.shape)}: neither dim 1 ({k.shape[1]}) nor dim 2 ({k.shape[2]}) "
            f"is a K/V head count dividing q's {h_q} heads"
        )
        return KVCacheLayout.NPHD
    if k.shape[1] == k.shape[2]:
        return KVCacheLayout.NPHD  # page_size == H_kv: both readings gather the same way
    errors.append(
        f"k: paged cache shape {list(k.shape)} reads as [num_pages, page_size={k.shape[1]}, H_kv={k.shape[2]}, D] "
        f"or as [num_pages, H_kv={k.shape[1]}, page_size={k.shape[2]}, D]; pass kv_cache_layout='NPHD' or 'NHPD'"
    )
    return KVCacheLayout.NPHD


# ---- problem assembly (at build time) ------------------------------------------------------


def output_spec(handle: OutputHandle, default: TensorSpec) -> TensorSpec:
    """An output's geometry: its defaults, then whatever set_dim/set_stride/set_data_type said."""
    shape = handle.dim if handle.dim is not None else default.shape
    if handle.stride is not None:
        stride = handle.stride
    elif handle.dim is not None and len(shape) == len(default.stride):
        stride = strides_like(shape, default.stride)
    elif handle.dim is not None:
        stride = TensorSpec.contiguous(shape, default.dtype, default.device).stride
    else:
        stride = default.stride
    return TensorSpec(tuple(shape), tuple(stride), handle.dtype or default.dtype, default.device)


def like(spec: TensorSpec, last_dim: int | None = None, dtype: torch.dtype | None = None) -> TensorSpec:
    """A dense tensor with ``spec``'s layout (and optionally another last dim or dtype)."""
    shape = spec.shape if last_dim is None else tuple(spec.shape[:-1]) + (last_dim,)
    return TensorSpec(shape, strides_like(shape, spec.stride), dtype or spec.dtype, spec.device)
