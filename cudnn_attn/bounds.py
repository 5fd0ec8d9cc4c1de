"""Run-time integer inputs (sequence lengths, page indices) made safe on the device.

Checking their values would read them to the host: a sync per call. Instead they are
clamped into range on the device (no sync, capturable), so whatever values arrive no kernel
reads or writes outside the tensors. Rows with out-of-range values get meaningless results;
where values are on the host anyway, ``validation.value_problems`` raises for them instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

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
    so that they end inside the packed tensors."""
    safe: dict[str, Any] = dict(inputs)
    for role, high in bounds.items():
        value = safe.get(role)
        if isinstance(value, torch.Tensor):
            safe[role] = value.clamp(0, high)
    if p.is_thd:
        for role, tokens in (("seq_len_q", p.q.shape[0]), ("seq_len_kv", p.k.shape[0])):
            lengths = safe[role].reshape(-1).to(torch.int64)
            ends = torch.cumsum(lengths, 0).clamp(max=tokens)
            starts = torch.cat([ends.new_zeros(1), ends[:-1]])
            safe[role] = (ends - starts).to(torch.int32).view(safe[role].shape)
    return safe
