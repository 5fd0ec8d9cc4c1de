"""The merge step of split-KV (flash-decoding) attention: chunk results into the whole.

Attention over a long key sequence is computed in key chunks, each giving a partial output
``O_i`` (normalised within its chunk) and its log-sum-exp ``L_i`` (natural log of the scaled
scores, what cuDNN's ``Stats`` holds; -inf for a chunk with no visible key). The exact result
is, as plain torch::

    m = max_i L_i;  w_i = exp(L_i - m);  L = m + log(sum_i w_i);  O = sum_i w_i O_i / sum_i w_i

with ``O = 0`` and ``L = -inf`` where every ``L_i`` is -inf (never NaN), and a chunk whose
weight is 0 adding nothing (its ``O_i`` may hold anything, NaN included).

On CUDA with Triton (it ships with torch's CUDA builds) one launch merges one or two parts
(a body of N chunks and a tail, say) straight from their strided views into ``out`` (any
strides, a BSHD view included), in float32, with no allocation and no host sync, so a call is
safe to capture in a CUDA graph once it has run eagerly (the kernel compiles on first use).
Elsewhere, and for more than two parts, the same float32 arithmetic runs as torch ops; both
paths give the same values up to float32 rounding, rounded once to ``out``'s dtype.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ValidationError
from .launch import Launcher

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
KERNEL_PARTS = 2  # the kernel's part slots: a body and a tail
MAX_BLOCK_D = 256  # wider heads take several programs per row, one per block of D
TILE = 4096  # bounds BLOCK_D x CHUNKS: the block of D a program loads for every chunk at once
# Rows a program takes: as many as fit this many values. Fewer than TILE's, so that a small
# merge still spreads over the SMs: on an H200 (graph replay, merge alone) decode's merges of
# 2-4 chunks ran 0.6-1.2 us faster (GQA batch 4 over 8k: 2.90 -> 1.91 us; MLA batch 64:
# 3.90 -> 2.69), 12 of 14 shapes faster or the same, two slower (MLA 128 heads at batch 8:
# 6.59 -> 7.74 us; GQA batch 2 with 8 chunks: 1.88 -> 2.07).
ROW_TILE = 1024
MAX_CHUNKS = 128  # chunks per block of loads: up to 128 splits (a 32k MLA decode of 16 heads) in one round

Parts = Sequence[tuple[torch.Tensor, torch.Tensor]]  # (o, stats) pairs


def merge_partials(parts: Parts, out: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
    """Merge chunk partials into ``out`` (written in place) and optionally ``lse``. Returns ``out``.

    parts: ``(o, stats)`` pairs; ``o`` is ``[B, N_i, H, S, D]`` (any strides, fp16/bf16/fp32),
    ``stats`` is ``[B, N_i, H, S]`` float32 (any strides) -- ``N_i`` chunks each (a pair may hold
    one chunk: ``N_i = 1``).
    out: ``[B, H, S, D]`` (any strides, e.g. a BSHD view; fp16/bf16/fp32).
    lse: optional ``[B, H, S]`` float32, written with ``L``.

    Example, a body of 8 chunks and a tail chunk into a BSHD buffer::

        merge_partials([(o_body, stats_body), (o_tail, stats_tail)], out_bshd.transpose(1, 2))
    """
    problems = _problems(parts, out, lse)
    if problems:
        raise ValidationError(problems, "merge_partials")
    return merge_checked(parts, out, lse)


def merge_checked(
    parts: Parts, out: torch.Tensor, lse: torch.Tensor | None = None, *, dependent_launch: bool = False
) -> torch.Tensor:
    """``merge_partials`` for arguments already known good (a decode kernel's own partial
    buffers): the checks cost an eager decode step more host time than the launch.
    ``dependent_launch``: launched to start while the kernel before it drains, reading the
    partials once it has completed (``grid_dependency``)."""
    launchable = out.is_cuda and out.numel() > 0 and len(parts) <= KERNEL_PARTS
    kernels = _kernels() if launchable else None
    if kernels is None:
        _merge_torch(parts, out, lse)
    else:
        _merge_triton(kernels, parts, out, lse, dependent_launch)
    return out


def split_targets(
    out: torch.Tensor,
    splits: int,
    heads: int,
    dim: int,
    partial_o: torch.Tensor | None,
    partial_lse: torch.Tensor | None,
) -> tuple[torch.Tensor, tuple[int, int, int], torch.Tensor, tuple[int, int, int]]:
    """Where a split-KV decode kernel writes, with (batch, split, head) strides: ``out``
    ``[B, H, 1, D]`` itself for one split (normalised; no log-sum-exp, its target a placeholder
    never written), else float32 partial outputs ``[B, splits, H, D]`` and log-sum-exps
    ``[B, splits, H]`` (the caller's persistent ones, or made here) for ``merge_partials``."""
    if splits == 1:
        return out, (out.stride(0), 0, out.stride(1)), out, (0, 0, 0)
    batch = out.shape[0]
    o = partial_o if partial_o is not None else out.new_empty(batch, splits, heads, dim, dtype=torch.float32)
    lse = partial_lse if partial_lse is not None else out.new_empty(batch, splits, heads, dtype=torch.float32)
    return o, (o.stride(0), o.stride(1), o.stride(2)), lse, (lse.stride(0), lse.stride(1), lse.stride(2))


def _problems(parts: Any, out: Any, lse: Any) -> list[str]:
    """Every problem with the arguments, one line each, naming the argument."""
    problems: list[str] = []
    sizes: dict[str, tuple[int, str]] = {}  # dimension letter -> (size, whose)
    device = out.device if isinstance(out, torch.Tensor) else None
    if _check(problems, "out", out, "BHSD", FLOATS, sizes, None):
        sizes.update((letter, (size, "out's")) for letter, size in zip("BHSD", out.shape))
    if isinstance(parts, torch.Tensor) or not isinstance(parts, Sequence) or len(parts) == 0:
        problems.append(f"parts: {_described(parts)} is not a non-empty sequence of (o, stats) pairs")
        parts = ()
    for i, part in enumerate(parts):
        if isinstance(part, torch.Tensor) or not isinstance(part, Sequence) or len(part) != 2:
            problems.append(f"parts[{i}]: {_described(part)} is not an (o, stats) pair")
            continue
        o, stats = part
        chunks = dict(sizes)
        if _check(problems, f"parts[{i}].o", o, "BNHSD", FLOATS, sizes, device):
            chunks["N"] = (o.shape[1], "o's")
        _check(problems, f"parts[{i}].stats", stats, "BNHS", (torch.float32,), chunks, device)
    if lse is not None:
        _check(problems, "lse", lse, "BHS", (torch.float32,), sizes, device)
    return problems


def _check(
    problems: list[str],
    name: str,
    x: Any,
    letters: str,
    dtypes: tuple[torch.dtype, ...],
    sizes: dict[str, tuple[int, str]],
    device: torch.device | None,
) -> bool:
    """Append ``x``'s problems; whether it has the rank ``letters`` names (its sizes can be read)."""
    layout = f"[{', '.join(letters)}]"
    if not isinstance(x, torch.Tensor) or x.dim() != len(letters):
        problems.append(f"{name}: {_described(x)} is not a {len(letters)}-D {layout} tensor")
        return False
    for letter, size in zip(letters, x.shape):
        if letter in sizes and sizes[letter][0] != size:
            want, whose = sizes[letter]
            problems.append(f"{name}: {letter} = {size} in {layout} differs from {whose} {want}")
    if x.dtype not in dtypes:
        problems.append(f"{name}: dtype {x.dtype} is not one of {', '.join(str(d)[6:] for d in dtypes)}")
    if device is not None and x.device != device:
        problems.append(f"{name}: on {x.device}, out is on {device}")
    return True


def _described(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__} of {len(x)} items" if isinstance(x, Sequence) else f"a {type(x).__name__}"


@torch.no_grad()
def _merge_torch(parts: Parts, out: torch.Tensor, lse: torch.Tensor | None) -> None:
    """The merge as torch ops in float32 (any device, any number of parts)."""
    stats = torch.cat([s for _, s in parts], dim=1)  # [B, N, H, S]
    if stats.shape[1] == 0:  # no chunk at all: no visible key
        out.zero_()
        if lse is not None:
            lse.fill_(float("-inf"))
        return
    o = torch.cat([o.float() for o, _ in parts], dim=1)  # [B, N, H, S, D]
    top = stats.amax(dim=1, keepdim=True)
    base = top.masked_fill(top == float("-inf"), 0.0)  # all chunks empty: every weight exp(-inf) = 0
    weights = torch.exp(stats - base)
    total = weights.sum(dim=1)
    w = weights.unsqueeze(-1)
    acc = torch.where(w > 0, w * o, 0.0).sum(dim=1)  # a chunk of weight 0 is never read, even if NaN
    out.copy_(acc / torch.where(total > 0, total, 1.0).unsqueeze(-1))
    if lse is not None:
        lse.copy_(base.squeeze(1) + torch.log(total))  # log(0) = -inf for rows with no visible key


def _merge_triton(
    kernels: Any, parts: Parts, out: torch.Tensor, lse: torch.Tensor | None, dependent_launch: bool = False
) -> None:
    """One launch over every (b, h, s) row, reading each part in place."""
    b, h, s, d = out.shape
    slots = [*parts, *parts[:1]][:KERNEL_PARTS]  # an unused slot repeats the first, with no chunks
    args: list[Any] = []
    for i, (o, stats) in enumerate(slots):
        chunks = o.shape[1] if i < len(parts) else 0
        args += [o, stats, chunks, *o.stride(), *stats.stride()]
    most = max(o.shape[1] for o, _ in parts)
    chunks = min(MAX_CHUNKS, 1 << max(0, most - 1).bit_length())  # chunks read at once
    block_d = min(MAX_BLOCK_D, 1 << (d - 1).bit_length(), max(32, TILE // chunks))
    rows_per_program = max(1, ROW_TILE // (block_d * chunks))
    rows = b * h * s
    grid = (-(-rows // rows_per_program), -(-d // block_d))
    record = lse if lse is not None else out  # a pointer the kernel never writes when not recording
    kernels.merge(
        grid,
        *args,
        out,
        *out.stride(),
        record,
        *(lse.stride() if lse is not None else (0, 0, 0)),
        rows,
        h,
        s,
        d,
        WRITE_LSE=lse is not None,
        ROWS=rows_per_program,
        BLOCK_D=block_d,
        CHUNKS=chunks,
        ONE_PASS=len(parts) == 1 and most <= chunks,
        PDL=dependent_launch,
        **({"launch_pdl": True} if dependent_launch else {}),  # a Triton without the option takes plain calls
    )


@functools.cache
def _kernels() -> Any:
    """The Triton kernel, compiled on first use; None without Triton."""
    if importlib.util.find_spec("triton") is None:
        return None
    import types

    import triton
    import triton.language as tl

    from .grid_dependency import triton_functions

    dependency = triton_functions()
    wait_for_previous, release_next = dependency.wait, dependency.release

    # Chunks are read CHUNKS at a time, each block of loads independent of the last: a long
    # split (64-128 chunks of a 32k decode) is then bound by bandwidth, not by one load's latency.
    @triton.jit
    def top(m, s_ptrs, n, s_sn, live, CHUNKS: tl.constexpr):
        c = tl.arange(0, CHUNKS)
        for first in range(0, n, CHUNKS):
            inside = live[:, None] & (first + c < n)[None, :]
            s = tl.load(s_ptrs[:, None] + (first + c).to(tl.int64)[None, :] * s_sn, mask=inside, other=float("-inf"))
            m = tl.maximum(m, tl.max(s, 1))
        return m

    @triton.jit
    def accumulate(acc, total, base, s_ptrs, o_ptrs, n, s_sn, o_sn, live, inside, CHUNKS: tl.constexpr):
        c = tl.arange(0, CHUNKS)
        for first in range(0, n, CHUNKS):
            chunk = first + c
            w = tl.exp(
                tl.load(
                    s_ptrs[:, None] + chunk.to(tl.int64)[None, :] * s_sn,
                    mask=live[:, None] & (chunk < n)[None, :],
                    other=float("-inf"),
                )
                - base[:, None]
            )  # [ROWS, CHUNKS]
            # Read beside the weights, not after them; a chunk of weight 0 (no visible key) adds
            # nothing, whatever its O holds (NaN included).
            read = inside[:, None, :] & (chunk < n)[None, :, None]
            o = tl.load(o_ptrs[:, None, :] + (chunk.to(tl.int64) * o_sn)[None, :, None], mask=read, other=0.0)
            acc += tl.sum(tl.where((w > 0)[:, :, None], w[:, :, None] * o.to(tl.float32), 0.0), 1)
            total += tl.sum(w, 1)
        return acc, total

    @triton.jit
    def merge(
        o0_ptr,
        s0_ptr,
        n0,
        o0_sb,
        o0_sn,
        o0_sh,
        o0_ss,
        o0_sd,
        s0_sb,
        s0_sn,
        s0_sh,
        s0_ss,
        o1_ptr,
        s1_ptr,
        n1,
        o1_sb,
        o1_sn,
        o1_sh,
        o1_ss,
        o1_sd,
        s1_sb,
        s1_sn,
        s1_sh,
        s1_ss,
        out_ptr,
        out_sb,
        out_sh,
        out_ss,
        out_sd,
        lse_ptr,
        lse_sb,
        lse_sh,
        lse_ss,
        rows,
        heads,
        seq,
        dim,
        WRITE_LSE: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_D: tl.constexpr,
        CHUNKS: tl.constexpr,
        ONE_PASS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:  # the partials are the decode kernel's: read once it has completed
            wait_for_previous()
            release_next()
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        col = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        live = row < rows
        inside = live[:, None] & (col < dim)[None, :]
        si = row % seq
        hi = (row // seq) % heads
        bi = row // seq // heads
        s0_ptrs = s0_ptr + bi * s0_sb + hi * s0_sh + si * s0_ss
        s1_ptrs = s1_ptr + bi * s1_sb + hi * s1_sh + si * s1_ss
        o0_ptrs = o0_ptr + (bi * o0_sb + hi * o0_sh + si * o0_ss)[:, None] + (col * o0_sd)[None, :]
        o1_ptrs = o1_ptr + (bi * o1_sb + hi * o1_sh + si * o1_ss)[:, None] + (col * o1_sd)[None, :]

        if ONE_PASS:  # one part of at most CHUNKS chunks: its stats and outputs in one round of loads
            c = tl.arange(0, CHUNKS)
            s = tl.load(
                s0_ptrs[:, None] + c.to(tl.int64)[None, :] * s0_sn,
                mask=live[:, None] & (c < n0)[None, :],
                other=float("-inf"),
            )
            o = tl.load(
                o0_ptrs[:, None, :] + (c.to(tl.int64) * o0_sn)[None, :, None],
                mask=inside[:, None, :] & (c < n0)[None, :, None],
                other=0.0,
            )
            m = tl.max(s, 1)
            base = tl.where(m == float("-inf"), 0.0, m)
            w = tl.exp(s - base[:, None])
            acc = tl.sum(tl.where((w > 0)[:, :, None], w[:, :, None] * o.to(tl.float32), 0.0), 1)
            total = tl.sum(w, 1)
        else:
            m = tl.full([ROWS], float("-inf"), tl.float32)
            m = top(m, s0_ptrs, n0, s0_sn, live, CHUNKS)
            m = top(m, s1_ptrs, n1, s1_sn, live, CHUNKS)
            base = tl.where(m == float("-inf"), 0.0, m)  # all chunks empty: every weight exp(-inf) = 0
            acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
            total = tl.zeros([ROWS], tl.float32)
            acc, total = accumulate(acc, total, base, s0_ptrs, o0_ptrs, n0, s0_sn, o0_sn, live, inside, CHUNKS)
            acc, total = accumulate(acc, total, base, s1_ptrs, o1_ptrs, n1, s1_sn, o1_sn, live, inside, CHUNKS)

        result = acc / tl.where(total > 0, total, 1.0)[:, None]
        out_ptrs = out_ptr + (bi * out_sb + hi * out_sh + si * out_ss)[:, None] + (col * out_sd)[None, :]
        tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=inside)
        if WRITE_LSE:  # log(0) = -inf for rows with no visible key; one program per row writes it
            tl.store(
                lse_ptr + bi * lse_sb + hi * lse_sh + si * lse_ss,
                base + tl.log(total),
                mask=live & (tl.program_id(1) == 0),
            )

    return types.SimpleNamespace(merge=Launcher(merge))
