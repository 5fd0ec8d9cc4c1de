"""Decode over paged 16-bit caches on Hopper: a warp-specialised Gluon kernel (TMA loads, wgmma).

The same work as ``paged_decode``'s Triton kernel -- one sequence, one K/V head and one chunk
of its pages per program, the group's query heads by the step's query tokens as the rows of
one tile, bottom-right causal per row, sinks folded into the first chunk -- written the way the
Hopper MLA kernel is:

- a loader warp streams each step's K and V (64 tokens: a page, part of one, or 2-4 pages of
  16-32 tokens, a TMA box each) into a ring of shared-memory stages with TMA, the page indices
  read ahead;
- one warp group multiplies Q (in shared memory, loaded once) by each step's keys, runs the
  online softmax, and accumulates ``P @ V`` with P held in registers; up to 16 query rows it
  turns the products over (``K @ Q^T``, ``V^T @ P^T``: ``paged_decode_hopper_swapped``), so
  that the math is sized by the rows there are rather than by a 64-row tile.

The copies run ahead of the math by the ring's depth, issued by one thread each, so a program
keeps ``STAGES`` steps of K and V in flight while it computes. The kernel and its split merge
can launch as programmatic dependent launches (``grid_dependency``), each starting while the
kernel before it drains: on an H200 that took 1.0-1.4 us off a decode layer. Pages of 16-256 tokens,
head dims 64, 128 or 256, fp16/bf16 caches (FP8 caches stay on the Triton kernel, which widens
them in registers), token rows TMA can address; ``usable`` says which.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import paged_decode_hopper_kernel
from .launch import Tma, is_hopper
from .lse_merge import merge_checked, split_targets
from .paged_decode_hopper_kernel import BLOCK_N, BLOCK_R, LOG2_E
from .strides import strides_alike

HEAD_DIMS = (64, 128, 256)
PAGES = (16, 32, 64, 128, 256)
RING_BYTES = 160 * 1024  # shared memory for the K/V ring: 3 steps of d 128, 2 of d 256
MAX_STAGES = 3
# Query rows up to which a step's products are turned over (``paged_decode_hopper_swapped``): the
# keys are wgmma's 64 rows and the query rows its 8 or 16 columns. H200, graph replays: 16 rows
# (4 query tokens) 0.8% faster at full clock and 13% at a busy GPU's; 32 rows 1.5% and 7% slower.
SWAPPED_MAX_ROWS = 16
DEPENDENT_LAUNCHES = ("off", "wait", "early")


def tile_rows(rows: int) -> tuple[int, bool]:
    """The tile's query rows for a step of ``rows`` (the group's heads by the step's tokens) and
    whether the products are turned over: 8 or 16 columns where they are, else ``BLOCK_R`` rows."""
    if rows <= SWAPPED_MAX_ROWS:
        return max(8, 1 << (rows - 1).bit_length()), True
    return BLOCK_R, False


def serves(device: torch.device, page_size: int, head_dim: int, rows: int) -> bool:
    """Whether calls of this geometry come here (given tensors ``tensors_fit`` accepts): an sm_90
    GPU with Gluon, pages of 16-256 tokens, a head dim of 64, 128 or 256, at most ``BLOCK_R``
    query rows (the group's heads by the step's tokens)."""
    return (
        device.type == "cuda"
        and _geometry_fits(page_size, head_dim, rows)
        and is_hopper(device)
        and paged_decode_hopper_kernel.kernel() is not None
    )


def _geometry_fits(page_size: int, head_dim: int, rows: int) -> bool:
    return page_size in PAGES and head_dim in HEAD_DIMS and rows <= BLOCK_R


class Rows(NamedTuple):
    """A cache as TMA reads it: ``view``, its token rows ``[rows, width]``; a page's first row is
    ``page * row_page``, a head's ``row_head`` rows and ``col_head`` columns further."""

    view: torch.Tensor
    row_page: int
    row_head: int
    col_head: int


def token_rows(cache: torch.Tensor, kv_layout: str) -> Rows | None:
    """``cache`` (``[N, P, H_kv, D]`` NPHD or ``[N, H_kv, P, D]`` NHPD) as 2-D token rows, or
    None where one TMA descriptor cannot address it (a row stride TMA cannot take, pages or
    heads not whole rows apart)."""
    if kv_layout == "NHPD":
        (pages, kv_heads, page, dim), (s_page, s_head, s_token, s_dim) = cache.shape, cache.stride()
    else:
        (pages, page, kv_heads, dim), (s_page, s_token, s_head, s_dim) = cache.shape, cache.stride()
    size = cache.element_size()
    if s_dim != 1 or s_token <= 0 or (s_token * size) % 16 or cache.data_ptr() % 16 or s_page % s_token:
        return None
    if s_head % s_token == 0 and s_head // s_token >= page:  # heads whole rows apart: NHPD-like
        row_head, col_head, width = s_head // s_token, 0, dim
    elif (kv_heads - 1) * s_head + dim <= s_token and (s_head * size) % 16 == 0:  # heads side by side in a row
        row_head, col_head, width = 0, s_head, (kv_heads - 1) * s_head + dim
    else:
        return None
    row_page = s_page // s_token
    rows = (pages - 1) * row_page + (kv_heads - 1) * row_head + page
    if row_page < page or rows >= 2**31:
        return None
    return Rows(torch.as_strided(cache, (rows, width), (s_token, 1)), row_page, row_head, col_head)


