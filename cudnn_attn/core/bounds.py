"""Run-time integer inputs (sequence lengths, page indices) made safe on the device.

Checking their values would read them to the host: a sync per call. Instead they are
clamped into range on the device (no sync, capturable), so whatever values arrive no kernel
reads or writes outside the tensors. Rows with out-of-range values get meaningless results;
where values are on the host anyway, ``validation.value_problems`` raises for them instead.
The clamped tensors are derived once per content of each input (``derived``), not
once per layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .derived import derived
from .problem import AttentionProblem


def upper_bounds(p: AttentionProblem) -> dict[str, int]:
    """The largest valid value of each integer input of ``p`` that addresses memory."""
    bounds = {
        "seq_len_q": p.s_q,
        "seq_len_kv": p.s_kv,
        "page_table_k": p.k.shape[0] - 1,
        "page_table_v": p.v.shape[0] - 1,
    }
    return {role: high for role, high in bounds.items() if getattr(p, role) is not None}


def clamped(p: AttentionProblem, inputs: Mapping[str, Any], bounds: Mapping[str, int]) -> dict[str, Any]:
    """``inputs`` with every bounded tensor clamped into range, and packed (THD) sequences cut
    so that they end inside the packed tensors. Derived once per content of each input tensor
    (``derived``): decode passes the same lengths and page tables to every layer."""
    safe: dict[str, Any] = dict(inputs)
    # The packed tensors' real token counts: one plan serves every count (problem.for_plan).
    packed_tokens = {"seq_len_q": inputs["q"].shape[0]} if p.is_thd else {}
    if p.is_thd and not p.is_paged:
        packed_tokens["seq_len_kv"] = inputs["k"].shape[0]
    for role, high in bounds.items():
        value = safe.get(role)
        if isinstance(value, torch.Tensor) and role not in packed_tokens:
            safe[role] = derived(value, clamp_into, high)
    for role, tokens in packed_tokens.items():
        safe[role] = derived(safe[role], packed_lengths, bounds.get(role), tokens)
    return safe


def clamp_into(value: torch.Tensor, high: int) -> torch.Tensor:
    return value.clamp(0, high)


def packed_lengths(lengths: torch.Tensor, high: int | None, tokens: int) -> torch.Tensor:
    """THD lengths clamped into ``[0, high]`` (where bounded), then cut so that the packed
    sequences end within ``tokens``: a sequence past the end is shortened, later ones emptied."""
    if high is not None:
        lengths = lengths.clamp(0, high)
    ends = torch.cumsum(lengths.reshape(-1).to(torch.int64), 0).clamp(max=tokens)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    return (ends - starts).to(torch.int32).view(lengths.shape)
