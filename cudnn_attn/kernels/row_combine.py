"""Every partial result of a row, kept apart and combined once at the end, in one pass.

Context parallelism over packed documents computes each query row in a few blocks (one per
ring step, or per packed call). Merging each block into a float32 running result as it arrives
(``row_merge``) reads and writes the whole float32 result once per block; keeping each block's
rows where the attention call wrote them (in q's dtype) and combining them once reads each
partial once and writes the answer once, in its final dtype: on 64k rows of 32 heads over four
ring steps, about a quarter of the bytes. The arithmetic is the running merge's, in float32.

``parts`` ``[P, H, D]`` holds every partial row; ``where`` (int32 ``[T, K]``) gives, for each of
the T result rows, the part rows that are its partials (-1: fewer than K). Weighted (outputs,
with each part's log-sum-exp ``parts_lse`` ``[P, H]``)::

    L = logsumexp_k(lse_k [, sink]);   out = sum_k exp(lse_k - L) * o_k;   lse = L

and unweighted (gradients): ``out = sum_k o_k``. A row with no partial (and no sink) gets
``out = 0`` and ``lse = -inf``; a partial of weight 0 adds nothing whatever its O holds (NaN
where a block saw no key). On CUDA with Triton one launch does it; elsewhere torch ops do.
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


def combine_rows(
    out: torch.Tensor,
    parts: torch.Tensor,
    where: torch.Tensor,
    lse: torch.Tensor | None = None,
    parts_lse: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
) -> None:
    """Write ``out`` (``[T, H, D]``, any float dtype, contiguous rows) from the ``parts`` rows
    ``where`` names; with ``parts_lse``, weighted by log-sum-exp, writing ``lse`` (float32
    ``[T, H]``) too, ``sink`` (float32 ``[H]``) one more term of every row's denominator.

    Example, two partials per row, weighted::

        combine_rows(out, parts, where, lse=lse, parts_lse=parts_lse)
    """
    weighted = parts_lse is not None and lse is not None
    if (parts_lse is None) != (lse is None):
        raise ValueError("combine_rows: a weighted combine takes parts_lse and writes lse")
    kernels = _kernels_for(out, parts)
    if kernels is None:
        _combine_torch(out, parts, where, lse, parts_lse, sink)
        return
    t, h, d = out.shape
    if t * h == 0:
        return
    block_d = 1 << (d - 1).bit_length()
    per_program = max(1, TILE // block_d)
    grid = (-(-(t * h) // per_program),)
    absent = out  # a pointer never read when its flag is off
    kernels.combine(
        grid,
        out,
        out.stride(0),
        out.stride(1),
        lse if weighted else absent,
        parts,
        parts.stride(0),
        parts.stride(1),
        parts_lse if weighted else absent,
        parts_lse.stride(0) if parts_lse is not None else 0,
        where,
        sink if sink is not None else absent,
        t * h,
        h,
        d,
        K=where.shape[1],
        WEIGHTED=weighted,
        SINK=sink is not None,
        ROWS=per_program,
        BLOCK_D=block_d,
    )


def where_of(rows: torch.Tensor, tokens: int) -> torch.Tensor:
    """``combine_rows``' ``where`` (int32 ``[tokens, K]``, on ``rows``' device) for a parts buffer
    whose row ``p`` is a partial of result row ``rows[p]`` (int64 ``[P]``): each result row's part
    rows in the order they sit in the buffer, -1 past its last.

    Example, parts rows 0-3 partials of result rows 0, 1, 1, 0::

        where_of(torch.tensor([0, 1, 1, 0]), 2)  # [[0, 3], [1, 2]]
    """
    per_row = torch.bincount(rows, minlength=tokens)
    depth = max(1, int(per_row.max())) if rows.numel() else 1
    order = torch.sort(rows, stable=True).indices
    first = per_row.cumsum(0) - per_row
    slot = torch.arange(rows.numel(), device=rows.device) - first[rows[order]]
    where = torch.full((tokens, depth), -1, dtype=torch.int32, device=rows.device)
    where[rows[order], slot] = order.to(torch.int32)
    return where


def _kernels_for(out: torch.Tensor, parts: torch.Tensor) -> Any:
    if not out.is_cuda or out.shape[-1] > MAX_D or out.stride(-1) != 1 or parts.stride(-1) != 1:
        return None
    return _kernels()


@torch.no_grad()
def _combine_torch(
    out: torch.Tensor,
    parts: torch.Tensor,
    where: torch.Tensor,
    lse: torch.Tensor | None,
    parts_lse: torch.Tensor | None,
    sink: torch.Tensor | None,
) -> None:
    index = where.long()
    present = index >= 0  # [T, K]
    taken = parts[index.clamp(min=0)].float()  # [T, K, H, D]
    if parts_lse is None:
        out.copy_(torch.where(present[:, :, None, None], taken, 0.0).sum(1))
        return
    assert lse is not None
    terms = parts_lse[index.clamp(min=0)].masked_fill(~present[:, :, None], float("-inf"))  # [T, K, H]
    every = terms if sink is None else torch.cat([terms, sink.float().expand(terms.shape[0], 1, -1)], 1)
    top = every.amax(1, keepdim=True)
    base = torch.where(torch.isneginf(top), 0.0, top)
    weights = torch.exp(every - base)
    total = weights.sum(1, keepdim=True)
    w = weights[:, : terms.shape[1]]
    summed = torch.where((w > 0)[..., None], taken * w[..., None], 0.0).sum(1)
    out.copy_(summed / torch.where(total > 0, total, 1.0)[:, 0, :, None])
    lse.copy_((base + torch.log(total))[:, 0])


@functools.cache
def _kernels() -> Any:
    """The Triton kernel, compiled on first use; None without Triton."""
    if importlib.util.find_spec("triton") is None:
        return None
    import triton
    import triton.language as tl

    @triton.jit
    def combine(
        out_ptr,
        out_st,
        out_sh,
        lse_ptr,
        parts_ptr,
        parts_st,
        parts_sh,
        parts_lse_ptr,
        parts_lse_st,
        where_ptr,
        sink_ptr,
        total,
        heads,
        dim,
        K: tl.constexpr,
        WEIGHTED: tl.constexpr,
        SINK: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        live = row < total
        ti = row // heads
        hi = row % heads
        col = tl.arange(0, BLOCK_D)
        inside = live[:, None] & (col < dim)[None, :]
        acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        if WEIGHTED:
            top = tl.full([ROWS], float("-inf"), tl.float32)
            for k in tl.static_range(K):
                at = tl.load(where_ptr + ti * K + k, mask=live, other=-1).to(tl.int64)
                part_lse = tl.load(parts_lse_ptr + at * parts_lse_st + hi, mask=live & (at >= 0), other=float("-inf"))
                top = tl.maximum(top, part_lse)
            if SINK:
                sink = tl.load(sink_ptr + hi, mask=live, other=float("-inf"))
                top = tl.maximum(top, sink)
            base = tl.where(top == float("-inf"), 0.0, top)  # no term at all: every weight 0
            denominator = tl.zeros([ROWS], dtype=tl.float32)
            for k in tl.static_range(K):
                at = tl.load(where_ptr + ti * K + k, mask=live, other=-1).to(tl.int64)
                here = live & (at >= 0)
                part_lse = tl.load(parts_lse_ptr + at * parts_lse_st + hi, mask=here, other=float("-inf"))
                weight = tl.exp(part_lse - base)
                o = tl.load(
                    parts_ptr + (at * parts_st + hi * parts_sh)[:, None] + col[None, :],
                    mask=inside & here[:, None],
                    other=0.0,
                ).to(tl.float32)
                acc += tl.where((weight > 0)[:, None], o * weight[:, None], 0.0)  # weight 0: NaN O adds nothing
                denominator += weight
            if SINK:
                denominator += tl.exp(sink - base)
            acc = acc / tl.where(denominator > 0, denominator, 1.0)[:, None]
            tl.store(lse_ptr + ti * heads + hi, base + tl.log(denominator), mask=live)
        else:
            for k in tl.static_range(K):
                at = tl.load(where_ptr + ti * K + k, mask=live, other=-1).to(tl.int64)
                acc += tl.load(
                    parts_ptr + (at * parts_st + hi * parts_sh)[:, None] + col[None, :],
                    mask=inside & (at >= 0)[:, None],
                    other=0.0,
                ).to(tl.float32)
        tl.store(out_ptr + (ti * out_st + hi * out_sh)[:, None] + col[None, :], acc, mask=inside)

    return types.SimpleNamespace(combine=Launcher(combine))
