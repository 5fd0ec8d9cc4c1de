"""``softcap=`` (FlashAttention's and Gemma-2's logit soft-capping) as a problem's score modifier.

cuDNN applies no mask of its own beside a score modifier, so the causal mask, sliding window
and right bound of the call's options move inside the modifier (``score_mod.band_mask``) and leave the
options. One modifier object per call shape (cached): plan lookups then compare it by identity.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from ..errors import UnsupportedError, ValidationError
from . import score_mod
from .finite import finite_real
from .mask import Causal, ScoreOptions
from .problem import TensorSpec


def softcap_modifier(
    cap: Any,
    options: ScoreOptions,
    s_q: int,
    s_kv: int,
    same_lengths: bool = False,
    offsets: TensorSpec | None = None,
) -> tuple[score_mod.ScoreModifier, ScoreOptions]:
    """``cap`` checked, as a score modifier holding the options' causal mask and window, and the
    options without them. ``s_q``, ``s_kv``: the score tile's extent (where a bottom-right
    diagonal sits). ``same_lengths``: every sequence has as many queries as keys (packed
    self-attention), so a top-left causal mask keeps each row's keys inside its sequence.
    ``offsets``: a packed batch's per-sequence ``S_kv - S_q`` (int32 ``[B, 1, 1, 1]``, the
    modifier's input 0), where each sequence's bottom-right diagonal sits."""
    if not finite_real(cap) or cap <= 0:
        raise ValidationError([f"softcap: {cap!r}; expected a finite number > 0 (scores become cap * tanh(s / cap))"])
    return _softcap_modifier(float(cap), options, s_q, s_kv, same_lengths, offsets)


@functools.lru_cache(maxsize=256)
def _softcap_modifier(
    cap: float, options: ScoreOptions, s_q: int, s_kv: int, same_lengths: bool, offsets: TensorSpec | None
) -> tuple[score_mod.ScoreModifier, ScoreOptions]:
    if options.alibi:
        raise UnsupportedError(["softcap with ALiBi: the capped scores take no ALiBi bias here"])
    offset: int | score_mod.Expr = 0
    if options.aligned_bottom_right:
        offset = s_kv - s_q if offsets is None else score_mod.Expr("input", value=0)
    mask = score_mod.band_mask(causal=options.causal is not Causal.NONE, window=options.sliding_window, offset=offset)
    if options.right_bound is not None:  # a band past the diagonal: key j kept iff j <= d(i) + R
        mask = _and(mask, _right_bound_mask(options.right_bound, offset))
    plain = ScoreOptions(attn_scale=options.attn_scale, padding=options.padding, dropout_p=options.dropout_p)
    in_bounds = same_lengths and options.causal is Causal.TOP_LEFT
    modifier = score_mod.softcap(cap, mask, keys_in_bounds=in_bounds)
    if offsets is not None and isinstance(offset, score_mod.Expr):
        modifier = dataclasses.replace(modifier, inputs=(offsets,))
    return modifier, plain


def _right_bound_mask(right: int, offset: int | score_mod.Expr) -> score_mod.Expr:
    row, col = score_mod.op("gen_index", score_mod.SCORE, value=2), score_mod.op("gen_index", score_mod.SCORE, value=3)
    if isinstance(offset, score_mod.Expr):
        bound = score_mod.op("add", score_mod.diagonal_of(row, offset), score_mod.constant(right))
    else:
        bound = score_mod.op("add", row, score_mod.constant(offset + right))
    return score_mod.op("cmp_le", col, bound)


def _and(kept: score_mod.Expr | None, more: score_mod.Expr) -> score_mod.Expr:
    return more if kept is None else score_mod.op("logical_and", kept, more)
