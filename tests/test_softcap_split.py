"""Causal soft-capping split into unmasked rectangles and a masked diagonal (``functional/softcap_split``):
on the reference backend, every layout, its output, stats and gradients against the whole call."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err

import cudnn_attn
from cudnn_attn.core.mask import Causal, ScoreOptions
from cudnn_attn.functional import softcap_split
from cudnn_attn.runtime.training import differentiable

CAP = 5.0


def _layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``[B, H, S, D]`` values in a given memory layout."""
    if layout == "bhsd":
        return t.contiguous()
    if layout == "bshd":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    # a slice of a fused projection: rows of [q | k | v]-like width, heads dense inside
    b, h, s, d = t.shape
    fused = torch.zeros(b, s, 3, h, d, dtype=t.dtype)
    fused[:, :, 1] = t.transpose(1, 2)
    return fused[:, :, 1].transpose(1, 2)


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "fused"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("levels", [1, 3])
def test_split_equals_the_whole_causal_call(layout, batch, levels):
    g = torch.Generator().manual_seed(3 + levels + batch)
    s, scale = 64, 0.3
    q = _layout(torch.randn(batch, 4, s, 16, generator=g) * 2, layout).requires_grad_()
    k = _layout(torch.randn(batch, 2, s, 16, generator=g) * 2, layout).requires_grad_()
    v = _layout(torch.randn(batch, 2, s, 8, generator=g), layout).requires_grad_()
    d_out = torch.randn(batch, 4, s, 8, generator=g)
    split = softcap_split.split_of(CAP, scale, s, levels)
    assert len(split.pieces) == levels + 1
    out = differentiable(softcap_split.SplitCall(split), q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    expected = cudnn_attn.sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=True, softcap=CAP)
    expected_grads = torch.autograd.grad(expected, (q, k, v), d_out)
    assert out.stride() == expected.stride()
    assert rel_err(out, expected) < 1e-5
    for name, a, e in zip(("dQ", "dK", "dV"), grads, expected_grads):
        assert rel_err(a, e) < 1e-5, name


def test_split_stats_are_the_whole_calls_log_sum_exp():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 32, 8, generator=g) for _ in range(3))
    _, stats = softcap_split.split_of(CAP, 1.0, 32, 2).forward(q, k, v)
    scores = CAP * torch.tanh(q @ k.transpose(-1, -2) / CAP)
    scores = scores.masked_fill(torch.ones(32, 32, dtype=torch.bool).triu(1), float("-inf"))
    assert stats.shape == (2, 2, 32, 1) and stats.is_contiguous()
    assert rel_err(stats, torch.logsumexp(scores, -1, keepdim=True)) < 1e-6


def test_levels_keep_the_diagonal_blocks_whole_and_large_enough():
    block = softcap_split.MIN_BLOCK
    assert softcap_split.levels_for(block) == 0
    assert softcap_split.levels_for(2 * block) == 1
    assert softcap_split.levels_for(8 * block) == 3
    assert softcap_split.levels_for(64 * block) == softcap_split.MAX_LEVELS
    assert softcap_split.levels_for(8 * block + 2) == 1  # 2 divides it, 4 does not


def test_only_whole_causal_calls_split():
    s = 8 * softcap_split.MIN_BLOCK
    causal = ScoreOptions(attn_scale=1.0, causal=Causal.TOP_LEFT)
    assert softcap_split.splits(causal, s, s, more_terms=False)
    assert softcap_split.splits(ScoreOptions(attn_scale=1.0, causal=Causal.BOTTOM_RIGHT, sliding_window=s), s, s, False)
    refused = [
        (causal, s, s, True),  # a bias or sinks
        (causal, s, 2 * s, False),  # more keys than queries
        (causal, softcap_split.MIN_BLOCK, softcap_split.MIN_BLOCK, False),  # too short
        (ScoreOptions(attn_scale=1.0), s, s, False),  # not causal
        (ScoreOptions(attn_scale=1.0, causal=Causal.TOP_LEFT, sliding_window=s - 1), s, s, False),
        (ScoreOptions(attn_scale=1.0, causal=Causal.TOP_LEFT, dropout_p=0.1), s, s, False),
    ]
    for options, seq_q, seq_kv, more in refused:
        assert not softcap_split.splits(options, seq_q, seq_kv, more)


def test_a_call_on_the_cpu_runs_whole():
    s = 8 * softcap_split.MIN_BLOCK
    q = torch.empty(1, 1, s, 8)
    causal = ScoreOptions(attn_scale=1.0, causal=Causal.TOP_LEFT)
    assert softcap_split.causal_split(CAP, causal, q, q, None, None) is None


def test_each_pieces_stats_are_packed_as_cudnn_before_9_26_reads_them():
    """cuDNN < 9.26 takes a backward's stats only as a packed [B, H, S, 1] tensor; a level of one
    block per batch entry once handed it a strided view of the whole call's stats."""
    for batch in (1, 2):
        stats = torch.randn(batch, 4, 64, 1)
        for piece in softcap_split.split_of(CAP, 1.0, 64, 3).pieces:
            rows = softcap_split._stats_blocks(stats, piece)
            assert rows.is_contiguous() and rows.shape == (batch * piece.count, 4, piece.rows, 1)
            first = stats[0, :, piece.q_start : piece.q_start + piece.rows]
            assert torch.equal(rows[0], first)
