"""Attention in plain PyTorch on dense [B, H, S, D] tensors: the oracle for every backend.

Kept obviously right rather than fast: scores are materialised in float32 (or float64)
whatever the input dtype. Query rows go in blocks, so memory stays bounded at any length:
masks and ALiBi are made per block at run time (``ScoreTerms.block``), never whole.

Equivalent plain torch for the simple case::

    s = (q @ k.transpose(-1, -2)) * scale + bias       # masked entries -> -inf
    o = torch.softmax(s, -1) @ v
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

# Scores held at once (elements): query rows go in blocks of at most this many scores.
BLOCK_SCORES = 1 << 24
_EXP_WARMED: set[torch.dtype] = set()


def warm_exp(dtype: torch.dtype, device: torch.device) -> None:
    """One throwaway parallel ``torch.exp`` per CPU dtype before the first real one. On torch
    2.13's CPU, the first parallel exp of a process after a matmul came out of one worker thread
    off by up to 1e-4 in about one process in eight (the second call exact: measured 12 of 50
    fresh processes, none after this warm-up in 60), which put 2.5e-5 into float32 results."""
    if device.type == "cpu" and dtype not in _EXP_WARMED:
        torch.exp(torch.zeros(1 << 16, dtype=dtype))
        _EXP_WARMED.add(dtype)


@dataclass
class BlockTerms:
    """What turns q @ k^T into the final scores of a block of query rows."""

    scale: float
    bias: torch.Tensor | None = None  # broadcastable to [B, H, rows, S_kv]
    allowed: torch.Tensor | None = None  # bool, broadcastable; False = masked
    keep: torch.Tensor | None = None  # dropout keep-mask [B, H, rows, S_kv]
    dropout_p: float = 0.0
    rows: range = range(0)
    modifier: Callable[[torch.Tensor, range], torch.Tensor] | None = None
    modifier_grad: Callable[[torch.Tensor, torch.Tensor, range], torch.Tensor] | None = None


@dataclass
class ScoreTerms:
    """The same for the whole problem; masks and ALiBi are made per block of rows."""

    scale: float
    bias: torch.Tensor | None = None  # broadcastable to [B, H, S_q, S_kv]
    alibi: Callable[[range], torch.Tensor] | None = None  # rows -> [1, H, rows, S_kv]
    allowed: Callable[[range], torch.Tensor | None] | None = None  # rows -> bool mask or None
    keep: torch.Tensor | None = None  # dropout keep-mask [B, H, S_q, S_kv]
    dropout_p: float = 0.0
    sink: torch.Tensor | None = None  # attention sinks: [1, H, 1, 1] logits, one more term of each denominator
    # A score modifier (ops/reference/score_mod.py): (scaled scores, rows) -> scores, applied before
    # the bias; its gradient (dS, scaled scores, rows) -> the scaled scores' gradient (None: identity).
    modifier: Callable[[torch.Tensor, range], torch.Tensor] | None = None
    modifier_grad: Callable[[torch.Tensor, torch.Tensor, range], torch.Tensor] | None = None

    def block(self, rows: range) -> BlockTerms:
        bias = self.bias
        if bias is not None and bias.shape[-2] != 1:
            bias = bias[..., rows.start : rows.stop, :]
        if self.alibi is not None:
            alibi = self.alibi(rows)
            bias = alibi if bias is None else bias + alibi
        return BlockTerms(
            scale=self.scale,
            bias=bias,
            allowed=None if self.allowed is None else self.allowed(rows),
            keep=None if self.keep is None else self.keep[..., rows.start : rows.stop, :],
            dropout_p=self.dropout_p,
            rows=rows,
            modifier=self.modifier,
            modifier_grad=self.modifier_grad,
        )


def row_blocks(s_q: int, scores_per_row: int) -> Iterator[range]:
    """Consecutive ranges of query rows holding at most ``BLOCK_SCORES`` scores each."""
    step = max(1, BLOCK_SCORES // max(scores_per_row, 1))
    for start in range(0, s_q, step):
        yield range(start, min(start + step, s_q))


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Repeat K/V heads for GQA/MQA: q head h reads kv head h // (H_q / H_kv)."""
    group = heads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _reduce_groups(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, s, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def _scaled(q: torch.Tensor, k: torch.Tensor, terms: BlockTerms) -> torch.Tensor:
    return torch.matmul(q, k.transpose(-1, -2)) * terms.scale


def _scores(q: torch.Tensor, k: torch.Tensor, terms: BlockTerms, scaled: torch.Tensor | None = None) -> torch.Tensor:
    s = _scaled(q, k, terms) if scaled is None else scaled
    if terms.modifier is not None:
        s = torch.broadcast_to(terms.modifier(s, terms.rows), s.shape)
    if terms.bias is not None:
        s = s + terms.bias.to(s.dtype)
    if terms.allowed is not None:
        s = s.masked_fill(~terms.allowed, float("-inf"))
    return s


def _dropped(p: torch.Tensor, terms: BlockTerms) -> torch.Tensor:
    if terms.keep is None or terms.dropout_p == 0.0:
        return p
    return p * terms.keep / (1.0 - terms.dropout_p)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, terms: ScoreTerms) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (O [B, H, S_q, D_v], stats [B, H, S_q, 1]); fully masked rows: O = 0, stats = -inf
    (with a sink: O = 0, stats = the sink). Stats are the log-sum-exp over the keys and the sink."""
    b, heads, s_q, _ = q.shape
    warm_exp(q.dtype, q.device)
    k, v = _expand_kv(k, heads), _expand_kv(v, heads)
    o = q.new_empty(b, heads, s_q, v.shape[-1])
    stats = q.new_empty(b, heads, s_q, 1)
    for rows in row_blocks(s_q, b * heads * k.shape[2]):
        part = terms.block(rows)
        s = _scores(q[:, :, rows.start : rows.stop], k, part)
        # No keys at all (S_kv = 0): every row is fully masked.
        row_max = s.amax(-1, keepdim=True) if s.shape[-1] else s.new_full((*s.shape[:-1], 1), float("-inf"))
        if terms.sink is not None:  # a sink is one more score, weighing no value
            row_max = torch.maximum(row_max, terms.sink.to(s.dtype))
        empty = torch.isneginf(row_max)
        row_max = torch.where(empty, torch.zeros_like(row_max), row_max)
        e = torch.exp(s - row_max)
        row_sum = e.sum(-1, keepdim=True)
        if terms.sink is not None:
            row_sum = row_sum + torch.exp(terms.sink.to(s.dtype) - row_max)
        p = e / torch.where(empty, torch.ones_like(row_sum), row_sum)
        o[:, :, rows.start : rows.stop] = torch.matmul(_dropped(p, part), v)
        lse = torch.where(empty, torch.full_like(row_max, float("-inf")), row_max + torch.log(row_sum))
        stats[:, :, rows.start : rows.stop] = lse
    return o, stats


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    d_o: torch.Tensor,
    stats: torch.Tensor,
    terms: ScoreTerms,
    bias_shape: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Returns (dQ, dK, dV, dBias). dBias, given ``bias_shape``, is the gradient of an additive
    bias of that (broadcast) shape: the score gradient after scaling, summed over broadcast dims.
    A sink's gradient is ``core.sink_fold.sink_gradient`` (it needs only the stats and delta)."""
    b, heads, s_q, _ = q.shape
    warm_exp(q.dtype, q.device)
    kv_heads_k, kv_heads_v = k.shape[1], v.shape[1]
    k_full, v_full = _expand_kv(k, heads), _expand_kv(v, heads)
    d_q = torch.empty_like(q)
    d_k = q.new_zeros(k_full.shape)
    d_v = q.new_zeros(v_full.shape)
    d_bias = q.new_zeros(bias_shape) if bias_shape is not None else None
    delta = (d_o * o).sum(-1, keepdim=True)
    for rows in row_blocks(s_q, b * heads * k_full.shape[2]):
        block = slice(rows.start, rows.stop)
        part = terms.block(rows)
        scaled = _scaled(q[:, :, block], k_full, part)
        s = _scores(q[:, :, block], k_full, part, scaled)
        lse = stats[:, :, block]
        # P from the forward's stats, as fused kernels do; masked and empty rows give 0.
        p = torch.exp(s - torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse))
        p = torch.where(torch.isneginf(s), torch.zeros_like(p), p)
        d_v += torch.matmul(_dropped(p, part).transpose(-1, -2), d_o[:, :, block])
        d_p = _dropped(torch.matmul(d_o[:, :, block], v_full.transpose(-1, -2)), part)
        d_s = p * (d_p - delta[:, :, block])
        d_scaled = (
            d_s if part.modifier_grad is None else torch.broadcast_to(part.modifier_grad(d_s, scaled, rows), d_s.shape)
        )
        d_q[:, :, block] = torch.matmul(d_scaled, k_full) * terms.scale
        d_k += torch.matmul(d_scaled.transpose(-1, -2), q[:, :, block]) * terms.scale
        if d_bias is not None:
            reduced = reduce_to_shape(
                d_s, tuple(d_bias.shape[:2]) + (1 if d_bias.shape[2] == 1 else len(rows),) + tuple(d_bias.shape[3:])
            )
            if d_bias.shape[2] == 1:
                d_bias += reduced
            else:
                d_bias[:, :, block] = reduced
    return d_q, _reduce_groups(d_k, kv_heads_k), _reduce_groups(d_v, kv_heads_v), d_bias


def reduce_to_shape(grad: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Sum a [B, H, rows, S_kv] gradient down to a broadcast bias shape."""
    dims = [i for i, (g, s) in enumerate(zip(grad.shape, shape)) if s == 1 and g != 1]
    return grad.sum(dim=dims, keepdim=True) if dims else grad
