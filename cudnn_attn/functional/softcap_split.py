"""Causal soft-capping as unmasked rectangles and a small masked diagonal, merged by log-sum-exp.

cuDNN applies no mask of its own beside a score modifier, so a causal soft-capped call writes its
mask inside the modifier (``core/softcap``) and computes every tile, the masked half too: 0.35-0.5x
the uncapped call. Split along the diagonal instead, in ``L`` levels: at level ``l`` the queries of
the lower half of each block of ``S / 2**(l-1)`` rows against the keys of its upper half (a
rectangle every score of which is visible: no mask), and a diagonal of ``2**L`` blocks, causal
within (the mask in the modifier, over ``S / 2**L`` rows only). Each level is one call over views
(the blocks folded into the batch), so the tiles computed shrink from ``S**2`` to
``S**2 / 2 + S**2 / 2**(L+1)``.

The forward's parts merge by log-sum-exp in one pass (``kernels.row_combine``). The backward runs
each part with the merged O and LSE, the softmax all parts share, so its dQ, dK and dV are exactly
that part's terms; they are summed the same way. As context parallelism's blocks, exact up to the
rounding of each part's result to q's dtype.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ..core.mask import Causal, ScoreOptions
from ..core.problem import strides_like
from ..core.softcap import softcap_modifier
from ..kernels.row_combine import combine_rows, where_of
from . import score_terms_runs as runs

MIN_BLOCK = 512  # the diagonal's rows per block: below it, a call costs more than the masked tiles it skips
MAX_LEVELS = 4
# B x H_q x S^2 x D below which the split's merges and extra calls cost what its skipped tiles save
# (measured on an H200: B2 H16 S4k d128, 0.7e11, no faster split; B1 H16 S8k d256, 2.7e11, 1.4x)
MIN_WORK = 1.5e11


@dataclass(frozen=True)
class Piece:
    """One call of the split: ``count`` blocks of ``rows`` queries per batch entry, the first at
    query row ``q_start`` and key row ``k_start``, one every ``step`` rows; causal within or not."""

    q_start: int
    k_start: int
    rows: int
    step: int
    count: int
    causal: bool


@dataclass(frozen=True)
class CausalSplit:
    """A causal soft-capped call as its ``pieces`` and each piece's options and score modifier."""

    pieces: tuple[Piece, ...]
    calls: tuple[tuple[ScoreOptions, Any], ...]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """O (laid out like q) and the float32 stats ``[B, H, S, 1]`` of ``[B, H, S, D]`` tensors."""
        qt, kt, vt = _tokens(q), _tokens(k), _tokens(v)
        batch, seq, heads, d_v = qt.shape[0], qt.shape[1], qt.shape[2], vt.shape[3]
        layout = _layout(batch, seq, self.pieces, str(q.device))
        parts = torch.empty(layout.total, heads, d_v, dtype=q.dtype, device=q.device)
        parts_lse = torch.empty(layout.total, heads, dtype=torch.float32, device=q.device)
        for piece, start, (options, modifier) in zip(self.pieces, layout.starts, self.calls):
            n, rows = batch * piece.count, piece.rows
            o = parts[start : start + n * rows].view(n, rows, heads, d_v).transpose(1, 2)
            blocks = (
                _blocks(qt, piece.q_start, piece),
                _blocks(kt, piece.k_start, piece),
                _blocks(vt, piece.k_start, piece),
            )
            _, stats = runs.forward(*blocks, None, None, options, modifier, None, outputs={"o": o})
            parts_lse[start : start + n * rows].view(n, rows, heads).copy_(stats.view(n, heads, rows).transpose(1, 2))
        out = torch.empty(batch * seq, heads, d_v, dtype=q.dtype, device=q.device)
        lse = torch.empty(batch * seq, heads, dtype=torch.float32, device=q.device)
        combine_rows(out, parts, layout.where_q, lse, parts_lse)
        stats = lse.view(batch, seq, heads).transpose(1, 2).unsqueeze(-1).contiguous()
        return _laid_out_like(out.view(batch, seq, heads, d_v).transpose(1, 2), q), stats

    def backward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, d_out: torch.Tensor, stats
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dQ, dK, dV (each laid out like its input) from the forward's ``out`` and ``stats``."""
        qt, kt, vt, ot = _tokens(q), _tokens(k), _tokens(v), _tokens(out)
        dot = d_out.transpose(1, 2)
        if dot.stride() != ot.stride():
            dot = torch.empty_like(ot).copy_(dot)
        batch, seq, heads, d_qk = qt.shape
        kv_heads, d_v = kt.shape[2], vt.shape[3]
        layout = _layout(batch, seq, self.pieces, str(q.device))
        d_q = torch.empty(layout.total, heads, d_qk, dtype=q.dtype, device=q.device)
        d_k = torch.empty(layout.total, kv_heads, d_qk, dtype=k.dtype, device=q.device)
        d_v_parts = torch.empty(layout.total, kv_heads, d_v, dtype=v.dtype, device=q.device)
        stats = stats.contiguous()
        for piece, start, (options, modifier) in zip(self.pieces, layout.starts, self.calls):
            n, rows = batch * piece.count, piece.rows
            span = slice(start, start + n * rows)
            written = {
                "grad_q": d_q[span].view(n, rows, heads, d_qk).transpose(1, 2),
                "grad_k": d_k[span].view(n, rows, kv_heads, d_qk).transpose(1, 2),
                "grad_v": d_v_parts[span].view(n, rows, kv_heads, d_v).transpose(1, 2),
            }
            runs.backward(
                options,
                modifier,
                False,
                _blocks(qt, piece.q_start, piece),
                _blocks(kt, piece.k_start, piece),
                _blocks(vt, piece.k_start, piece),
                None,
                None,
                _blocks(ot, piece.q_start, piece),
                _blocks(dot, piece.q_start, piece),
                _stats_blocks(stats, piece),
                None,
                outputs=written,
            )
        grads = []
        for parts, where, like in ((d_q, layout.where_q, q), (d_k, layout.where_k, k), (d_v_parts, layout.where_k, v)):
            total = torch.empty(batch * seq, *parts.shape[1:], dtype=parts.dtype, device=parts.device)
            combine_rows(total, parts, where)
            grads.append(_laid_out_like(total.view(batch, seq, *parts.shape[1:]).transpose(1, 2), like))
        return grads[0], grads[1], grads[2]


