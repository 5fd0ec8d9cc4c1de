"""A block's rows into a running float32 result, in one pass: an output merged by log-sum-exp,
or a gradient added.

Context parallelism computes each query row's attention in blocks (one per ring step, or per
packed call), each giving a partial output ``o`` normalised over the block's keys and its
log-sum-exp ``l``, for a selection of the rows: all of them, a run of them (a slice), or rows
picked by index (packed documents' chunks). As torch ops on the selected rows of the running
``(out, lse)``::

    new = logaddexp(lse, l)
    out = out * exp(lse - new) + o * exp(l - new);  lse = new

and the backward adds each block's dQ into a float32 ``d_q`` the same way (``d_q[rows] += g``).
As torch ops that is a gather, eight elementwise passes and a scatter over float32 rows of the
shard (2.2 ms a step for 64k packed rows of 32 heads on an H200, beside a 4 ms attention call).
On CUDA with Triton, one launch reads the block and the rows it lands on and writes them back.
``first=True`` writes the rows without reading them (the first block of every row: no fill).

Tensors are given as ``[B, H, S, D]`` views (any strides: a packed ``[T, H, D]`` tensor is
``t.permute(1, 0, 2).unsqueeze(0)``) and LSEs as ``[B, H, S]``; the block's rows are ``[B, H, M, ·]``
and land at S positions ``rows`` (an int64 ``[M]`` tensor, each position once) or ``start + m``.
Elsewhere (CPU, no Triton, heads wider than 512) the same arithmetic runs as torch ops.
"""

from __future__ import annotations

import functools
import importlib.util
import types
from typing import Any

import torch

from .launch import Launcher

MAX_D = 512
TILE = 4096  # elements a program loads at once: ROWS rows x the head dim (a power of two)

Rows = torch.Tensor | int  # an int64 index of S positions, or the first of a run


def as_rows(packed: torch.Tensor) -> torch.Tensor:
    """A packed ``[T, H, ·]`` tensor as the ``[1, H, T, ·]`` view these functions take."""
    return packed.transpose(0, 1).unsqueeze(0)


def merge_rows(
    out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, o_lse: torch.Tensor, rows: Rows, first: bool = False
) -> None:
    """Merge the block ``(o [B, H, M, D], o_lse [B, H, M])`` into ``out`` (float32 ``[B, H, S, D]``)
    and ``lse`` (float32 ``[B, H, S]``) at the S positions ``rows``, in place.

    Example, a block of the second half of the rows::

        merge_rows(out, lse, o_half, lse_half, rows=seq // 2)
    """
    kernels = _kernels_for(out, o)
    if kernels is None:
        _merge_torch(out, lse, o, o_lse, rows, first)
        return
    b, h, m, d = o.shape
    _launch(
        kernels.merge,
        out,
        [*out.stride(), lse, *lse.stride(), o, *o.stride(), o_lse, *o_lse.stride()],
        rows,
        b * h * m,
        h,
        m,
        d,
        first,
    )


def add_rows(target: torch.Tensor, grad: torch.Tensor, rows: Rows, first: bool = False) -> None:
    """``target[:, :, rows] += grad`` (``= grad`` when ``first``): float32 ``[B, H, S, D]`` and any
    float ``[B, H, M, D]``, the positions ``rows`` each once, in place."""
    kernels = _kernels_for(target, grad)
    if kernels is None:
        at = _at(target, rows, grad.shape[2])
        if isinstance(at, torch.Tensor):
            if first:
                target.index_copy_(2, at, grad.to(target.dtype))
            else:
                target.index_add_(2, at, grad.to(target.dtype))
        else:
            view = target[:, :, at]
            view.copy_(grad) if first else view.add_(grad)
        return
    b, h, m, d = grad.shape
    _launch(kernels.add, target, [*target.stride(), grad, *grad.stride()], rows, b * h * m, h, m, d, first)


