"""Each op's recorded call, interpreted when the graph is built: its keywords parsed, its tensors
bound to input handles, its flags checked (``interpret_calls``, called by ``build.py``).

``Graph``'s op methods record their arguments by parameter name (``Recording.record_call``); each
function here reads them by those names, which ``ops_table.py`` declares. Problems become lines
of ``node.errors``, reported together at build.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..core.dtypes import to_torch_dtype
from .keywords import flag_true, stats_requested
from .node import Node
from .ops_table import BACKWARD, FP8, FP8_BACKWARD, PAGED, SDPA
from .state import Recording, bind_offsets

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


# Each op's interpretation of its recorded call, ``arguments`` by the names of its table row.


def interpret_sdpa(recording: Recording, node: Node, arguments: Mapping[str, Any]) -> None:
    recording.bind_call(node, SDPA.tensors(arguments), arguments["mask"], "sdpa")
    stats_requested(arguments["is_inference"], arguments["generate_stats"], node.errors)
    check_compute_dtype(arguments["compute_data_type"], node)
    table_k, table_v = arguments["paged_attention_k_table"], arguments["paged_attention_v_table"]
    max_seq_len_kv = arguments["paged_attention_max_seq_len_kv"]
    if table_k is not None or table_v is not None:
        table_v = table_v if table_v is not None else table_k
        recording.bind_paged(node, table_k, table_v, max_seq_len_kv, arguments["kv_cache_layout"])
    elif max_seq_len_kv is not None:
        node.errors.append("paged_attention_max_seq_len_kv: given without paged caches (paged_attention_k_table)")


def interpret_paged(recording: Recording, node: Node, arguments: Mapping[str, Any]) -> None:
    mask = dict(arguments["mask"])
    padding = mask.pop("use_padding_mask", True)
    mask.update(seq_len_q=arguments["seq_len_q"], seq_len_kv=arguments["seq_len_kv"])
    tensors = PAGED.tensors(arguments)
    page_table = tensors.pop("page_table_k")  # bound below, with V's table
    recording.bind_call(node, tensors, mask, "sdpa_with_paged_cache", PAGED_HINTS)
    node.spelling.update(page_table_k="page_table", page_table_v="page_table_v")
    if padding is not True:
        node.errors.append(f"use_padding_mask: {padding!r}; paged caches are always read through seq_len_kv")
    if page_table is None:
        node.errors.append("page_table: missing; give the [B, pages_per_seq] int32 page table of the caches")
    table_v = arguments["page_table_v"] if arguments["page_table_v"] is not None else page_table
    recording.bind_paged(node, page_table, table_v, arguments["max_seq_len_kv"], arguments["kv_cache_layout"])


def interpret_backward(recording: Recording, node: Node, arguments: Mapping[str, Any]) -> None:
    recording.bind_call(node, BACKWARD.tensors(arguments), arguments["mask"], "sdpa_backward")
    check_compute_dtype(arguments["compute_data_type"], node)
    deterministic = arguments["use_deterministic_algorithm"]
    for flag, value in (("use_deterministic_algorithm", deterministic), ("bias_grad", arguments["bias_grad"])):
        if value is not None and (not isinstance(value, (bool, int)) or value not in (0, 1)):  # None: the default
            node.errors.append(f"{flag}: {value!r}; expected True or False")
    node.deterministic = flag_true(deterministic)


def interpret_fp8(recording: Recording, node: Node, arguments: Mapping[str, Any]) -> None:
    mask, fn = arguments["mask"], arguments["fn"]
    if fn is not None:  # sdpa_fp8's name for score_mod (interpreted here, at build: the call's key holds both)
        if mask.get("score_mod") is not None:
            node.errors.append("fn: given beside score_mod; sdpa_fp8 takes its score modifier once, as fn")
        mask = {**mask, "score_mod": fn}
    recording.bind_call(node, FP8.tensors(arguments), mask, "sdpa_fp8")
    stats_requested(arguments["is_inference"], arguments["generate_stats"], node.errors)
    check_compute_dtype(arguments["compute_data_type"], node)


def interpret_fp8_backward(recording: Recording, node: Node, arguments: Mapping[str, Any]) -> None:
    mask = arguments["mask"]
    modifiers = [keyword for keyword in ("score_mod", "score_mod_bprop") if mask.get(keyword) is not None]
    node.errors += [
        f"{keyword}: not a keyword of sdpa_fp8_backward (the frontend's FP8 backward takes no score modifier)"
        for keyword in modifiers
    ]
    mask = {k: v for k, v in mask.items() if k not in modifiers}
    recording.bind_call(node, FP8_BACKWARD.tensors(arguments), mask, "sdpa_fp8_backward")
    check_compute_dtype(arguments["compute_data_type"], node)
    deterministic = arguments["use_deterministic_algorithm"]
    if deterministic is not None and (not isinstance(deterministic, (bool, int)) or deterministic not in (0, 1)):
        node.errors.append(f"use_deterministic_algorithm: {deterministic!r}; expected True or False")
    node.deterministic = deterministic is True or deterministic == 1


INTERPRETERS: dict[str, Callable[[Recording, Node, Mapping[str, Any]], None]] = {
    SDPA.name: interpret_sdpa,
    PAGED.name: interpret_paged,
    BACKWARD.name: interpret_backward,
    FP8.name: interpret_fp8,
    FP8_BACKWARD.name: interpret_fp8_backward,
}


def interpret_calls(recording: Recording) -> None:
    """Parse and bind every recorded call (once: a build that failed validation keeps them)."""
    calls, recording.calls, recording.interpreted = recording.calls, [], True
    for spec, node, arguments in calls:
        INTERPRETERS[spec.name](recording, node, arguments)
    for node in recording.nodes:
        bind_offsets(node)
