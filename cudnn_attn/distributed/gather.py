"""``mode="all_gather"``: gather the whole K/V, attend locally, reduce-scatter dK/dV.

Simpler than the ring and with fewer, larger transfers, but nothing overlaps them and each
rank holds the whole K/V during the call. Forward: one all-gather of the packed K/V shards,
put in sequence order, then one attention call per query chunk over the keys it may see
(``schedule.gathered_blocks``: one call unless causal and zigzag, then one per chunk, each
causal aligned bottom-right). Only the local shards are kept for the backward, which gathers
again, computes dQ and the whole sequence's dK/dV partials (float32) and reduce-scatters
them, so each rank receives the sum over ranks of its own shard's dK/dV.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import blocks, schedule
from . import layout as layouts
from .packed_kv import PackedKV
from .process_group import Members

# Newer torch names them ``*_single`` (the old names warn); older torch has only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def gathered_kv(kv: torch.Tensor, packing: PackedKV, m: Members, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the whole sequence, in order, contiguous ``[B, H_kv, W * S, D]``."""
    every = torch.empty(m.world * kv.numel(), dtype=kv.dtype, device=kv.device)
    _all_gather(every, kv, group=m.group)
    shards = [packing.views(part) for part in every.chunk(m.world)]
    return tuple(layouts.join_shards([s[i] for s in shards], layout, 2) for i in (0, 1))  # type: ignore[return-value]


def forward(
    q: torch.Tensor, kv: torch.Tensor, packing: PackedKV, m: Members, scale: float, is_causal: bool, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``(out, lse)``, as ``ring.forward`` returns them."""
    k, v = gathered_kv(kv, packing, m, layout)
    calls = schedule.gathered_blocks(layout, is_causal, m.rank, m.world, q.shape[2])
    if len(calls) == 1:
        (block,) = calls
        o, lse = blocks.forward(q, k[:, :, block.keys], v[:, :, block.keys], scale, block.mask)
        return o.contiguous(), lse
    b, h, s, _ = q.shape
    out = torch.empty(b, h, s, packing.v_shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h, s, 1, dtype=torch.float32, device=q.device)
    for block in calls:
        o, part = blocks.forward(q[:, :, block.rows], k[:, :, block.keys], v[:, :, block.keys], scale, block.mask)
        out[:, :, block.rows] = o
        lse[:, :, block.rows] = part
    return out, lse


def backward(
    q: torch.Tensor,
    kv: torch.Tensor,
    packing: PackedKV,
    out: torch.Tensor,
    d_out: torch.Tensor,
    lse: torch.Tensor,
    m: Members,
    scale: float,
    is_causal: bool,
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dq [B, H, S, D], d_kv float32 flat, packed as ``packing``)`` of this rank's shard."""
    k, v = gathered_kv(kv, packing, m, layout)
    whole = packing.with_length(k.shape[2])
    d_kv_whole = torch.zeros(whole.numel, dtype=torch.float32, device=q.device)
    d_k_whole, d_v_whole = whole.views(d_kv_whole)
    d_q = torch.empty_like(q, memory_format=torch.contiguous_format)
    for block in schedule.gathered_blocks(layout, is_causal, m.rank, m.world, q.shape[2]):
        rows, keys = block.rows, block.keys
        stats = lse if rows == schedule.ALL else lse[:, :, rows].contiguous()
        d_q_part, d_k, d_v = blocks.backward(q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows],
                                             d_out[:, :, rows], stats, scale, block.mask)  # fmt: skip
        d_q[:, :, rows] = d_q_part
        d_k_whole[:, :, keys].add_(d_k)
        d_v_whole[:, :, keys].add_(d_v)
    # Rank j's part of the reduce-scatter input: its shard of dK then of dV, packed as its K/V.
    send = torch.cat(
        [
            torch.cat([layouts.shard_of(g, layout, j, m.world, 2).reshape(-1) for g in (d_k_whole, d_v_whole)])
            for j in range(m.world)
        ]
    )
    d_kv = torch.empty(packing.numel, dtype=torch.float32, device=q.device)
    _reduce_scatter(d_kv, send, group=m.group)
    return d_q, d_kv
