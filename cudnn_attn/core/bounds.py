"""Run-time integer inputs (sequence lengths, page indices, ragged offsets): checked on the host where their
values are at hand (``value_problems``), made safe on the device where they are not.

Checking their values would read them to the host: a sync per call. Instead they are
clamped into range on the device (no sync, capturable), so whatever values arrive no kernel
reads or writes outside the tensors. Rows with out-of-range values get meaningless results;
where values are on the host anyway, ``value_problems`` raises for them instead.
The clamped tensors are derived once per content of each input (``derived``), not
once per layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .derived import derived
from .problem import AttentionProblem
from .ragged import (
    clamp_offsets,
    clamp_packed_offsets,
    gather_rows,
    memory_span,
    offset_bounds,
    offset_value_problems,
    packed_roles,
)
from .roles import offset_role, sequence_lengths


def upper_bounds(p: AttentionProblem) -> dict[str, int]:
    """The largest valid value of each integer input of ``p`` that addresses memory."""
    bounds = {
        "seq_len_q": p.s_q,
        "seq_len_kv": p.s_kv,
        "page_table_k": p.k.shape[0] - 1,
        "page_table_v": p.v.shape[0] - 1,
    }
    return {role: high for role, high in bounds.items() if getattr(p, role) is not None}


def clamped(
    p: AttentionProblem, inputs: Mapping[str, Any], bounds: Mapping[str, int], outputs: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``inputs`` with every bounded tensor clamped into range, and packed (THD) sequences cut
    so that they end inside the packed tensors. Derived once per content of each input tensor
    (``derived``): decode passes the same lengths and page tables to every layer. The offsets of
    a packed tensor given as 4-D (``ragged.packed_roles``) are clamped to the memory bound to it
    (``outputs`` hold the outputs'), at every run."""
    safe: dict[str, Any] = dict(inputs)
    # The packed tensors' real token counts: one plan serves every count (problem.for_plan).
    packed_tokens = {"seq_len_q": inputs["q"].shape[0]} if p.is_thd else {}
    if p.is_thd and not p.is_paged:
        packed_tokens["seq_len_kv"] = inputs["k"].shape[0]
    for role, high in bounds.items():
        value = safe.get(role)
        if isinstance(value, torch.Tensor) and role not in packed_tokens:
            safe[role] = derived(value, clamp_lengths if role.startswith("seq_len") else clamp_into, high)
    for role, tokens in packed_tokens.items():
        safe[role] = derived(safe[role], packed_lengths, bounds.get(role), tokens)
    if p.offset_tensors:  # the caller's ragged offsets: every sequence starts inside its tensor
        for role, (high, last) in offset_bounds(p).items():
            value = safe.get(role)
            if isinstance(value, torch.Tensor):
                safe[role] = derived(value, clamp_offsets, high, last)
        for role in packed_roles(p):
            value, target = safe.get(offset_role(role)), inputs.get(role, (outputs or {}).get(role))
            if isinstance(value, torch.Tensor) and isinstance(target, torch.Tensor):
                lengths = safe.get(sequence_lengths(role))
                safe[offset_role(role)] = clamp_packed_offsets(
                    value, lengths if isinstance(lengths, torch.Tensor) else None, memory_span(target), getattr(p, role)
                )
    return safe


def clamp_into(value: torch.Tensor, high: int) -> torch.Tensor:
    return value.clamp(0, high)


def clamp_lengths(value: torch.Tensor, high: int) -> torch.Tensor:
    """Lengths clamped, as int32 (the dtype cuDNN's plans read; int64 lengths are taken too)."""
    return value.clamp(0, high).to(torch.int32)


def packed_lengths(lengths: torch.Tensor, high: int | None, tokens: int) -> torch.Tensor:
    """THD lengths clamped into ``[0, high]`` (where bounded), then cut so that the packed
    sequences end within ``tokens``: a sequence past the end is shortened, later ones emptied."""
    if high is not None:
        lengths = lengths.clamp(0, high)
    ends = torch.cumsum(lengths.reshape(-1).to(torch.int64), 0).clamp(max=tokens)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    return (ends - starts).to(torch.int32).view(lengths.shape)


def value_problems(p: AttentionProblem, data: Mapping[str, torch.Tensor]) -> list[str]:
    """Problems with the values of the integer inputs in ``data`` (role -> tensor).

    Reads the (small) tensors to the host: call it where that costs nothing (CPU tensors,
    graph build time), never on a GPU hot path.
    """
    found: list[str] = []
    limits = {"seq_len_q": p.s_q, "seq_len_kv": p.s_kv}
    for role, limit in limits.items():
        t = data.get(role)
        if t is None:
            continue
        values = t.detach().reshape(-1).to("cpu", torch.int64)
        bad = values[(values < 0) | (values > limit)]
        if bad.numel():
            found.append(f"{role}: values {bad[:4].tolist()} out of range; each length must be in 0..{limit}")
    if p.is_thd:
        packed = [("seq_len_q", p.q.shape[0])] + ([] if p.is_paged else [("seq_len_kv", p.k.shape[0])])
        for role, tokens in packed:
            t = data.get(role)
            if t is not None and int(t.detach().to("cpu", torch.int64).sum()) > tokens:
                total = int(t.detach().to("cpu", torch.int64).sum())
                found.append(f"{role}: lengths sum to {total} but the packed tensor holds {tokens} tokens")
    if p.is_paged:
        for role in ("page_table_k", "page_table_v"):
            t = data.get(role)
            if t is None:
                continue
            num_pages = (p.k if role == "page_table_k" else p.v).shape[0]
            values = _read_entries(p, role, t, data)
            bad = values[(values < 0) | (values >= num_pages)]
            if bad.numel():
                found.append(f"{role}: page indices {bad[:4].tolist()} out of range; allowed 0..{num_pages - 1}")
    if p.offset_tensors:
        found += offset_value_problems(p, data)
    return found


def _read_entries(
    p: AttentionProblem, role: str, table: torch.Tensor, data: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """The page-table entries a run reads: each sequence's row (of a packed table, its own
    entries through the ragged offsets), as many as its length needs where the lengths are at
    hand; the slots past them are padding that no run reads (-1, a page past the cache)."""
    offsets = data.get(f"{role}_offset")
    if role in p.offset_tensors and offsets is not None and table.dim() == 4:
        rows = gather_rows(table.detach().cpu(), offsets.detach().cpu(), None).reshape(table.shape[0], -1)
    else:
        rows = table.detach().cpu().reshape(table.shape[0], -1)
    lengths = data.get("seq_len_kv")
    if lengths is not None and p.page_size:
        pages = (lengths.detach().reshape(-1, 1).to("cpu", torch.int64) + p.page_size - 1) // p.page_size
        rows = rows[torch.arange(rows.shape[1]).view(1, -1) < pages]
    return rows.reshape(-1).to(torch.int64)
