"""Masks as dense tensors: the reference backend's (and the tests') view of every mask option.

Semantics follow the cuDNN frontend. Score (i, j) is row i of q, column j of k/v:

- the diagonal d(i) is i (top-left) or i + (S_kv - S_q) (bottom-right), with per-batch
  lengths under a padding mask;
- causal: j <= d(i); a right bound R: j <= d(i) + R;
- sliding window (left bound) of length W: also j > d(i) - W;
- padding: rows i >= seq_len_q[b] and columns j >= seq_len_kv[b] are masked;
- ALiBi: adds slope_h * (j - i), slopes as in the ALiBi paper (extended for head counts
  that are not powers of two).

A row whose every score is masked produces O = 0 and stats = -inf.
"""

from __future__ import annotations

import math

import torch

from ...core.mask import Causal
from ...core.problem import AttentionProblem


def allowed_scores(
    p: AttentionProblem,
    seq_len_q: torch.Tensor | None,
    seq_len_kv: torch.Tensor | None,
    device: torch.device | str,
    rows: range | None = None,
) -> torch.Tensor | None:
    """Boolean [B|1, 1, rows, S_kv]: True where a score takes part (``rows``: the query rows
    wanted, all by default). None when nothing is masked."""
    options = p.options
    if not options.masks_scores:
        return None
    rows = rows if rows is not None else range(p.s_q)
    s_kv = p.s_kv
    row = torch.arange(rows.start, rows.stop, device=device).view(1, 1, -1, 1)
    cols = torch.arange(s_kv, device=device).view(1, 1, 1, s_kv)
    len_q = _lengths(seq_len_q, p.batch, p.s_q, device)
    len_kv = _lengths(seq_len_kv, p.batch, s_kv, device)
    allowed = torch.ones(len_q.shape[0], 1, len(rows), s_kv, dtype=torch.bool, device=device)
    if options.padding:
        allowed &= (row < len_q) & (cols < len_kv)
    # The diagonal sits at column i + shift of row i.
    shift = (len_kv - len_q) if options.aligned_bottom_right else torch.zeros_like(len_q)
    if options.causal is not Causal.NONE:
        allowed &= cols <= row + shift
    if options.right_bound is not None:
        allowed &= cols <= row + shift + options.right_bound
    if options.sliding_window is not None:
        allowed &= cols > row + shift - options.sliding_window
    return allowed


def _lengths(lengths: torch.Tensor | None, batch: int, full: int, device) -> torch.Tensor:
    """Per-batch lengths as [B, 1, 1, 1] int64 (full length everywhere when not given)."""
    if lengths is None:
        return torch.full((batch, 1, 1, 1), full, dtype=torch.int64, device=device)
    return lengths.reshape(-1, 1, 1, 1).to(device=device, dtype=torch.int64)


def alibi_slopes(heads: int) -> torch.Tensor:
    """The ALiBi slope of each head, float64 [heads]."""
    closest = 2 ** math.floor(math.log2(heads))
    slopes = [2.0 ** (-8.0 * (i + 1) / closest) for i in range(closest)]
    if closest < heads:  # the remaining heads take the odd slopes of 2 * closest
        extra = [2.0 ** (-4.0 * (2 * i + 1) / closest) for i in range(heads - closest)]
        slopes += extra
    return torch.tensor(slopes, dtype=torch.float64)


def alibi_bias(heads: int, rows: range, s_kv: int, dtype: torch.dtype, device) -> torch.Tensor:
    """ALiBi as an additive bias [1, H, rows, S_kv]: slope_h * (j - i)."""
    distance = torch.arange(s_kv, device=device, dtype=dtype).view(1, -1) - torch.arange(
        rows.start, rows.stop, device=device, dtype=dtype
    ).view(-1, 1)
    return alibi_slopes(heads).to(device=device, dtype=dtype).view(1, heads, 1, 1) * distance
