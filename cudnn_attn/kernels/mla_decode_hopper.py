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

import torch

from . import mla_decode_hopper_kernel
from .launch import Tma, is_hopper
from .lse_merge import merge_checked, split_targets
from .mla_decode_hopper_kernel import BLOCK_H, D_ROPE, D_V, LOG2_E, PAGE, SECOND, STAGES
from .strides import strides_alike


def serves(device: torch.device, page_size: int, head_dim: int, head_dim_v: int) -> bool:
    """Whether calls of this geometry come here (given tensors ``usable`` accepts): an sm_90 GPU
    with Gluon, pages of 64 tokens, d 576 = 512 + 64."""
    return (
        device.type == "cuda"
        and (page_size, head_dim, head_dim_v) == (PAGE, D_V + D_ROPE, D_V)
        and is_hopper(device)
        and mla_decode_hopper_kernel.kernel() is not None
    )


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
        and strides_alike(v_cache, cache)
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
    kernel = mla_decode_hopper_kernel.kernel()
    batch, heads, _, dim = q.shape
    rows = _rows(cache, 2 if kv_layout == "NHPD" else 1)
    assert rows is not None, "mla_decode_hopper needs a cache usable() accepts"
    q_rows = q.reshape(batch * heads, dim)  # S_q = 1: one row per (sequence, head)
    if q_rows.stride(-1) != 1 or (q_rows.stride(0) * q.element_size()) % 16 or q_rows.data_ptr() % 16:
        q_rows = q_rows.contiguous()
    o, (o_sb, o_ss, o_sh), lse, (l_sb, l_ss, l_sh) = split_targets(out, splits, heads, D_V, partial_o, partial_lse)
    grid = (splits, -(-heads // BLOCK_H), batch)
    kernel(
        grid,
        Tma.of(q_rows, (BLOCK_H, D_V)),
        Tma.of(q_rows, (BLOCK_H, D_ROPE)),
        Tma.of(rows, (PAGE, D_V)),
        Tma.of(rows, (PAGE, D_ROPE)),
        table,
        table.stride(0),
        table.shape[1],
        lengths,
        o,
        o_sb,
        o_ss,
        o_sh,
        lse,
        l_sb,
        l_ss,
        l_sh,
        sink if sink is not None else lengths,
        scale * LOG2_E,
        chunk_pages,
        heads,
        D_V=D_V,
        D_ROPE=D_ROPE,
        BLOCK_H=BLOCK_H,
        PAGE=PAGE,
        STAGES=STAGES,
        SECOND=SECOND,
        NORMALISE=splits == 1,
        HAS_SINK=sink is not None,
        num_warps=4,
    )
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


__all__ = ["mla_decode_hopper", "serves", "usable"]
