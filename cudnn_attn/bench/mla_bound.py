"""What a split-KV MLA decode can reach at best: the same reads and writes with no math.

``bench --mla`` times, beside ``PagedAttention``'s layer, two layers that do none of the
attention's math, on the same grid (``splits`` programs per sequence and block of 64 query
heads) over the same pages:

- **read**: each program streams its chunk's pages (64 tokens x 576 dims) into two shared-memory
  stages with TMA, as the Hopper decode kernel's loader does, and nothing else;
- **bound**: that, then each program writes its split's float32 partial output and log-sum-exp
  (the live heads' rows, as the decode kernel does) and the split-KV merge runs in a second
  launch, as a layer does. A decode kernel built this way cannot beat this column, however fast
  its math.

Each program sums the first 64 dims of the first 8 tokens of every page it loaded (1 KB of the
page's 72 KB, read from shared memory) and stores the sum as its log-sum-exp, so a test can
check what was read. It runs where the Hopper decode kernel serves MLA (``available``), with that
kernel's pages, head blocks and stages.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..kernels import mla_decode_hopper
from ..kernels.launch import Launcher, Tma
from ..kernels.lse_merge import merge_checked
from ..kernels.mla_decode_hopper import BLOCK_H, D_ROPE, PAGE, STAGES
from ..kernels.mla_decode_hopper import D_V as D_NOPE


def available(device: torch.device) -> bool:
    """Whether the streaming kernel runs on ``device``: where the Hopper decode kernel serves MLA."""
    return mla_decode_hopper.serves(device, PAGE, D_NOPE + D_ROPE, D_NOPE) and _kernel() is not None


def layer(
    cache: torch.Tensor,
    table: torch.Tensor,
    *,
    heads: int,
    splits: int,
    chunk_pages: int,
    partial_o: torch.Tensor,
    partial_lse: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    """One layer's reads (``out`` None: the **read** column) or reads, partial writes and merge
    into ``out`` (the **bound** column). ``cache`` ``[pages, 1, PAGE, 576]`` contiguous;
    ``partial_o`` ``[B, splits, H, 512]`` float32 (with one split, ``out`` itself as ``[B, 1, H, 512]``:
    the decode kernel writes the output directly then); ``partial_lse`` ``[B, splits, H]`` float32."""
    rows = cache.view(-1, cache.shape[-1])
    batch, pages = table.shape
    _kernel()(
        (splits, -(-heads // BLOCK_H), batch),
        Tma.of(rows, (PAGE, D_NOPE)),
        Tma.of(rows, (PAGE, D_ROPE)),
        table,
        table.stride(0),
        partial_o,
        *partial_o.stride()[:3],
        partial_lse,
        *partial_lse.stride(),
        chunk_pages,
        pages,
        heads,
        PAGE=PAGE,
        D_NOPE=D_NOPE,
        D_ROPE=D_ROPE,
        BLOCK_H=BLOCK_H,
        STAGES=STAGES,
        PARTIALS=out is not None,
        num_warps=4,
    )
    if out is not None and splits > 1:
        merge_checked([(partial_o.unsqueeze(3), partial_lse.unsqueeze(3))], out)


@functools.cache
def _kernel() -> Any:
    """The Gluon streaming kernel, defined on first use; None where this Triton has no Gluon for Hopper."""
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    except ImportError:
        return None

    @gluon.jit
    def fetch(kn_desc, kr_desc, kn, kr, ready, seq_table, page, stage):
        row = gl.load(seq_table + page).to(gl.int32) * kn_desc.block_type.shape[0]
        mbarrier.expect(ready.index(stage), kn_desc.block_type.nbytes + kr_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(kn_desc, [row, 0], ready.index(stage), kn.index(stage))
        tma.async_copy_global_to_shared(
            kr_desc, [row, kn_desc.block_type.shape[1]], ready.index(stage), kr.index(stage)
        )

    @gluon.jit
    def stream(
        kn_desc,
        kr_desc,
        table_ptr,
        t_sb,
        o_ptr,
        o_sb,
        o_ss,
        o_sh,
        l_ptr,
        l_sb,
        l_ss,
        l_sh,
        chunk_pages,
        pages,
        heads,
        PAGE: gl.constexpr,
        D_NOPE: gl.constexpr,
        D_ROPE: gl.constexpr,
        BLOCK_H: gl.constexpr,
        STAGES: gl.constexpr,
        PARTIALS: gl.constexpr,
    ):
        split = gl.program_id(0)
        h = gl.program_id(1) * BLOCK_H
        b = gl.program_id(2).to(gl.int64)
        first = split * chunk_pages
        steps = gl.maximum(gl.minimum(chunk_pages, pages - first), 0)
        kn = gl.allocate_shared_memory(kn_desc.dtype, [STAGES, PAGE, D_NOPE], kn_desc.layout)
        kr = gl.allocate_shared_memory(kr_desc.dtype, [STAGES, PAGE, D_ROPE], kr_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(STAGES):
            mbarrier.init(ready.index(j), count=1)
        for j in gl.static_range(STAGES):
            if j < steps:
                fetch(kn_desc, kr_desc, kn, kr, ready, table_ptr + b * t_sb, first + j, j)
        row_layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
        seen = gl.zeros([8, 64], gl.float32, row_layout)
        for i in range(steps):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            seen += kn.index(s).slice(0, 8, dim=0).slice(0, 64, dim=1).load(row_layout).to(gl.float32)
            gl.thread_barrier()  # every warp has read the stage before it is loaded again
            if i + STAGES < steps:
                fetch(kn_desc, kr_desc, kn, kr, ready, table_ptr + b * t_sb, first + i + STAGES, s)
        r = h + gl.arange(0, BLOCK_H, gl.SliceLayout(1, row_layout))
        live = (r < heads) if PARTIALS else (r == h)  # without partials: one value per program
        checksum = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, row_layout)) + gl.sum(gl.sum(seen, 1), 0)
        gl.store(l_ptr + b * l_sb + split * l_ss + r * l_sh, checksum, mask=live)
        if PARTIALS:
            c = gl.arange(0, D_NOPE, gl.SliceLayout(0, row_layout))
            gl.store(
                o_ptr + b * o_sb + split * o_ss + r[:, None].to(gl.int64) * o_sh + c[None, :],
                gl.zeros([BLOCK_H, D_NOPE], o_ptr.dtype.element_ty, row_layout),
                mask=live[:, None],
            )

    return Launcher(stream)


__all__ = ["available", "layer"]