def usable(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_layout: str) -> bool:
    """Whether this kernel serves the call: ``tensors_fit`` and ``serves`` this GPU."""
    page = k_cache.shape[2 if kv_layout == "NHPD" else 1]
    kv_heads = k_cache.shape[1 if kv_layout == "NHPD" else 2]
    return tensors_fit(q, k_cache, v_cache, kv_layout) and serves(
        q.device, page, q.shape[-1], q.shape[1] // kv_heads * q.shape[2]
    )


def tensors_fit(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_layout: str) -> bool:
    """Whether the kernel takes these tensors, wherever they are: fp16/bf16 query and caches of
    one dtype, shape and layout, K's head dim the query's, the query's head dim contiguous, a
    geometry the kernel tiles, and token rows one TMA descriptor addresses in both caches."""
    page = k_cache.shape[2 if kv_layout == "NHPD" else 1]
    kv_heads = k_cache.shape[1 if kv_layout == "NHPD" else 2]
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and k_cache.dtype == q.dtype == v_cache.dtype
        and v_cache.shape == k_cache.shape
        and strides_alike(v_cache, k_cache)
        and k_cache.shape[-1] == q.shape[-1]
        and q.stride(-1) == 1
        and q.shape[1] % kv_heads == 0
        and _geometry_fits(page, q.shape[-1], q.shape[1] // kv_heads * q.shape[2])
        and token_rows(k_cache, kv_layout) is not None
        and token_rows(v_cache, kv_layout) is not None
    )


def default_stages(head_dim: int) -> int:
    """Steps of K and V in flight per program: three where the ring's shared memory holds them.
    Measured on an H200 (d 128, graph replay): three ran 1-3% ahead of four and of two at every
    shape of ``bench --serving``."""
    return min(MAX_STAGES, RING_BYTES // (2 * BLOCK_N * head_dim * 2))


def paged_decode_hopper(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
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
    stages: int | None = None,
    dependent_launch: str = "off",
) -> torch.Tensor:
    """``paged_decode`` for calls ``usable`` accepts (same arguments; ``stages``: the ring's depth
    where not ``default_stages``). ``dependent_launch`` (``grid_dependency``): ``"off"``;
    ``"wait"``, launched to start while the kernel before drains, every read after it completes;
    ``"early"``, the same with the length and first page indices read before it completes (the
    caller knows that kernel did not write them)."""
    assert dependent_launch in DEPENDENT_LAUNCHES, dependent_launch
    kernel = paged_decode_hopper_kernel.kernel()
    dependent = dependent_launch != "off"
    batch, heads, s_q, dim = q.shape
    k_rows, v_rows = token_rows(k_cache, kv_layout), token_rows(v_cache, kv_layout)
    assert k_rows is not None and v_rows is not None, "paged_decode_hopper needs caches usable() accepts"
    kv_heads = k_cache.shape[1 if kv_layout == "NHPD" else 2]
    page = k_cache.shape[2 if kv_layout == "NHPD" else 1]
    block_r, swapped = tile_rows(heads // kv_heads * s_q)
    o, (o_sb, o_ss, o_sh), lse, (l_sb, l_ss, l_sh) = split_targets(
        out, splits, heads * s_q, dim, partial_o, partial_lse
    )
    kernel(
        (splits, kv_heads, batch),
        Tma.of(k_rows.view, (min(page, BLOCK_N), dim)),
        Tma.of(v_rows.view, (min(page, BLOCK_N), dim)),
        q,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        table,
        table.stride(0),
        table.shape[1],
        lengths,
        out,
        out.stride(0),
        out.stride(1),
        out.stride(2),
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
        chunk_pages * page,
        k_rows.row_page,
        k_rows.row_head,
        k_rows.col_head,
        GROUP=heads // kv_heads,
        S_Q=s_q,
        HEAD_DIM=dim,
        PAGE=page,
        BLOCK_N=BLOCK_N,
        BLOCK_R=block_r,
        STAGES=stages or default_stages(dim),
        SPLIT=splits > 1,
        HAS_SINK=sink is not None,
        SWAPPED=swapped,
        PDL=dependent,
        EARLY_READS=dependent_launch == "early",
        # Where the next kernel may start: the merge once every program's stores are issued (its
        # programs placed beside the decode's slowed it: 7.9 us a layer against 6.3, batch 1 over
        # 2k); the next layer, where there is no merge, once every program has started.
        RELEASE_AT_END=splits > 1,
        num_warps=4,
        launch_pdl=dependent,
    )
    if splits > 1:
        parts = o.unflatten(2, (heads, s_q)), lse.unflatten(2, (heads, s_q))
        merge_checked([parts], out, dependent_launch=dependent)
    return out


__all__ = ["paged_decode_hopper", "serves", "tensors_fit", "token_rows", "usable"]
