"""``mode="p2p"``: ring attention. K/V shards travel round the ring while each rank attends.

Forward, W steps: at step i rank r holds the K/V of rank ``(r - i) mod W``. It posts passing
them on (and receiving the next) before it attends to them, so the transfer overlaps the
attention of the step; partial outputs merge by log-sum-exp in float32 (``running_merge``).
What a step computes comes from the shards (``shards.py``: dense blocks or packed calls); a
step whose keys the rank never sees (a window) computes nothing and only passes them on.

Backward, W steps over the same ring, with the forward's global output and LSE: each block's
``(dQ, dK, dV)`` is then exactly that block's share of the gradient. dQ adds up locally. dK/dV
add up in a float32 buffer that travels with the K/V: at step i it is received from rank r-1
(which added its share at step i-1), gets rank r's share and moves on, so after W steps it has
visited every rank and lands on its owner. Its transfer overlaps the next step's attention.
Kept in float32 while travelling (twice the bytes of bf16, no rounding per hop); cast at the end.
"""

from __future__ import annotations

import torch

from .exchange import Ring
from .packed_kv import PackedKV
from .shards import DenseShards, PackedShards

KV_TAG, GRAD_TAG = 0, 1  # two shifts in flight at once in the backward
Shards = DenseShards | PackedShards


def forward(q: torch.Tensor, kv: torch.Tensor, packing: PackedKV, ring: Ring, shards: Shards,
            sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """This rank's ``(out, lse)``: ``out`` in q's dtype, laid out as q with V's head dim, ``lse``
    float32 with a last dim of 1; ``sink`` (float32, broadcasting to the LSE) folds in after the
    last step. A step with no calls (its keys all unseen) only passes the K/V on.

    Example::

        out, lse = forward(q, packing.pack(k, v), packing, Ring(m), shards)
    """
    acc = shards.running_output(q, packing.v_shape[-1])
    for step in range(ring.world):
        pending = ring.shift(kv, KV_TAG) if step + 1 < ring.world else None
        k, v = packing.views(kv)
        for call in shards.ring_calls((ring.rank - step) % ring.world, q.device):
            o, lse = call.forward(q, k, v)
            acc.add(call.rows, o, lse)
        if pending is not None:
            kv = pending.wait()
    return acc.result(q.dtype, sink)


def backward(
    q: torch.Tensor,
    kv: torch.Tensor,
    packing: PackedKV,
    out: torch.Tensor,
    d_out: torch.Tensor,
    lse: torch.Tensor,
    ring: Ring,
    shards: Shards,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dq float32 like q, d_kv float32 flat, packed as ``packing``)`` of this rank's shard."""
    d_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    stats_of = shards.row_stats(lse)
    d_kv = None
    pending_grad = None
    for step in range(ring.world):
        pending_kv = ring.shift(kv, KV_TAG) if step + 1 < ring.world else None
        k, v = packing.views(kv)
        calls = shards.ring_calls((ring.rank - step) % ring.world, q.device)
        grads = [(call, call.backward(q, k, v, out, d_out, stats_of)) for call in calls]
        # This block's dK/dV so far: fresh at step 0 (our own block), else from rank r-1.
        if pending_grad is None:
            d_kv = torch.zeros(packing.numel, dtype=torch.float32, device=q.device)
        else:
            d_kv = pending_grad.wait()
        d_k, d_v = packing.views(d_kv)
        for call, grad in grads:
            call.add_grads(d_q, d_k, d_v, grad)
        if ring.world > 1:
            pending_grad = ring.shift(d_kv, GRAD_TAG)  # one more hop after the last step: home
        if pending_kv is not None:
            kv = pending_kv.wait()
    if pending_grad is not None:
        d_kv = pending_grad.wait()
    assert d_kv is not None
    return d_q, d_kv