def _launch(
    kernel: Any,
    target: torch.Tensor,
    args: list[Any],
    rows: Rows,
    total: int,
    heads: int,
    count: int,
    dim: int,
    first: bool,
) -> None:
    """One program per ROWS of the block's ``total`` rows (``heads`` x ``count`` per batch row)."""
    if total == 0:
        return
    block_d = 1 << (dim - 1).bit_length()
    per_program = max(1, TILE // block_d)
    indexed = isinstance(rows, torch.Tensor)
    index = rows if indexed else target  # a pointer never read when not indexed
    start = 0 if indexed else int(rows)
    grid = (-(-total // per_program),)
    kernel(
        grid,
        target,
        *args,
        index,
        start,
        total,
        heads,
        count,
        dim,
        INDEXED=indexed,
        FIRST=first,
        ROWS=per_program,
        BLOCK_D=block_d,
    )


def _kernels_for(target: torch.Tensor, block: torch.Tensor) -> Any:
    if not target.is_cuda or block.shape[-1] > MAX_D or block.numel() == 0:
        return None
    return _kernels()


def _at(t: torch.Tensor, rows: Rows, m: int) -> torch.Tensor | slice:
    return rows if isinstance(rows, torch.Tensor) else slice(int(rows), int(rows) + m)


@torch.no_grad()
def _merge_torch(
    out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, o_lse: torch.Tensor, rows: Rows, first: bool
) -> None:
    at = _at(out, rows, o.shape[2])
    if first:
        if isinstance(at, torch.Tensor):
            out.index_copy_(2, at, o.to(out.dtype))
            lse.index_copy_(2, at, o_lse)
        else:
            out[:, :, at].copy_(o)
            lse[:, :, at].copy_(o_lse)
        return
    if isinstance(at, torch.Tensor):
        acc, old = out.index_select(2, at), lse.index_select(2, at)
    else:
        acc, old = out[:, :, at], lse[:, :, at]
    new = torch.logaddexp(old, o_lse)
    base = torch.where(torch.isneginf(new), torch.zeros_like(new), new).unsqueeze(-1)
    weight = torch.exp(o_lse.unsqueeze(-1) - base)
    acc.mul_(torch.exp(old.unsqueeze(-1) - base)).add_(torch.where(weight > 0, o * weight, 0.0))
    old.copy_(new)
    if isinstance(at, torch.Tensor):  # merged in a copy: written back
        out.index_copy_(2, at, acc)
        lse.index_copy_(2, at, old)


@functools.cache
def _kernels() -> Any:
    """The Triton kernels, compiled on first use; None without Triton."""
    if importlib.util.find_spec("triton") is None:
        return None
    import triton
    import triton.language as tl

    @triton.jit
    def place(rows_ptr, start, count, heads, total, ROWS: tl.constexpr, INDEXED: tl.constexpr):
        """Each of the program's rows: (b, h, m) in the block, its S position, whether it exists."""
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        live = row < total
        mi = row % count
        hi = (row // count) % heads
        bi = row // count // heads
        if INDEXED:
            si = tl.load(rows_ptr + mi, mask=live, other=0)
        else:
            si = mi + start
        return bi, hi, mi, si, live

    @triton.jit
    def merge(
        out_ptr,
        out_sb,
        out_sh,
        out_ss,
        out_sd,
        lse_ptr,
        lse_sb,
        lse_sh,
        lse_ss,
        o_ptr,
        o_sb,
        o_sh,
        o_ss,
        o_sd,
        l_ptr,
        l_sb,
        l_sh,
        l_ss,
        rows_ptr,
        start,
        total,
        heads,
        count,
        dim,
        INDEXED: tl.constexpr,
        FIRST: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        bi, hi, mi, si, live = place(rows_ptr, start, count, heads, total, ROWS, INDEXED)
        col = tl.arange(0, BLOCK_D)
        inside = live[:, None] & (col < dim)[None, :]
        block_lse = tl.load(l_ptr + bi * l_sb + hi * l_sh + mi * l_ss, mask=live, other=float("-inf"))
        o = tl.load(
            o_ptr + (bi * o_sb + hi * o_sh + mi * o_ss)[:, None] + (col * o_sd)[None, :], mask=inside, other=0.0
        ).to(tl.float32)
        out_ptrs = out_ptr + (bi * out_sb + hi * out_sh + si * out_ss)[:, None] + (col * out_sd)[None, :]
        lse_ptrs = lse_ptr + bi * lse_sb + hi * lse_sh + si * lse_ss
        if FIRST:
            result, new = o, block_lse
        else:
            old = tl.load(lse_ptrs, mask=live, other=float("-inf"))
            top = tl.maximum(old, block_lse)
            base = tl.where(top == float("-inf"), 0.0, top)  # no key on either side: both weights 0
            w_old, w_new = tl.exp(old - base), tl.exp(block_lse - base)
            total_w = w_old + w_new
            new = base + tl.log(total_w)
            acc = tl.load(out_ptrs, mask=inside, other=0.0)
            # A side of weight 0 adds nothing, whatever it holds.
            both = tl.where((w_old > 0)[:, None], acc * w_old[:, None], 0.0)
            both += tl.where((w_new > 0)[:, None], o * w_new[:, None], 0.0)
            result = both / tl.where(total_w > 0, total_w, 1.0)[:, None]
        tl.store(out_ptrs, result, mask=inside)
        tl.store(lse_ptrs, new, mask=live)

    @triton.jit
    def add(
        t_ptr,
        t_sb,
        t_sh,
        t_ss,
        t_sd,
        g_ptr,
        g_sb,
        g_sh,
        g_ss,
        g_sd,
        rows_ptr,
        start,
        total,
        heads,
        count,
        dim,
        INDEXED: tl.constexpr,
        FIRST: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        bi, hi, mi, si, live = place(rows_ptr, start, count, heads, total, ROWS, INDEXED)
        col = tl.arange(0, BLOCK_D)
        inside = live[:, None] & (col < dim)[None, :]
        g = tl.load(
            g_ptr + (bi * g_sb + hi * g_sh + mi * g_ss)[:, None] + (col * g_sd)[None, :], mask=inside, other=0.0
        ).to(tl.float32)
        t_ptrs = t_ptr + (bi * t_sb + hi * t_sh + si * t_ss)[:, None] + (col * t_sd)[None, :]
        if not FIRST:
            g += tl.load(t_ptrs, mask=inside, other=0.0)
        tl.store(t_ptrs, g, mask=inside)

    return types.SimpleNamespace(merge=Launcher(merge), add=Launcher(add))
