"""``mode="all_gather"``: gather the whole K/V, attend locally, reduce-scatter dK/dV.

Simpler than the ring and with fewer, larger transfers, but nothing overlaps them and each
rank holds the whole K/V during the call. Forward: one all-gather of the packed K/V shards,
put in sequence order (``shards.py``: dense, or document by document), then the attention
calls of the keys each query chunk may see (``schedule.all_gathered_blocks``: one call unless
causal and zigzag, then one per chunk, each causal aligned bottom-right, from the window's
start when there is one; packed, one call for every document's chunks). Only the local
shards are kept for the backward, which gathers again, computes dQ and the whole sequence's
dK/dV partials (float32) and reduce-scatters them, so each rank receives the sum over ranks of
its own shard's dK/dV.

As in the ring, every buffer a collective uses is allocated before the first collective and
agreed across ranks (``outcome.settle``), and a rank whose attention fails still joins the
call's collectives, so every rank raises alike at the end and none waits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .checks import CONTEXT
from .outcome import settle
from .packed_kv import PackedKV
from .process_group import Members
from .ring import Shards

# Newer torch names them ``*_single`` (the old names warn); older torch has only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def gathered_kv(
    every: torch.Tensor, kv: torch.Tensor, packing: PackedKV, m: Members, shards: Shards
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the whole sequence, in order, contiguous: gathered into ``every``."""
    _all_gather(every, kv, group=m.group)
    parts = [packing.views(part) for part in every.chunk(m.world)]
    return tuple(shards.join([p[i] for p in parts]) for i in (0, 1))  # type: ignore[return-value]


def forward(
    q: torch.Tensor, kv: torch.Tensor, packing: PackedKV, m: Members, shards: Shards, sink: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``(out, lse)``, as ``ring.forward`` returns them."""
    failure, every = None, None
    try:
        every = torch.empty(m.world * kv.numel(), dtype=kv.dtype, device=kv.device)
    except Exception as error:
        failure = error
    settle(m, failure, "allocating the forward's buffers", CONTEXT)
    assert every is not None
    result = None
    try:
        result = _attend(q, *gathered_kv(every, kv, packing, m, shards), packing, shards, sink)
    except Exception as error:  # after the only collective: nobody waits on this rank until settle
        failure = error
    settle(m, failure, "in the forward", CONTEXT)
    assert result is not None
    return result


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: PackedKV, shards: Shards, sink: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    calls = shards.gathered_calls(q.device)
    if len(calls) == 1 and sink is None and isinstance(calls[0].rows, slice) and calls[0].rows == slice(None):
        o, lse = calls[0].forward(q, k, v)  # every row in one call: its result is the answer
        return o.contiguous(), lse
    acc = shards.running_output(q, packing.v_shape[-1], calls)
    for call in calls:
        o, lse = call.forward(q, k, v, out=acc.place(call))
        acc.add(call.rows, o, lse)
    return acc.result(q.dtype, sink)


def backward(
    q: torch.Tensor,
    kv: torch.Tensor,
    packing: PackedKV,
    out: torch.Tensor,
    d_out: torch.Tensor,
    lse: torch.Tensor,
    m: Members,
    shards: Shards,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dq in q's dtype, d_kv float32 flat, packed as ``packing``)`` of this rank's shard."""
    failure = None
    buffers: list[torch.Tensor] = []
    d_q: Any = None
    try:
        every = torch.empty(m.world * kv.numel(), dtype=kv.dtype, device=kv.device)
        calls = shards.gathered_calls(q.device)
        d_q = shards.query_grads(q, calls)
        whole_numel = m.world * packing.numel  # the gathered sequence's K and V, every position
        d_kv_whole = torch.zeros(whole_numel, dtype=torch.float32, device=q.device)
        send = torch.empty(whole_numel, dtype=torch.float32, device=q.device)
        d_kv = torch.empty(packing.numel, dtype=torch.float32, device=q.device)
        buffers = [every, d_kv_whole, send, d_kv]
    except Exception as error:
        failure = error
    settle(m, failure, "allocating the backward's buffers", CONTEXT)
    every, d_kv_whole, send, d_kv = buffers
    k, v = gathered_kv(every, kv, packing, m, shards)
    result = None
    try:
        whole = packing.with_length(k.shape[shards.seq_dim], shards.seq_dim)
        d_k_whole, d_v_whole = whole.views(d_kv_whole)
        stats_of = shards.row_stats(lse)
        for call in calls:
            grads = call.backward(q, k, v, out, d_out, stats_of, d_q.place(call))
            d_q.add(call.rows, grads[0])
            call.add_grads(d_k_whole, d_v_whole, grads)
        result = d_q.result(q.dtype)
        # Rank j's part of the reduce-scatter input: its shard of dK then of dV, packed as its K/V.
        parts = [shards.shard_of(g, j).reshape(-1) for j in range(m.world) for g in (d_k_whole, d_v_whole)]
        torch.cat(parts, out=send)
    except Exception as error:  # this rank's: it still joins the reduce-scatter, every rank raises below
        failure = error
    _reduce_scatter(d_kv, send, group=m.group)
    settle(m, failure, "in the backward", CONTEXT)
    assert result is not None
    return result, d_kv
