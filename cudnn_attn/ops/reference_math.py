"""Attention in plain PyTorch on dense [B, H, S, D] tensors: the oracle for every backend.

Kept obviously right rather than fast: the whole score matrix is materialised, in float32
(or float64) whatever the input dtype.

Equivalent plain torch for the simple case::

    s = (q @ k.transpose(-1, -2)) * scale + bias       # masked entries -> -inf
    o = torch.softmax(s, -1) @ v
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ScoreTerms:
    """What turns q @ k^T into the final scores: everything but the data itself."""

    scale: float
    bias: torch.Tensor | None = None  # broadcastable to [B, H, S_q, S_kv]
    allowed: torch.Tensor | None = None  # bool, broadcastable; False = masked
    keep: torch.Tensor | None = None  # dropout keep-mask [B, H, S_q, S_kv]
    dropout_p: float = 0.0


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Repeat K/V heads for GQA/MQA: q head h reads kv head h // (H_q / H_kv)."""
    group = heads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _reduce_groups(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, s, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, terms: ScoreTerms) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * terms.scale
    if terms.bias is not None:
        s = s + terms.bias.to(s.dtype)
    if terms.allowed is not None:
        s = s.masked_fill(~terms.allowed, float("-inf"))
    return s


def _dropped(p: torch.Tensor, terms: ScoreTerms) -> torch.Tensor:
    if terms.keep is None or terms.dropout_p == 0.0:
        return p
    return p * terms.keep / (1.0 - terms.dropout_p)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, terms: ScoreTerms) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (O [B, H, S_q, D_v], stats [B, H, S_q, 1]); fully masked rows: O = 0, stats = -inf."""
    heads = q.shape[1]
    k, v = _expand_kv(k, heads), _expand_kv(v, heads)
    s = _scores(q, k, terms)
    row_max = s.amax(-1, keepdim=True)
    empty = torch.isneginf(row_max)
    row_max = torch.where(empty, torch.zeros_like(row_max), row_max)
    e = torch.exp(s - row_max)
    row_sum = e.sum(-1, keepdim=True)
    p = e / torch.where(empty, torch.ones_like(row_sum), row_sum)
    o = torch.matmul(_dropped(p, terms), v)
    stats = torch.where(empty, torch.full_like(row_max, float("-inf")), row_max + torch.log(row_sum))
    return o, stats


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    d_o: torch.Tensor,
    stats: torch.Tensor,
    terms: ScoreTerms,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dQ, dK, dV, dS) where dS [B, H, S_q, S_kv] is the gradient of the scores
    after scaling, which is also the gradient of an additive bias before reduction."""
    heads, kv_heads_k, kv_heads_v = q.shape[1], k.shape[1], v.shape[1]
    k_full, v_full = _expand_kv(k, heads), _expand_kv(v, heads)
    s = _scores(q, k_full, terms)
    # P from the forward's stats, as fused kernels do; masked and empty rows give 0.
    p = torch.exp(s - torch.where(torch.isneginf(stats), torch.zeros_like(stats), stats))
    p = torch.where(torch.isneginf(s), torch.zeros_like(p), p)
    d_v = torch.matmul(_dropped(p, terms).transpose(-1, -2), d_o)
    d_p = _dropped(torch.matmul(d_o, v_full.transpose(-1, -2)), terms)
    delta = (d_o * o).sum(-1, keepdim=True)
    d_s = p * (d_p - delta)
    d_q = torch.matmul(d_s, k_full) * terms.scale
    d_k = torch.matmul(d_s.transpose(-1, -2), q) * terms.scale
    return d_q, _reduce_groups(d_k, kv_heads_k), _reduce_groups(d_v, kv_heads_v), d_s


def reduce_to_shape(grad: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Sum a full [B, H, S_q, S_kv] gradient down to a broadcast bias shape."""
    dims = [i for i, (g, s) in enumerate(zip(grad.shape, shape)) if s == 1 and g != 1]
    return grad.sum(dim=dims, keepdim=True) if dims else grad
