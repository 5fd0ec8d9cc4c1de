"""The Gluon kernel of ``paged_decode_hopper``: its tile sizes and the warp-specialised program.

``paged_decode_hopper`` says what the kernel computes and launches it; this module holds the
kernel itself (defined on first use, where Triton has Gluon for Hopper) and the constants both
read.
"""

from __future__ import annotations

import functools
from typing import Any

from . import grid_dependency, paged_decode_hopper_pieces, paged_decode_hopper_swapped
from .launch import Launcher

LOG2_E = 1.4426950408889634
BLOCK_N = 64  # tokens per step: a page of 64, a part of a larger one, or 2-4 smaller pages
BLOCK_R = 64  # query rows (the group's heads by the step's tokens): one wgmma row block


@functools.cache
def kernel() -> Any:
    """The Gluon kernel, defined on first use; None where this Triton has no Gluon for Hopper."""
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import (
            fence_async_shared,
            mbarrier,
            tma,
            warpgroup_mma,
            warpgroup_mma_wait,
        )
    except ImportError:
        return None
    if not hasattr(gl, "warp_specialize"):
        return None
    attend_swapped = paged_decode_hopper_swapped.partition()
    shared = paged_decode_hopper_pieces.pieces()
    stage_query, softmax_start = shared.stage_query, shared.softmax_start
    zero_rows_past, natural_lse = shared.zero_rows_past, shared.natural_lse
    dependency = grid_dependency.gluon_functions()
    wait_for_previous, release_next = dependency.wait, dependency.release

    @gluon.jit
    def loader(
        k_desc,
        v_desc,
        ring,
        table,
        chunk,
        addressing,
        first_pages,
        PAGE: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        PDL: gl.constexpr,
    ):
        """Streams each step's K and V into the ring. Pages of 64 tokens or more: a step is one
        box of a page, each page index loaded two steps ahead (the first three copies wait for
        one read of the table, not three in a row), the first two (``first_pages``) read by the
        program's prologue beside the length. Pages of 16 or 32: a step is 4 or 2 pages,
        a box each, their indices read as one vector a step ahead; a page past the chunk's last
        key is read from row -PAGE, all out of bounds, so TMA fills it with zeros and the
        stage's byte count holds."""
        if PDL:  # the default warps waited before the fork; this warp does not rely on the fork's order
            wait_for_previous()
        k_smem, v_smem, k_ready, v_ready, empty = ring
        table_ptr, t_sb = table
        b, start, end, steps = chunk
        row_page, row_head, col = addressing  # a page's first row, the K/V head's row and column in it
        if PAGE >= BLOCK_N:
            per_page: gl.constexpr = PAGE // BLOCK_N
            first_block = start // BLOCK_N
            page, then = first_pages
            for i in range(steps):
                block = first_block + i
                after = gl.load(table_ptr + b * t_sb + (block + 2) // per_page, mask=i + 2 < steps, other=0)
                s = i % STAGES
                mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
                row = page * row_page + row_head + (block % per_page) * BLOCK_N
                mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [row, col], k_ready.index(s), k_smem.index(s))
                mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(v_desc, [row, col], v_ready.index(s), v_smem.index(s))
                page = then
                then = after
        else:
            boxes: gl.constexpr = BLOCK_N // PAGE
            j = gl.arange(0, boxes, gl.BlockedLayout([1], [32], [1], [0]))
            first = start + j * PAGE  # each box's first token in step 0
            pages = gl.load(table_ptr + b * t_sb + first // PAGE, mask=first < end, other=0)
            for i in range(steps):
                tokens = first + (i + 1) * BLOCK_N
                after = gl.load(table_ptr + b * t_sb + tokens // PAGE, mask=tokens < end, other=0)
                rows = gl.where(first + i * BLOCK_N < end, pages * row_page + row_head, -PAGE)
                s = i % STAGES
                mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
                mbarrier.expect(k_ready.index(s), boxes * k_desc.block_type.nbytes)
                for box in gl.static_range(boxes):
                    row = gl.sum(gl.where(j == box, rows, 0), 0)
                    part = k_smem.index(s).slice(box * PAGE, PAGE)
                    tma.async_copy_global_to_shared(k_desc, [row, col], k_ready.index(s), part)
                mbarrier.expect(v_ready.index(s), boxes * v_desc.block_type.nbytes)
                for box in gl.static_range(boxes):
                    row = gl.sum(gl.where(j == box, rows, 0), 0)
                    part = v_smem.index(s).slice(box * PAGE, PAGE)
                    tma.async_copy_global_to_shared(v_desc, [row, col], v_ready.index(s), part)
                pages = after

    @gluon.jit
    def attend(
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
    ):
        """The group's query rows into shared memory (zeros past the group), then for each step
        the scores, the online softmax (log2 units) and ``P @ V``, P kept in registers. Q is
        loaded here, after the fork, so that the loader's first page reads do not wait for it."""
        k_smem, v_smem, k_ready, v_ready, empty = ring
        out_ptr, out_sb, out_sh, out_st = out
        o_ptr, o_sb, o_ss, o_sh = partial_o  # float32 partials [B, splits, H_q * S_q, D]
        lse_ptr, l_sb, l_ss, l_sh = partial_lse
        b, start, end, steps = chunk
        stage_query(q_global, q_smem, b, kv_head, GROUP, S_Q, HEAD_DIM, BLOCK_R)
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        r = gl.arange(0, BLOCK_R, s_rows)  # row r: query head kv_head * GROUP + r // S_Q, token r % S_Q
        live = r < GROUP * S_Q
        limit = length - S_Q + 1 + r % S_Q  # the keys row r sees: bottom-right causal
        m, total = softmax_start(sink_ptr, kv_head, split, r, live, GROUP, S_Q, HAS_SINK)
        o = gl.zeros([BLOCK_R, HEAD_DIM], gl.float32, o_layout)
        no_scores = gl.zeros([BLOCK_R, BLOCK_N], gl.float32, s_layout)
        n = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
        for i in range(steps):
            s = i % STAGES
            phase = (i // STAGES) & 1
            mbarrier.wait(k_ready.index(s), phase)
            sc = warpgroup_mma(q_smem, k_smem.index(s).permute((1, 0)), no_scores, use_acc=False, is_async=True)
            sc = warpgroup_mma_wait(0, deps=(sc,))
            first = start + i * BLOCK_N
            token = first + n
            if S_Q == 1:  # every step holds a visible key: the max is finite
                sc = gl.where((token < end)[None, :], sc * scale_log2, float("-inf"))
                m_new = gl.maximum(m, gl.max(sc, 1))
                m_use = m_new
            else:  # a row may see none of this step's keys: its max stays -inf, used as 0
                seen = (token < end)[None, :] & (token[None, :] < limit[:, None])
                sc = gl.where(seen, sc * scale_log2, float("-inf"))
                m_new = gl.maximum(m, gl.max(sc, 1))
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m - m_use)
            p = gl.exp2(sc - m_use[:, None])
            total = total * alpha + gl.sum(p, 1)
            m = m_new
            mbarrier.wait(v_ready.index(s), phase)
            if first + BLOCK_N > end:
                zero_rows_past(v_smem.index(s), first, end, BLOCK_N)
                fence_async_shared()
                gl.thread_barrier()
            o = o * gl.convert_layout(alpha, o_rows)[:, None]
            p_op = gl.convert_layout(p.to(v_smem.dtype), p_layout)
            o = warpgroup_mma(p_op, v_smem.index(s), o, is_async=True)
            o = warpgroup_mma_wait(0, deps=(o,))
            mbarrier.arrive(empty.index(s), count=1)
        inv = gl.where(total > 0, 1.0 / gl.where(total > 0, total, 1.0), 0.0)  # no key: zeros
        o = o * gl.convert_layout(inv, o_rows)[:, None]
        rows = gl.arange(0, BLOCK_R, o_rows)
        cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, o_layout))
        kept = (rows < GROUP * S_Q)[:, None]
        if SPLIT:  # float32 partials [B, splits, H_q * S_q, D] and their natural-log LSE
            flat = kv_head * (GROUP * S_Q) + rows  # the row's index in [H_q * S_q]: head-major
            gl.store(o_ptr + b * o_sb + split * o_ss + flat[:, None].to(gl.int64) * o_sh + cols[None, :], o, mask=kept)
            lse = natural_lse(m, total)
            gl.store(lse_ptr + b * l_sb + split * l_ss + (kv_head * (GROUP * S_Q) + r) * l_sh, lse, mask=live)
        else:
            heads = (kv_head * GROUP + rows // S_Q).to(gl.int64)
            at = out_ptr + b * out_sb + (heads * out_sh + (rows % S_Q) * out_st)[:, None] + cols[None, :]
            gl.store(at, o.to(out_ptr.dtype.element_ty), mask=kept)

    @gluon.jit
    def decode(
        k_desc,
        v_desc,
        q_ptr,
        q_sb,
        q_sh,
        q_st,
        table_ptr,
        t_sb,
        table_cols,
        len_ptr,
        out_ptr,
        out_sb,
        out_sh,
        out_st,
        o_ptr,
        o_sb,
        o_ss,
        o_sh,
        lse_ptr,
        l_sb,
        l_ss,
        l_sh,
        sink_ptr,
        scale_log2,
        chunk_tokens,
        row_page,
        row_head,
        col_head,
        GROUP: gl.constexpr,
        S_Q: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        PAGE: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_R: gl.constexpr,
        STAGES: gl.constexpr,
        SPLIT: gl.constexpr,
        HAS_SINK: gl.constexpr,
        SWAPPED: gl.constexpr,
        PDL: gl.constexpr,
        EARLY_READS: gl.constexpr,
        RELEASE_AT_END: gl.constexpr,
    ):
        split = gl.program_id(0)
        kv_head = gl.program_id(1)
        b = gl.program_id(2).to(gl.int64)
        if PDL and not EARLY_READS:  # the length and page table may be the last kernel's output
            wait_for_previous()
        length = gl.load(len_ptr + b)
        start = split * chunk_tokens
        end = gl.minimum(length, start + chunk_tokens)
        steps = (gl.maximum(end - start, 0) + BLOCK_N - 1) // BLOCK_N
        if PAGE >= BLOCK_N:
            # The chunk's first two page indices, read beside the length rather than after it:
            # the first copies wait for one read, not two in a row. Bounded by the table's
            # width, not the length; the loader uses them only for steps the length leaves.
            column = start // PAGE
            first_pages = (
                gl.load(table_ptr + b * t_sb + column, mask=column < table_cols, other=0),
                gl.load(
                    table_ptr + b * t_sb + (start + BLOCK_N) // PAGE,
                    mask=(start + BLOCK_N) // PAGE < table_cols,
                    other=0,
                ),
            )
        else:
            first_pages = (0, 0)  # the small-page form reads its own
        q_smem = gl.allocate_shared_memory(
            k_desc.dtype, [BLOCK_R, HEAD_DIM], gl.NVMMASharedLayout.get_default_for([BLOCK_R, HEAD_DIM], k_desc.dtype)
        )
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(s), count=1)
            mbarrier.init(v_ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        fence_async_shared()
        if PDL:  # queries and caches are read after the last kernel has completed
            if EARLY_READS:
                wait_for_previous()
            if not RELEASE_AT_END:
                release_next()
        ring = (k_smem, v_smem, k_ready, v_ready, empty)  # the stages and their barriers
        chunk = (b, start, end, steps)  # the program's sequence and its keys [start, end)
        addressing = (row_page, kv_head * row_head, kv_head * col_head)
        # The partitions' arguments are written out in each call: a tuple held in a variable
        # would turn its constexprs into values.
        if SWAPPED:  # query rows as wgmma's columns: P goes through shared memory
            p_smem = gl.allocate_shared_memory(
                k_desc.dtype,
                [2, BLOCK_R, BLOCK_N],
                gl.NVMMASharedLayout.get_default_for([BLOCK_R, BLOCK_N], k_desc.dtype),
            )
            gl.warp_specialize(
                [
                    (
                        attend_swapped,
                        (
                            (q_ptr, q_sb, q_sh, q_st),
                            q_smem,
                            ring,
                            (out_ptr, out_sb, out_sh, out_st),
                            (o_ptr, o_sb, o_ss, o_sh),
                            (lse_ptr, l_sb, l_ss, l_sh),
                            sink_ptr,
                            split,
                            kv_head,
                            length,
                            chunk,
                            scale_log2,
                            GROUP,
                            S_Q,
                            HEAD_DIM,
                            BLOCK_N,
                            BLOCK_R,
                            STAGES,
                            SPLIT,
                            HAS_SINK,
                            p_smem,
                        ),
                    ),
                    (
                        loader,
                        (
                            k_desc,
                            v_desc,
                            ring,
                            (table_ptr, t_sb),
                            chunk,
                            addressing,
                            first_pages,
                            PAGE,
                            BLOCK_N,
                            STAGES,
                            PDL,
                        ),
                    ),
                ],
                [1],
                [40],
            )
        else:
            gl.warp_specialize(
                [
                    (
                        attend,
                        (
                            (q_ptr, q_sb, q_sh, q_st),
                            q_smem,
                            ring,
                            (out_ptr, out_sb, out_sh, out_st),
                            (o_ptr, o_sb, o_ss, o_sh),
                            (lse_ptr, l_sb, l_ss, l_sh),
                            sink_ptr,
                            split,
                            kv_head,
                            length,
                            chunk,
                            scale_log2,
                            GROUP,
                            S_Q,
                            HEAD_DIM,
                            BLOCK_N,
                            BLOCK_R,
                            STAGES,
                            SPLIT,
                            HAS_SINK,
                        ),
                    ),
                    (
                        loader,
                        (
                            k_desc,
                            v_desc,
                            ring,
                            (table_ptr, t_sb),
                            chunk,
                            addressing,
                            first_pages,
                            PAGE,
                            BLOCK_N,
                            STAGES,
                            PDL,
                        ),
                    ),
                ],
                [1],
                [40],
            )
        if PDL and RELEASE_AT_END:  # the next kernel starts once every program's stores are issued
            release_next()

    return Launcher(decode)
