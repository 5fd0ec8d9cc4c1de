"""The Gluon kernel of ``mla_decode_hopper``: its tile sizes and the warp-specialised program.

``mla_decode_hopper`` says what the kernel computes and launches it; this module holds the
kernel itself (defined on first use, where Triton has Gluon for Hopper) and the constants
both read.
"""

from __future__ import annotations

import functools
from typing import Any

from .launch import Launcher

LOG2_E = 1.4426950408889634
PAGE = 64  # tokens per page and per tile
D_V, D_ROPE = 512, 64  # DeepSeek's latent and rope part
BLOCK_H = 64  # query heads per program: one wgmma row block
STAGES = 2  # pages in flight: Q and two pages fill 221 of Hopper's 227 KB of shared memory
SECOND = 256  # V columns the second warp group accumulates


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

    @gluon.jit
    def loader(
        kn_desc,
        kr_desc,
        keys,
        key_bars,
        table,
        b,
        first_page,
        page,
        steps,
        D_V: gl.constexpr,
        PAGE: gl.constexpr,
        STAGES: gl.constexpr,
    ):
        kn_smem, kr_smem = keys
        k_ready, k_empty = key_bars
        table_ptr, t_sb = table
        for i in range(steps):  # ``page``: step i's index, read a step ahead (the first by the prologue)
            after = gl.load(table_ptr + b * t_sb + first_page + i + 1, mask=i + 1 < steps, other=0)
            s = i % STAGES
            mbarrier.wait(k_empty.index(s), ((i // STAGES) & 1) ^ 1)  # both groups are done with it
            row = page.to(gl.int32) * PAGE
            page = after
            mbarrier.expect(k_ready.index(s), kn_desc.block_type.nbytes + kr_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(kn_desc, [row, 0], k_ready.index(s), kn_smem.index(s))
            tma.async_copy_global_to_shared(kr_desc, [row, D_V], k_ready.index(s), kr_smem.index(s))

    @gluon.jit
    def second_group(
        out,
        kn_smem,
        p_handoff,
        key_bars,
        p_bars,
        h,
        heads,
        steps,
        BLOCK_H: gl.constexpr,
        STAGES: gl.constexpr,
        SECOND: gl.constexpr,
    ):
        """``P @ V[:, :SECOND]`` for every page, rescaled by the first group's ``alpha``."""
        o_ptr, o_base, o_sh = out
        p_smem, a_smem = p_handoff
        k_ready, k_empty = key_bars
        p_ready, p_free = p_bars
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, SECOND, 16]
        )
        rows_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
        o = gl.zeros([BLOCK_H, SECOND], gl.float32, o_layout)
        for i in range(steps):
            s = i % STAGES
            mbarrier.wait(k_ready.index(s), (i // STAGES) & 1)
            mbarrier.wait(p_ready, i & 1)
            o = o * a_smem.load(rows_layout)[:, None]
            o = warpgroup_mma(p_smem, kn_smem.index(s).slice(0, SECOND, dim=1), o, is_async=True)
            o = warpgroup_mma_wait(0, deps=(o,))
            mbarrier.arrive(p_free, count=1)
            mbarrier.arrive(k_empty.index(s), count=1)
        mbarrier.wait(p_ready, steps & 1)  # the final 1 / sum
        o = o * a_smem.load(rows_layout)[:, None]
        rows = h + gl.arange(0, BLOCK_H, rows_layout)
        cols = gl.arange(0, SECOND, gl.SliceLayout(0, o_layout))
        gl.store(
            o_ptr + o_base + rows[:, None].to(gl.int64) * o_sh + cols[None, :],
            o.to(o_ptr.dtype.element_ty),
            mask=(rows < heads)[:, None],
        )

    @gluon.jit
    def first_group(
        q,
        out,
        partial_lse,
        sink_ptr,
        keys,
        p_handoff,
        key_bars,
        p_bars,
        split,
        h,
        heads,
        chunk,
        scale_log2,
        D_V: gl.constexpr,
        BLOCK_H: gl.constexpr,
        PAGE: gl.constexpr,
        STAGES: gl.constexpr,
        SECOND: gl.constexpr,
        NORMALISE: gl.constexpr,
        HAS_SINK: gl.constexpr,
    ):
        """Scores, the online softmax (log2 units) and ``P @ V[:, SECOND:]``."""
        q_nope, q_rope, q_bar = q
        o_ptr, o_base, o_sh = out
        lse_ptr, lse_base, l_sh = partial_lse
        kn_smem, kr_smem = keys
        p_smem, a_smem = p_handoff  # P and its rows' alpha, handed to the second group
        k_ready, k_empty = key_bars
        p_ready, p_free = p_bars
        start, end, steps = chunk
        first_width: gl.constexpr = D_V - SECOND
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, PAGE, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, first_width, 16]
        )
        s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        mbarrier.wait(q_bar, 0)
        heads_s = h + gl.arange(0, BLOCK_H, s_rows)
        m = gl.full([BLOCK_H], float("-inf"), gl.float32, s_rows)
        total = gl.zeros([BLOCK_H], gl.float32, s_rows)
        if HAS_SINK:  # the first chunk's softmax starts from the sink
            m = (
                gl.load(sink_ptr + heads_s, mask=(heads_s < heads) & (split == 0), other=float("-inf"))
                * 1.4426950408889634
            )
            total = gl.where(m > float("-inf"), 1.0, 0.0)
        o = gl.zeros([BLOCK_H, first_width], gl.float32, o_layout)
        no_scores = gl.zeros([BLOCK_H, PAGE], gl.float32, s_layout)
        n = gl.arange(0, PAGE, gl.SliceLayout(0, s_layout))
        for i in range(steps):
            s = i % STAGES
            mbarrier.wait(k_ready.index(s), (i // STAGES) & 1)
            sc = warpgroup_mma(q_nope, kn_smem.index(s).permute((1, 0)), no_scores, use_acc=False, is_async=True)
            sc = warpgroup_mma(q_rope, kr_smem.index(s).permute((1, 0)), sc, is_async=True)
            sc = warpgroup_mma_wait(0, deps=(sc,))
            first_token = start + i * PAGE
            sc = gl.where((first_token + n < end)[None, :], sc * scale_log2, float("-inf"))
            m_new = gl.maximum(m, gl.max(sc, 1))  # finite: every page holds a visible key
            alpha = gl.exp2(m - m_new)
            p = gl.exp2(sc - m_new[:, None])
            total = total * alpha + gl.sum(p, 1)
            m = m_new
            if first_token + PAGE > end:  # rows past the end may hold anything (NaN): V must be 0 there
                zl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
                keep = ((first_token + gl.arange(0, PAGE, gl.SliceLayout(1, zl))) < end)[:, None]
                for c in gl.static_range(D_V // 64):
                    part = kn_smem.index(s).slice(c * 64, 64, dim=1)
                    part.store(gl.where(keep, part.load(zl), 0.0))
                fence_async_shared()
            mbarrier.wait(p_free, (i & 1) ^ 1)  # the second group is done with the last P
            p_smem.store(p.to(p_smem.dtype))
            a_smem.store(alpha)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(p_ready, count=1)
            o = o * gl.convert_layout(alpha, o_rows)[:, None]
            o = warpgroup_mma(p_smem, kn_smem.index(s).slice(SECOND, first_width, dim=1), o, is_async=True)
            o = warpgroup_mma_wait(0, deps=(o,))
            mbarrier.arrive(k_empty.index(s), count=1)
        inv = gl.where(total > 0, 1.0 / gl.where(total > 0, total, 1.0), 0.0)  # no key: zeros
        mbarrier.wait(p_free, (steps & 1) ^ 1)
        a_smem.store(inv)
        gl.thread_barrier()
        mbarrier.arrive(p_ready, count=1)
        o = o * gl.convert_layout(inv, o_rows)[:, None]
        rows = h + gl.arange(0, BLOCK_H, o_rows)
        cols = SECOND + gl.arange(0, first_width, gl.SliceLayout(0, o_layout))
        gl.store(
            o_ptr + o_base + rows[:, None].to(gl.int64) * o_sh + cols[None, :],
            o.to(o_ptr.dtype.element_ty),
            mask=(rows < heads)[:, None],
        )
        if not NORMALISE:  # natural-log LSE of the chunk, -inf where it has no key
            lse = gl.where(
                total > 0, (m + gl.log2(gl.where(total > 0, total, 1.0))) * 0.6931471805599453, float("-inf")
            )
            gl.store(lse_ptr + lse_base + heads_s * l_sh, lse, mask=heads_s < heads)

    @gluon.jit
    def decode(
        qn_desc,
        qr_desc,
        kn_desc,
        kr_desc,
        table_ptr,
        t_sb,
        table_cols,
        len_ptr,
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
        chunk_pages,
        heads,
        D_V: gl.constexpr,
        D_ROPE: gl.constexpr,
        BLOCK_H: gl.constexpr,
        PAGE: gl.constexpr,
        STAGES: gl.constexpr,
        SECOND: gl.constexpr,
        NORMALISE: gl.constexpr,
        HAS_SINK: gl.constexpr,
    ):
        split = gl.program_id(0)
        h = gl.program_id(1) * BLOCK_H
        b = gl.program_id(2).to(gl.int64)
        start = split * chunk_pages * PAGE
        end = gl.minimum(gl.load(len_ptr + b), start + chunk_pages * PAGE)
        steps = (gl.maximum(end - start, 0) + PAGE - 1) // PAGE
        # The chunk's first page index, read beside the length rather than after it (bounded by
        # the table's width, not the length; the loader uses it only if the chunk has a step).
        first = split * chunk_pages
        page = gl.load(table_ptr + b * t_sb + first, mask=first < table_cols, other=0)
        q_nope = gl.allocate_shared_memory(qn_desc.dtype, [BLOCK_H, D_V], qn_desc.layout)
        q_rope = gl.allocate_shared_memory(qr_desc.dtype, [BLOCK_H, D_ROPE], qr_desc.layout)
        kn_smem = gl.allocate_shared_memory(kn_desc.dtype, [STAGES, PAGE, D_V], kn_desc.layout)
        kr_smem = gl.allocate_shared_memory(kr_desc.dtype, [STAGES, PAGE, D_ROPE], kr_desc.layout)
        p_smem = gl.allocate_shared_memory(
            kn_desc.dtype, [BLOCK_H, PAGE], gl.NVMMASharedLayout.get_default_for([BLOCK_H, PAGE], kn_desc.dtype)
        )
        a_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(s), count=1)
            mbarrier.init(k_empty.index(s), count=2)  # one arrival from each warp group
        mbarrier.init(p_ready, count=1)
        mbarrier.init(p_free, count=1)
        mbarrier.init(q_bar, count=1)
        mbarrier.expect(q_bar, qn_desc.block_type.nbytes + qr_desc.block_type.nbytes)
        q_row = (b * heads + h).to(gl.int32)  # rows past this sequence's heads are read, never stored
        tma.async_copy_global_to_shared(qn_desc, [q_row, 0], q_bar, q_nope)
        tma.async_copy_global_to_shared(qr_desc, [q_row, D_V], q_bar, q_rope)
        out = (o_ptr, b * o_sb + split * o_ss, o_sh)  # the chunk's rows of float32 partials (or the output)
        keys = (kn_smem, kr_smem)
        p_handoff = (p_smem, a_smem)
        key_bars = (k_ready, k_empty)
        p_bars = (p_ready, p_free)
        gl.warp_specialize(
            [
                (
                    first_group,
                    (
                        (q_nope, q_rope, q_bar),
                        out,
                        (lse_ptr, b * l_sb + split * l_ss, l_sh),
                        sink_ptr,
                        keys,
                        p_handoff,
                        key_bars,
                        p_bars,
                        split,
                        h,
                        heads,
                        (start, end, steps),
                        scale_log2,
                        D_V,
                        BLOCK_H,
                        PAGE,
                        STAGES,
                        SECOND,
                        NORMALISE,
                        HAS_SINK,
                    ),
                ),
                (second_group, (out, kn_smem, p_handoff, key_bars, p_bars, h, heads, steps, BLOCK_H, STAGES, SECOND)),
                (
                    loader,
                    (
                        kn_desc,
                        kr_desc,
                        keys,
                        key_bars,
                        (table_ptr, t_sb),
                        b,
                        first,
                        page,
                        steps,
                        D_V,
                        PAGE,
                        STAGES,
                    ),
                ),
            ],
            [4, 1],
            [232, 40],
        )

    return Launcher(decode)
