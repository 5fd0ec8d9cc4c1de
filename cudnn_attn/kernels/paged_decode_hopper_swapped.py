"""The Hopper decode kernel's math partition for few query rows, its products turned over.

``paged_decode_hopper_kernel.attend`` puts the group's query rows on wgmma's 64 rows: with one
query token and a group of 4, 60 of every 64 rows are padding, and the padding's scores,
exponentials and rescaling run all the same. Measured on an H200, that math kept pace with
the memory only at full clock: right after sustained matmuls (SM clock 1215-1545 MHz) the
kernel over 64-row tiles ran 9-13% slower over long caches (20-39% at batch 1 over 2k), while
the memory's copy and read rates fell by 1-6%.
Here a step's 64 keys are wgmma's rows and the query rows its 8 or 16 columns (``BLOCK_R``):
scores as ``K @ Q^T``, the output as ``V^T @ P^T``, the softmax down the columns.
"""

from __future__ import annotations

import functools
from typing import Any

from . import paged_decode_hopper_pieces


@functools.cache
def partition() -> Any:
    """The Gluon function; callers have checked that this Triton has Gluon for Hopper."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    shared = paged_decode_hopper_pieces.pieces()
    stage_query, softmax_start = shared.stage_query, shared.softmax_start
    zero_rows_past, natural_lse = shared.zero_rows_past, shared.natural_lse

    @gluon.jit
    def attend_swapped(
        q_global,
        q_smem,
        ring,
        out,
        partial_o,
        partial_lse,
        sink_ptr,
        split,
        kv_head,
        length,
        chunk,
        scale_log2,
        GROUP: gl.constexpr,
        S_Q: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_R: gl.constexpr,
        STAGES: gl.constexpr,
        SPLIT: gl.constexpr,
        HAS_SINK: gl.constexpr,
        p_smem,
    ):
        """``attend`` with the products turned over: scores as ``K @ Q^T`` and the output as
        ``V^T @ P^T``, so a step's 64 keys are the wgmma's rows and the group's query rows its
        columns (``BLOCK_R``: 8 or 16). A step's math is then sized by the rows that exist, not by a
        64-row tile; P goes through shared memory (two buffers) since wgmma reads B only there.
        The softmax runs down the columns: the step's max across the four warps, the sums kept
        per element and added up once at the end."""
        k_smem, v_smem, k_ready, v_ready, empty = ring
        out_ptr, out_sb, out_sh, out_st = out
        o_ptr, o_sb, o_ss, o_sh = partial_o
        lse_ptr, l_sb, l_ss, l_sh = partial_lse
        b, start, end, steps = chunk
        stage_query(q_global, q_smem, b, kv_head, GROUP, S_Q, HEAD_DIM, BLOCK_R)
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_R, 16]
        )
        keys: gl.constexpr = gl.SliceLayout(1, s_layout)
        cols: gl.constexpr = gl.SliceLayout(0, s_layout)
        c = gl.arange(0, BLOCK_R, cols)  # column c: query head kv_head * GROUP + c // S_Q, token c % S_Q
        live = c < GROUP * S_Q
        limit = length - S_Q + 1 + c % S_Q
        m, sink_total = softmax_start(sink_ptr, kv_head, split, c, live, GROUP, S_Q, HAS_SINK)
        sums = gl.zeros([BLOCK_N, BLOCK_R], gl.float32, s_layout)
        o = gl.zeros([HEAD_DIM, BLOCK_R], gl.float32, s_layout)
        no_scores = gl.zeros([BLOCK_N, BLOCK_R], gl.float32, s_layout)
        n = gl.arange(0, BLOCK_N, keys)
        for i in range(steps):
            s = i % STAGES
            phase = (i // STAGES) & 1
            mbarrier.wait(k_ready.index(s), phase)
            sc = warpgroup_mma(k_smem.index(s), q_smem.permute((1, 0)), no_scores, use_acc=False, is_async=True)
            sc = warpgroup_mma_wait(0, deps=(sc,))
            token = start + i * BLOCK_N + n
            if S_Q == 1:
                sc = gl.where((token < end)[:, None], sc * scale_log2, float("-inf"))
                m_new = gl.maximum(m, gl.max(sc, 0))
                m_use = m_new
            else:
                seen = (token < end)[:, None] & (token[:, None] < limit[None, :])
                sc = gl.where(seen, sc * scale_log2, float("-inf"))
                m_new = gl.maximum(m, gl.max(sc, 0))
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m - m_use)
            p = gl.exp2(sc - m_use[None, :])
            sums = sums * alpha[None, :] + p
            sink_total = sink_total * alpha
            m = m_new
            # Two buffers, so that no warp's store of P can meet another's wgmma still reading
            # the last step's P, whatever barriers the compiler places between steps (those it
            # places today would make one buffer safe; the second costs 1-2 KB).
            p_buf = p_smem.index(i % 2)
            p_buf.store(gl.permute(p.to(p_smem.dtype), (1, 0)))
            mbarrier.wait(v_ready.index(s), phase)
            if start + i * BLOCK_N + BLOCK_N > end:
                zero_rows_past(v_smem.index(s), start + i * BLOCK_N, end, BLOCK_N)
            fence_async_shared()
            gl.thread_barrier()  # P (and V's zeroed rows) written by every warp before wgmma reads them
            o = o * alpha[None, :]  # O^T's columns are the scores' columns: one layout
            o = warpgroup_mma(v_smem.index(s).permute((1, 0)), p_buf.permute((1, 0)), o, is_async=True)
            o = warpgroup_mma_wait(0, deps=(o,))
            mbarrier.arrive(empty.index(s), count=1)
        total = gl.sum(sums, 0) + sink_total
        inv = gl.where(total > 0, 1.0 / gl.where(total > 0, total, 1.0), 0.0)
        o = o * inv[None, :]
        d = gl.arange(0, HEAD_DIM, gl.SliceLayout(1, s_layout))
        if SPLIT:
            flat = kv_head * (GROUP * S_Q) + c
            gl.store(
                o_ptr + b * o_sb + split * o_ss + flat[None, :].to(gl.int64) * o_sh + d[:, None], o, mask=live[None, :]
            )
            lse = natural_lse(m, total)
            gl.store(lse_ptr + b * l_sb + split * l_ss + (kv_head * (GROUP * S_Q) + c) * l_sh, lse, mask=live)
        else:
            heads = (kv_head * GROUP + c // S_Q).to(gl.int64)
            at = out_ptr + b * out_sb + (heads * out_sh + (c % S_Q) * out_st)[None, :] + d[:, None]
            gl.store(at, o.to(out_ptr.dtype.element_ty), mask=live[None, :])

    return attend_swapped
