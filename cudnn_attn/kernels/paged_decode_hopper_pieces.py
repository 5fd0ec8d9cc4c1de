"""What the Hopper decode kernel's two math partitions share: Q staged in shared memory, the
softmax's start (a sink, or nothing), V's rows past a chunk's end zeroed, and the natural-log
LSE of a split's partial. ``paged_decode_hopper_kernel.attend`` holds the query rows on wgmma's
rows, ``paged_decode_hopper_swapped.attend_swapped`` on its columns; these pieces do not care.
"""

from __future__ import annotations

import functools
import types


@functools.cache
def pieces() -> types.SimpleNamespace:
    """The Gluon functions; callers have checked that this Triton has Gluon for Hopper."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

    @gluon.jit
    def stage_query(
        q_global,
        q_smem,
        b,
        kv_head,
        GROUP: gl.constexpr,
        S_Q: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        BLOCK_R: gl.constexpr,
    ):
        """The group's query rows into ``q_smem`` (zeros past the group), visible to wgmma."""
        q_ptr, q_sb, q_sh, q_st = q_global  # the pointer and strides of the query rows
        ql: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        qr = gl.arange(0, BLOCK_R, gl.SliceLayout(1, ql))
        qd = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, ql))
        q_heads = (kv_head * GROUP + qr // S_Q).to(gl.int64)
        q = gl.load(
            q_ptr + b * q_sb + (q_heads * q_sh + (qr % S_Q) * q_st)[:, None] + qd[None, :],
            mask=(qr < GROUP * S_Q)[:, None],
            other=0.0,
        )
        q_smem.store(q)
        fence_async_shared()
        gl.thread_barrier()  # Q written by every warp before the first wgmma reads it

    @gluon.jit
    def softmax_start(
        sink_ptr, kv_head, split, rows, live, GROUP: gl.constexpr, S_Q: gl.constexpr, HAS_SINK: gl.constexpr
    ):
        """The running max (log2 units) and sum each query row starts from, in ``rows``' layout:
        -inf and 0, or in the first chunk the sink, exp2(sink - m) = 1 at m = sink."""
        m = gl.full_like(rows, float("-inf"), dtype=gl.float32)
        total = gl.zeros_like(rows, dtype=gl.float32)
        if HAS_SINK:
            m = gl.load(sink_ptr + kv_head * GROUP + rows // S_Q, mask=live & (split == 0), other=float("-inf"))
            m = m * 1.4426950408889634
            total = gl.where(m > float("-inf"), 1.0, 0.0)
        return m, total

    @gluon.jit
    def zero_rows_past(v_tile, first, end, BLOCK_N: gl.constexpr):
        """V's rows from ``end`` on set to zero in ``v_tile`` (a step's box starting at key
        ``first``): rows past a sequence's end may hold anything, NaN included, and P is 0 there,
        but 0 * NaN is not. The caller fences and synchronises before wgmma reads the tile."""
        zl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        keep = ((first + gl.arange(0, BLOCK_N, gl.SliceLayout(1, zl))) < end)[:, None]
        v_tile.store(gl.where(keep, v_tile.load(zl), 0.0))

    @gluon.jit
    def natural_lse(m, total):
        """A partial's log-sum-exp in natural-log units from its max (log2 units) and sum; -inf
        where no key was seen."""
        return gl.where(total > 0, (m + gl.log2(gl.where(total > 0, total, 1.0))) * 0.6931471805599453, float("-inf"))

    return types.SimpleNamespace(
        stage_query=stage_query, softmax_start=softmax_start, zero_rows_past=zero_rows_past, natural_lse=natural_lse
    )
