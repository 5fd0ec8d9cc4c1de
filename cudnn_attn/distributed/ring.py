"""``mode="p2p"``: ring attention. K/V shards travel round the ring while each rank attends.

Forward, W steps: at step i rank r holds the K/V of rank ``(r - i) mod W``. It posts passing
them on (and receiving the next) before it attends to them, so the transfer overlaps the
attention of the step; partial outputs merge by log-sum-exp in float32 (``running_merge``).

Backward, W steps over the same ring, with the forward's global output and LSE: each block's
``(dQ, dK, dV)`` is then exactly that block's share of the gradient. dQ adds up locally. dK/dV
add up in a float32 buffer that travels with the K/V: at step i it is received from rank r-1
(which added its share at step i-1), gets rank r's share and moves on, so after W steps it has
visited every rank and lands on its owner. Its transfer overlaps the next step's attention.
Kept in float32 while travelling (twice the bytes of bf16, no rounding per hop); cast at the end.
"""

from __future__ import annotations

import torch

from . import blocks, schedule
from .exchange import Ring
from .packed_kv import PackedKV
from .running_merge import RunningOutput

KV_TAG, GRAD_TAG = 0, 1  # two shifts in flight at once in the backward


def forward(
    q: torch.Tensor, kv: torch.Tensor, packing: PackedKV, ring: Ring, scale: float, is_causal: bool, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``(out, lse)``: ``out`` in q's dtype ``[B, H, S, D_v]``, ``lse`` float32 ``[B, H, S, 1]``.

    Example::

        out, lse = forward(q, packing.pack(k, v), packing, Ring(m), scale, True, "zigzag")
    """
    acc = RunningOutput(q.shape[:3], packing.v_shape[-1], q.device)
    for step in range(ring.world):
        pending = ring.shift(kv, KV_TAG) if step + 1 < ring.world else None
        block = schedule.ring_block(layout, is_causal, ring.rank, (ring.rank - step) % ring.world, q.shape[2])
        if block is not None:
            k, v = packing.views(kv)
            o, lse = blocks.forward(q[:, :, block.rows], k[:, :, block.keys], v[:, :, block.keys], scale, block.mask)
            acc.add(block.rows, o, lse)
        if pending is not None:
            kv = pending.wait()
    return acc.result(q.dtype)


def backward(
    q: torch.Tensor,
    kv: torch.Tensor,
    packing: PackedKV,
    out: torch.Tensor,
    d_out: torch.Tensor,
    lse: torch.Tensor,
    ring: Ring,
    scale: float,
    is_causal: bool,
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dq float32 [B, H, S, D], d_kv float32 flat, packed as ``packing``)`` of this rank's shard."""
    d_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse_of = _row_stats(lse)
    d_kv = None
    pending_grad = None
    for step in range(ring.world):
        pending_kv = ring.shift(kv, KV_TAG) if step + 1 < ring.world else None
        block = schedule.ring_block(layout, is_causal, ring.rank, (ring.rank - step) % ring.world, q.shape[2])
        grads = None
        if block is not None:
            k, v = packing.views(kv)
            rows, keys = block.rows, block.keys
            grads = blocks.backward(q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows],
                                    d_out[:, :, rows], lse_of(rows), scale, block.mask)  # fmt: skip
            d_q[:, :, rows].add_(grads[0])
        # This block's dK/dV so far: fresh at step 0 (our own block), else from rank r-1.
        if pending_grad is None:
            d_kv = torch.zeros(packing.numel, dtype=torch.float32, device=q.device)
        else:
            d_kv = pending_grad.wait()
        if grads is not None:
            d_k, d_v = packing.views(d_kv)
            d_k[:, :, keys].add_(grads[1])
            d_v[:, :, keys].add_(grads[2])
        if ring.world > 1:
            pending_grad = ring.shift(d_kv, GRAD_TAG)  # one more hop after the last step: home
        if pending_kv is not None:
            kv = pending_kv.wait()
    if pending_grad is not None:
        d_kv = pending_grad.wait()
    assert d_kv is not None
    return d_q, d_kv


def _row_stats(lse: torch.Tensor):
    """The LSE of a slice of rows, contiguous as the backward graphs read it (each made once)."""
    made: dict[tuple, torch.Tensor] = {}

    def of(rows: slice) -> torch.Tensor:
        key = (rows.start, rows.stop)
        if key not in made:
            made[key] = lse if rows == schedule.ALL else lse[:, :, rows].contiguous()
        return made[key]

    return of
