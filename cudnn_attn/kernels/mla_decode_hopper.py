"""MLA decode on Hopper: a warp-specialised Gluon kernel (TMA loads, two warp groups of wgmma).

The same work as ``mla_decode``'s Triton kernel -- a block of 64 query heads of one sequence
over one chunk of its latent pages, V being the latent's first ``D_V`` dims -- written at the
level Hopper needs to keep its tensor cores busy, FlashMLA's shape of work:

- a loader warp streams each page (64 tokens x 576 dims) into one of two shared-memory stages
  with TMA, ahead of the math;
- the first warp group multiplies Q (in shared memory, loaded once) by the page's keys, runs
  the online softmax, writes P to shared memory and accumulates ``P @ V[:, 256:]``;
- the second warp group accumulates ``P @ V[:, :256]`` at the same time, so one group's
  softmax and score product overlap the other's value product.

Measured on an H100 (``cudnn-attn bench --mla``, CUDA-graph replay, page 64), against the
Triton kernel: 128 heads B64 KV 4k 549 against 259 TFLOP/s, B16 KV 4k 362 against 209, B1 KV
32k 37 against 74 us; 16 heads B16 KV 4k 38 against 43 us (docs/benchmarks.md). Pages of 64 tokens, a 512-dim
latent with a 64-dim rope part, 16-bit dtypes, rows TMA can address; ``usable`` says which.
Everything shared is allocated before the partitions fork: Triton 3.6 hands the partitions
their arguments through shared memory it may reuse for a buffer a partition allocates.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .launch import Launcher, Tma
from .lse_merge import merge_checked, split_targets

LOG2_E = 1.4426950408889634
PAGE = 64  # tokens per page and per tile
D_V, D_ROPE = 512, 64  # DeepSeek's latent and rope part
BLOCK_H = 64  # query heads per program: one wgmma row block
STAGES = 2  # pages in flight: Q and two pages fill 221 of Hopper's 227 KB of shared memory
SECOND = 256  # V columns the second warp group accumulates


def serves(device: torch.device, page_size: int, head_dim: int, head_dim_v: int) -> bool:
    """Whether calls of this geometry come here (given tensors ``usable`` accepts): an sm_90 GPU
    with Gluon, pages of 64 tokens, d 576 = 512 + 64."""
    return (
        device.type == "cuda"
        and (page_size, head_dim, head_dim_v) == (PAGE, D_V + D_ROPE, D_V)
        and _hopper(device.index if device.index is not None else torch.cuda.current_device())
        and _kernel() is not None
    )


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def usable(q: torch.Tensor, cache: torch.Tensor, v_cache: torch.Tensor, kv_layout: str) -> bool:
    """Whether this kernel serves the call: an sm_90 GPU with Gluon, MLA's latent shapes (pages of
    64 tokens, d 576 = 512 + 64, V the latent itself), fp16/bf16, and token rows of the cache that
    one TMA descriptor addresses (a page's rows consecutive, 16-byte aligned)."""
    token = 2 if kv_layout == "NHPD" else 1
    return (
        serves(q.device, cache.shape[token], q.shape[-1], v_cache.shape[-1])
        and q.dtype in (torch.float16, torch.bfloat16)
        and cache.dtype == q.dtype
        and v_cache.data_ptr() == cache.data_ptr()
        and v_cache.stride() == cache.stride()
        and _rows(cache, token) is not None
    )


def mla_decode_hopper(
    q: torch.Tensor,
    cache: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
    kv_layout: str,
    splits: int,
    chunk_pages: int,
    partial_o: torch.Tensor | None = None,
    partial_lse: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """``mla_decode`` for calls ``usable`` accepts (same arguments, V being the latent)."""
    kernel = _kernel()
    batch, heads, _, dim = q.shape
    rows = _rows(cache, 2 if kv_layout == "NHPD" else 1)
    assert rows is not None, "mla_decode_hopper needs a cache usable() accepts"
    q_rows = q.reshape(batch * heads, dim)  # S_q = 1: one row per (sequence, head)
    if q_rows.stride(-1) != 1 or (q_rows.stride(0) * q.element_size()) % 16 or q_rows.data_ptr() % 16:
        q_rows = q_rows.contiguous()
    o, (o_sb, o_ss, o_sh), lse, (l_sb, l_ss, l_sh) = split_targets(out, splits, heads, D_V, partial_o, partial_lse)
    grid = (splits, -(-heads // BLOCK_H), batch)
    kernel(
        grid, Tma.of(q_rows, (BLOCK_H, D_V)), Tma.of(q_rows, (BLOCK_H, D_ROPE)),
        Tma.of(rows, (PAGE, D_V)), Tma.of(rows, (PAGE, D_ROPE)), table, table.stride(0), lengths,
        o, o_sb, o_ss, o_sh, lse, l_sb, l_ss, l_sh, sink if sink is not None else lengths,
        scale * LOG2_E, chunk_pages, heads,
        D_V=D_V, D_ROPE=D_ROPE, BLOCK_H=BLOCK_H, PAGE=PAGE, STAGES=STAGES, SECOND=SECOND,
        NORMALISE=splits == 1, HAS_SINK=sink is not None, num_warps=4,
    )  # fmt: skip
    if splits > 1:
        merge_checked([(o.unsqueeze(3), lse.unsqueeze(3))], out)
    return out


def _rows(cache: torch.Tensor, token: int) -> torch.Tensor | None:
    """The cache as ``[pages * PAGE, D]`` token rows (a view), or None where TMA cannot address it."""
    row = cache.stride(token)
    if cache.stride(-1) != 1 or cache.stride(0) != PAGE * row or (row * cache.element_size()) % 16:
        return None
    if cache.data_ptr() % 16:
        return None
    return torch.as_strided(cache, (cache.shape[0] * PAGE, cache.shape[-1]), (row, 1))


@functools.cache
def _kernel() -> Any:
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
    def loader(kn_desc, kr_desc, kn_smem, kr_smem, k_ready, k_empty, table_ptr, t_sb, b, first_page, steps,
               D_V: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
        for i in range(steps):
            s = i % STAGES
            mbarrier.wait(k_empty.index(s), ((i // STAGES) & 1) ^ 1)  # both groups are done with it
            row = gl.load(table_ptr + b * t_sb + first_page + i).to(gl.int32) * PAGE
            mbarrier.expect(k_ready.index(s), kn_desc.block_type.nbytes + kr_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(kn_desc, [row, 0], k_ready.index(s), kn_smem.index(s))
            tma.async_copy_global_to_shared(kr_desc, [row, D_V], k_ready.index(s), kr_smem.index(s))

    @gluon.jit
    def second_group(o_ptr, o_base, o_sh, kn_smem, p_smem, a_smem, k_ready, k_empty, p_ready, p_free, h, heads,
                     steps, BLOCK_H: gl.constexpr, STAGES: gl.constexpr, SECOND: gl.constexpr):  # fmt: skip
        """``P @ V[:, :SECOND]`` for every page, rescaled by the first group's ``alpha``."""
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, SECOND, 16])  # fmt: skip
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
        gl.store(o_ptr + o_base + rows[:, None].to(gl.int64) * o_sh + cols[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=(rows < heads)[:, None])  # fmt: skip

    @gluon.jit
    def first_group(q_nope, q_rope, q_bar, o_ptr, o_base, o_sh, lse_ptr, lse_base, l_sh, sink_ptr, kn_smem, kr_smem,
                    p_smem, a_smem, k_ready, k_empty, p_ready, p_free, split, h, heads, start, end, steps, scale_log2,
                    D_V: gl.constexpr, BLOCK_H: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
                    SECOND: gl.constexpr, NORMALISE: gl.constexpr, HAS_SINK: gl.constexpr):  # fmt: skip
        """Scores, the online softmax (log2 units) and ``P @ V[:, SECOND:]``."""
        first_width: gl.constexpr = D_V - SECOND
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, PAGE, 16])  # fmt: skip
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, first_width, 16])  # fmt: skip
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
        gl.store(o_ptr + o_base + rows[:, None].to(gl.int64) * o_sh + cols[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=(rows < heads)[:, None])  # fmt: skip
        if not NORMALISE:  # natural-log LSE of the chunk, -inf where it has no key
            lse = gl.where(total > 0, (m + gl.log2(gl.where(total > 0, total, 1.0))) * 0.6931471805599453,
                           float("-inf"))  # fmt: skip
            gl.store(lse_ptr + lse_base + heads_s * l_sh, lse, mask=heads_s < heads)

    @gluon.jit
    def decode(qn_desc, qr_desc, kn_desc, kr_desc, table_ptr, t_sb, len_ptr, o_ptr, o_sb, o_ss, o_sh, lse_ptr, l_sb,
               l_ss, l_sh, sink_ptr, scale_log2, chunk_pages, heads, D_V: gl.constexpr, D_ROPE: gl.constexpr,
               BLOCK_H: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, SECOND: gl.constexpr,
               NORMALISE: gl.constexpr, HAS_SINK: gl.constexpr):  # fmt: skip
        split = gl.program_id(0)
        h = gl.program_id(1) * BLOCK_H
        b = gl.program_id(2).to(gl.int64)
        start = split * chunk_pages * PAGE
        end = gl.minimum(gl.load(len_ptr + b), start + chunk_pages * PAGE)
        steps = (gl.maximum(end - start, 0) + PAGE - 1) // PAGE
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
        o_base = b * o_sb + split * o_ss
        gl.warp_specialize([
            (first_group, (q_nope, q_rope, q_bar, o_ptr, o_base, o_sh, lse_ptr, b * l_sb + split * l_ss, l_sh, sink_ptr,
                           kn_smem, kr_smem, p_smem, a_smem, k_ready, k_empty, p_ready, p_free, split, h, heads, start,
                           end, steps, scale_log2, D_V, BLOCK_H, PAGE, STAGES, SECOND, NORMALISE, HAS_SINK)),
            (second_group, (o_ptr, o_base, o_sh, kn_smem, p_smem, a_smem, k_ready, k_empty, p_ready, p_free, h, heads,
                            steps, BLOCK_H, STAGES, SECOND)),
            (loader, (kn_desc, kr_desc, kn_smem, kr_smem, k_ready, k_empty, table_ptr, t_sb, b, split * chunk_pages,
                      steps, D_V, PAGE, STAGES)),
        ], [4, 1], [232, 40])  # fmt: skip

    return Launcher(decode)


__all__ = ["mla_decode_hopper", "serves", "usable"]