def causal_split(
    cap: float, options: ScoreOptions, q: torch.Tensor, k: torch.Tensor, bias: Any, sinks: Any
) -> CausalSplit | None:
    """The split of a causal soft-capped call on CUDA tensors (on the CPU the reference backend
    skips no tile either way) large enough to gain (``MIN_WORK``), or None where ``splits`` says
    it does not apply."""
    seq = q.shape[2]
    if not q.is_cuda or not splits(options, seq, k.shape[2], bias is not None or sinks is not None):
        return None
    if q.shape[0] * q.shape[1] * seq * seq * q.shape[3] < MIN_WORK:
        return None
    return split_of(cap, options.attn_scale, seq, levels_for(seq))


def splits(options: ScoreOptions, seq_q: int, seq_kv: int, more_terms: bool) -> bool:
    """Whether a soft-capped call with these options splits: causal (a window no narrower than
    the sequence) over as many queries as keys, long enough for one level, with no bias, sinks
    (``more_terms``), dropout, ALiBi or sequence lengths."""
    return not (
        more_terms
        or options.dropout_p
        or options.alibi
        or options.padding
        or options.right_bound is not None
        or options.causal is Causal.NONE
        or seq_kv != seq_q
        or (options.sliding_window is not None and options.sliding_window < seq_q)
        or levels_for(seq_q) == 0
    )


def levels_for(seq: int) -> int:
    """How many levels split ``seq`` rows: as many as keep the diagonal's blocks whole and at
    least ``MIN_BLOCK`` rows, at most ``MAX_LEVELS``."""
    levels = 0
    while levels < MAX_LEVELS and seq % (2 << levels) == 0 and seq // (2 << levels) >= MIN_BLOCK:
        levels += 1
    return levels


