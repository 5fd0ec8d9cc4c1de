"""``mode="p2p"``: ring attention. K/V shards travel round the ring while each rank attends.

Forward, W steps: at step i rank r holds the K/V of rank ``(r - i) mod W``. It posts passing
them on (and receiving the next) before it attends to them, so the transfer overlaps the
attention of the step; partial outputs merge by log-sum-exp in float32 (dense blocks as they
arrive, ``running_merge``; packed calls' once at the end, ``partials``).
What a step computes comes from the shards (``shards.py``: dense blocks or packed calls); a
step whose keys the rank never sees (a window) computes nothing and only passes them on.

Backward, W steps over the same ring, with the forward's global output and LSE: each block's
``(dQ, dK, dV)`` is then exactly that block's share of the gradient. dQ adds up locally (as
the outputs do). dK/dV
add up in a float32 buffer that travels with the K/V: at step i it is received from rank r-1
(which added its share at step i-1), gets rank r's share and moves on, so after W steps it has
visited every rank and lands on its owner. Its transfer overlaps the next step's attention.
Kept in float32 while travelling (twice the bytes of bf16, no rounding per hop); the last hop,
home, carries the finished sums in K/V's dtype: nothing hides it, and the caller rounds them so.

Every buffer the transfers use is allocated before the first of them, two of each kind taking
turns (the caller's K/V is never received into: the backward reads it again), and agreed across
ranks (``outcome.settle``): a rank that cannot allocate stops the call on every rank. A rank
whose attention fails at some step keeps passing buffers on without computing, so no rank
waits, and every rank raises alike at the end.
"""

from __future__ import annotations

import torch

from .checks import CONTEXT
from .exchange import Ring
from .outcome import settle
from .packed_kv import PackedKV
from .shards import DenseShards, PackedShards

KV_TAG, GRAD_TAG = 0, 1  # two shifts in flight at once in the backward
Shards = DenseShards | PackedShards


def forward(
    q: torch.Tensor, kv: torch.Tensor, packing: PackedKV, ring: Ring, shards: Shards, sink: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``(out, lse)``: ``out`` in q's dtype, laid out as q with V's head dim, ``lse``
    float32 with a last dim of 1; ``sink`` (float32, broadcasting to the LSE) folds in after the
    last step. A step with no calls (its keys all unseen) only passes the K/V on.

    Example::

        out, lse = forward(q, packing.pack(k, v), packing, Ring(m), shards)
    """
    m = ring.members
    acc, spares, failure = None, [], None
    try:
        steps = shards.ring_steps(q.device)
        acc = shards.running_output(q, packing.v_shape[-1], [call for calls in steps for call in calls])
        spares = [torch.empty_like(kv) for _ in range(min(2, ring.world - 1))]
    except Exception as error:
        failure = error
    settle(m, failure, "allocating the forward's buffers", CONTEXT)
    assert acc is not None
    for step in range(ring.world):
        pending = ring.shift(kv, KV_TAG, into=spares[step % 2]) if step + 1 < ring.world else None
        if failure is None:
            try:
                k, v = packing.views(kv)
                for call in steps[step]:
                    o, lse = call.forward(q, k, v, out=acc.place(call))
                    acc.add(call.rows, o, lse)
            except Exception as error:  # this rank's: it keeps the ring moving, every rank raises below
                failure = error
        if pending is not None:
            kv = pending.wait()
    result = None
    if failure is None:
        try:
            result = acc.result(q.dtype, sink)
        except Exception as error:
            failure = error
    settle(m, failure, "in the forward", CONTEXT)
    assert result is not None
    return result


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
    """``(dq in q's dtype, d_kv flat, packed as ``packing``)`` of this rank's shard: d_kv in
    K/V's dtype when it came home over the ring, float32 on one rank."""
    m = ring.members
    failure = None
    d_q = d_kv = stats_of = home = None
    spares: list[torch.Tensor] = []
    grad_buffers: list[torch.Tensor] = []
    try:
        steps = shards.ring_steps(q.device)
        d_q = shards.query_grads(q, [call for calls in steps for call in calls])
        spares = [torch.empty_like(kv) for _ in range(min(2, ring.world - 1))]
        # dK/dV travel: the buffer of this step's block, and the one the next block's arrives in.
        grad_buffers = [torch.empty(packing.numel, dtype=torch.float32, device=q.device) for _ in range(2)]
        home = torch.empty_like(kv) if ring.world > 1 else None  # the last hop's, in K/V's dtype
        stats_of = shards.row_stats(lse)
    except Exception as error:
        failure = error
    settle(m, failure, "allocating the backward's buffers", CONTEXT)
    assert d_q is not None and stats_of is not None
    # Our own block's, at step 0: written by its one call when that call sees every key.
    fresh = failure is None and len(steps[0]) == 1 and steps[0][0].every_key
    d_kv = grad_buffers[0] if fresh else grad_buffers[0].zero_()
    pending_grad = None
    for step in range(ring.world):
        pending_kv = ring.shift(kv, KV_TAG, into=spares[step % 2]) if step + 1 < ring.world else None
        grads = []
        if failure is None:
            try:
                k, v = packing.views(kv)
                grads = [(call, call.backward(q, k, v, out, d_out, stats_of, d_q.place(call))) for call in steps[step]]
            except Exception as error:  # this rank's: it keeps the ring moving, every rank raises below
                failure, grads = error, []
        # This block's dK/dV so far: fresh at step 0 (our own block), else from rank r-1.
        if pending_grad is not None:
            d_kv = pending_grad.wait()
        if failure is None:
            try:
                d_k, d_v = packing.views(d_kv)
                for call, grad in grads:
                    d_q.add(call.rows, grad[0])
                    call.add_grads(d_k, d_v, grad, first=fresh and step == 0)
            except Exception as error:
                failure = error
        if step + 1 < ring.world:
            free = grad_buffers[1] if d_kv is grad_buffers[0] else grad_buffers[0]
            pending_grad = ring.shift(d_kv, GRAD_TAG, into=free)
        elif home is not None:  # one more hop after the last step, home: the sums are complete
            # Sent in K/V's dtype (half the bytes, the one hop no attention hides), rounded as
            # the caller would round them. The cast lands in this step's K/V (a received
            # spare, never the caller's), after this step's kernels have read it.
            kv.copy_(d_kv)
            pending_grad = ring.shift(kv, GRAD_TAG, into=home)
        if pending_kv is not None:
            kv = pending_kv.wait()
    if pending_grad is not None:
        d_kv = pending_grad.wait()
    result = None
    if failure is None:
        try:
            result = d_q.result(q.dtype)
        except Exception as error:
            failure = error
    settle(m, failure, "in the backward", CONTEXT)
    assert result is not None
    return result, d_kv
