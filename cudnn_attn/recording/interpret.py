"""Each op's recorded call, interpreted when the graph is built: its keywords parsed, its tensors
bound to input handles, its flags checked (``Recording.interpret`` calls these).

``Graph``'s op methods record ``(interpret, node, args, mask)``; ``args`` holds the method's
arguments in its parameter order, which each function here takes by position. Problems become
lines of ``node.errors``, reported together at build.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.dtypes import to_torch_dtype
from ..core.roles import FP8_BACKWARD_SCALES, FP8_SCALES
from .keywords import stats_requested
from .node import Node
from .state import Recording

# Why a keyword is refused where users might expect it.
PAGED_HINTS = {
    "generate_stats": "paged attention is forward inference: it returns no stats",
    "is_inference": "paged attention is always inference",
    "paged_attention_k_table": "pass the page table as the 4th argument, page_table",
    "paged_attention_v_table": "use page_table_v",
}


def check_compute_dtype(value: Any, node: Node) -> None:
    try:
        dtype = to_torch_dtype(value, "compute_data_type")
    except TypeError as error:
        node.errors.append(str(error))
        return
    if dtype is not None and dtype != torch.float32:
        node.errors.append(f"compute_data_type: {dtype}; attention accumulates in float32 (data_type.FLOAT)")


def flag_true(flag: Any) -> bool:
    return flag is True or (type(flag) is int and flag == 1)


# Each op's interpretation of its recorded call: ``Recording.interpret`` calls them at build.


def interpret_sdpa(
    recording: Recording,
    node: Node,
    mask: dict[str, Any],
    q: Any,
    k: Any,
    v: Any,
    is_inference: Any,
    generate_stats: Any,
    table_k: Any,
    table_v: Any,
    max_seq_len_kv: Any,
    layout: Any,
    compute_data_type: Any,
    rng_dump: Any,
) -> None:
    recording.bind_call(node, {"q": q, "k": k, "v": v}, mask, "sdpa")
    stats_requested(is_inference, generate_stats, node.errors)
    check_compute_dtype(compute_data_type, node)
    if table_k is not None or table_v is not None:
        table_v = table_v if table_v is not None else table_k
        recording.bind_paged(node, table_k, table_v, max_seq_len_kv, layout)
    elif max_seq_len_kv is not None:
        node.errors.append("paged_attention_max_seq_len_kv: given without paged caches (paged_attention_k_table)")


def interpret_paged(
    recording: Recording,
    node: Node,
    mask: dict[str, Any],
    q: Any,
    k: Any,
    v: Any,
    page_table: Any,
    seq_len_q: Any,
    seq_len_kv: Any,
    page_table_v: Any,
    max_seq_len_kv: Any,
    layout: Any,
) -> None:
    mask = dict(mask)
    padding = mask.pop("use_padding_mask", True)
    mask.update(seq_len_q=seq_len_q, seq_len_kv=seq_len_kv)
    recording.bind_call(node, {"q": q, "k": k, "v": v}, mask, "sdpa_with_paged_cache", PAGED_HINTS)
    node.spelling.update(page_table_k="page_table", page_table_v="page_table_v")
    if padding is not True:
        node.errors.append(f"use_padding_mask: {padding!r}; paged caches are always read through seq_len_kv")
    if page_table is None:
        node.errors.append("page_table: missing; give the [B, pages_per_seq] int32 page table of the caches")
    table_v = page_table_v if page_table_v is not None else page_table
    recording.bind_paged(node, page_table, table_v, max_seq_len_kv, layout)


def interpret_backward(
    recording: Recording,
    node: Node,
    mask: dict[str, Any],
    q: Any,
    k: Any,
    v: Any,
    o: Any,
    d_o: Any,
    stats: Any,
    deterministic: Any,
    bias_grad: Any,
    d_bias: Any,
    compute_data_type: Any,
) -> None:
    tensors = {"q": q, "k": k, "v": v, "o": o, "grad_o": d_o, "stats": stats}
    recording.bind_call(node, tensors, mask, "sdpa_backward")
    check_compute_dtype(compute_data_type, node)
    for flag, value in (("use_deterministic_algorithm", deterministic), ("bias_grad", bias_grad)):
        if value is not None and (not isinstance(value, (bool, int)) or value not in (0, 1)):  # None: the default
            node.errors.append(f"{flag}: {value!r}; expected True or False")
    node.deterministic = flag_true(deterministic)


def interpret_fp8(
    recording: Recording,
    node: Node,
    mask: dict[str, Any],
    q: Any,
    k: Any,
    v: Any,
    scales: tuple,
    is_inference: Any,
    generate_stats: Any,
    compute_data_type: Any,
    fn: Any,
) -> None:
    if fn is not None:  # sdpa_fp8's name for score_mod (interpreted here, at build: the call's key holds both)
        if mask.get("score_mod") is not None:
            node.errors.append("fn: given beside score_mod; sdpa_fp8 takes its score modifier once, as fn")
        mask = {**mask, "score_mod": fn}
    recording.bind_call(node, {"q": q, "k": k, "v": v, **dict(zip(FP8_SCALES, scales))}, mask, "sdpa_fp8")
    stats_requested(is_inference, generate_stats, node.errors)
    check_compute_dtype(compute_data_type, node)


def interpret_fp8_backward(
    recording: Recording,
    node: Node,
    mask: dict[str, Any],
    q: Any,
    k: Any,
    v: Any,
    o: Any,
    d_o: Any,
    stats: Any,
    scales: tuple,
    deterministic: Any,
    compute_data_type: Any,
) -> None:
    modifiers = [keyword for keyword in ("score_mod", "score_mod_bprop") if mask.get(keyword) is not None]
    node.errors += [
        f"{keyword}: not a keyword of sdpa_fp8_backward (the frontend's FP8 backward takes no score modifier)"
        for keyword in modifiers
    ]
    mask = {k: v for k, v in mask.items() if k not in modifiers}
    tensors = {
        "q": q,
        "k": k,
        "v": v,
        "o": o,
        "grad_o": d_o,
        "stats": stats,
        **dict(zip(FP8_BACKWARD_SCALES, scales)),
    }
    recording.bind_call(node, tensors, mask, "sdpa_fp8_backward")
    check_compute_dtype(compute_data_type, node)
    if deterministic is not None and (not isinstance(deterministic, (bool, int)) or deterministic not in (0, 1)):
        node.errors.append(f"use_deterministic_algorithm: {deterministic!r}; expected True or False")
    node.deterministic = deterministic is True or deterministic == 1