@functools.lru_cache(maxsize=64)
def split_of(cap: float, scale: float, seq: int, levels: int) -> CausalSplit:
    """The split of ``seq`` rows in ``levels`` levels (``levels >= 1``, ``seq`` divisible by
    ``2**levels``)."""
    block = seq >> levels
    pieces = [Piece(0, 0, block, block, seq // block, causal=True)]
    for level in range(1, levels + 1):
        rows = seq >> level
        pieces.append(Piece(rows, 0, rows, 2 * rows, seq // (2 * rows), causal=False))
    calls = []
    for piece in pieces:
        options = ScoreOptions(attn_scale=scale, causal=Causal.TOP_LEFT if piece.causal else Causal.NONE)
        calls.append(softcap_modifier(cap, options, piece.rows, piece.rows)[::-1])
    return CausalSplit(tuple(pieces), tuple(calls))


class SplitCall:
    """A split call as the training seam runs it (``runtime/training.py``): inputs ``(q, k, v)``."""

    non_differentiable: tuple[int, ...] = ()

    def __init__(self, split: CausalSplit):
        self.split = split

    def forward(self, inputs: tuple) -> tuple[tuple[torch.Tensor], tuple, None]:
        q, k, v = inputs
        out, stats = self.split.forward(q, k, v)
        return (out,), (q, k, v, out, stats), None

    def backward(self, saved: tuple, state: None, grads: tuple, needs: tuple[bool, ...]) -> tuple:
        q, k, v, out, stats = saved
        return self.split.backward(q, k, v, out, grads[0], stats)


@dataclass(frozen=True, eq=False)
class _Layout:
    """Where each piece's rows sit in the parts buffers (``starts``, ``total`` rows), and the
    part rows of every query row (``where_q``) and key row (``where_k``)."""

    starts: tuple[int, ...]
    total: int
    where_q: torch.Tensor
    where_k: torch.Tensor


@functools.lru_cache(maxsize=64)
def _layout(batch: int, seq: int, pieces: tuple[Piece, ...], device: str) -> _Layout:
    starts, q_rows, k_rows, total = [], [], [], 0
    for piece in pieces:
        starts.append(total)
        total += batch * piece.count * piece.rows
        first = (torch.arange(batch)[:, None] * seq + torch.arange(piece.count)[None, :] * piece.step).reshape(-1, 1)
        within = first + torch.arange(piece.rows)[None, :]
        q_rows.append((within + piece.q_start).reshape(-1))
        k_rows.append((within + piece.k_start).reshape(-1))
    where_q = where_of(torch.cat(q_rows), batch * seq).to(device)
    where_k = where_of(torch.cat(k_rows), batch * seq).to(device)
    return _Layout(tuple(starts), total, where_q, where_k)


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, S, D]`` as ``[B, S, H, D]`` whose blocks of rows fold into the batch (a view
    where the rows are outside the heads and the batch outside the rows; else a copy)."""
    t = x.transpose(1, 2)
    b, s, h, d = t.shape
    dense_rows = t.stride(3) == 1 and t.stride(2) == d and t.stride(1) >= h * d
    if dense_rows and (b == 1 or t.stride(0) == s * t.stride(1)):
        return t
    return t.contiguous()


def _blocks(t: torch.Tensor, start: int, piece: Piece) -> torch.Tensor:
    """The piece's blocks of ``t`` (``[B, S, H, D]``, from ``_tokens``) as ``[B * count, H, rows, D]``."""
    b, _, h, d = t.shape
    stride = t.stride()
    view = t.as_strided(
        (b * piece.count, piece.rows, h, d),
        (piece.step * stride[1], stride[1], stride[2], stride[3]),
        t.storage_offset() + start * stride[1],
    )
    return view.transpose(1, 2)


def _stats_blocks(stats: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The piece's query rows of contiguous ``[B, H, S, 1]`` stats, as contiguous ``[B * count, H, rows, 1]``."""
    b, h, s, _ = stats.shape
    rows = stats.as_strided(
        (b, h, piece.count, piece.rows), (h * s, s, piece.step, 1), stats.storage_offset() + piece.q_start
    )
    return rows.transpose(1, 2).reshape(b * piece.count, h, piece.rows, 1).contiguous()  # cuDNN < 9.26: packed


def _laid_out_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` in the layout torch's ops give a result shaped as ``like`` (a copy where it differs)."""
    strides = strides_like(tuple(t.shape), like.stride())
    if t.stride() == strides:
        return t
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)
