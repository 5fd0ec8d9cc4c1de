"""Dropout: the reference's own RNG is seeded, repeatable, and shared by forward and backward."""

from __future__ import annotations

import oracle
import torch
from conftest import randn, rel_err

import cudnn_attn
from cudnn_attn.ops.reference import dropout


def _graph(q, k, v, p, seed, offset):
    with cudnn_attn.Graph(backend="reference") as g:
        g.sdpa(q, k, v, dropout=p, dropout_seed=seed, dropout_offset=offset, generate_stats=True)
    return g


def test_keep_mask_is_repeatable_and_has_the_right_rate():
    a = dropout.keep_mask(7, 3, (4, 8, 64, 64), 0.25, "cpu")
    assert torch.equal(a, dropout.keep_mask(7, 3, (4, 8, 64, 64), 0.25, "cpu"))
    assert not torch.equal(a, dropout.keep_mask(7, 4, (4, 8, 64, 64), 0.25, "cpu"))
    assert not torch.equal(a, dropout.keep_mask(8, 3, (4, 8, 64, 64), 0.25, "cpu"))
    assert abs(a.float().mean().item() - 0.75) < 0.01


def test_forward_uses_the_seeded_mask():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (randn(2, 2, 16, 32, dtype=torch.float16, generator=gen) for _ in range(3))
    o1, _ = _graph(q, k, v, 0.2, 123, 0)(q, k, v)
    o2, _ = _graph(q, k, v, 0.2, 123, 0)(q, k, v)
    o3, _ = _graph(q, k, v, 0.2, 124, 0)(q, k, v)
    assert torch.equal(o1, o2) and not torch.equal(o1, o3)
    keep = dropout.keep_mask(123, 0, (2, 2, 16, 16), 0.2, "cpu")
    expected, _ = oracle.attention(q, k, v, scale=32**-0.5, keep=keep, p=0.2)
    assert rel_err(o1, expected) < 1e-3


def test_seed_and_offset_as_tensors_and_the_frontend_tuple():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (randn(1, 2, 8, 16, dtype=torch.float16, generator=gen) for _ in range(3))
    seed, offset = torch.tensor([99], dtype=torch.int64), torch.tensor([5], dtype=torch.int64)
    with cudnn_attn.Graph(backend="reference") as g:
        g.sdpa(q, k, v, dropout=(0.3, seed, offset))
    assert [h.name for h in g.inputs] == ["q", "k", "v", "dropout_seed", "dropout_offset"]
    by_tensor = g(q, k, v, seed, offset)
    with cudnn_attn.Graph(backend="reference") as g_int:
        g_int.sdpa(q, k, v, dropout=0.3, dropout_seed=99, dropout_offset=5)
    assert torch.equal(by_tensor, g_int(q, k, v))


def test_backward_regenerates_the_forward_mask():
    gen = torch.Generator().manual_seed(4)
    q, k, v, d_o = (randn(2, 2, 16, 32, dtype=torch.float16, generator=gen) for _ in range(4))
    p, seed = 0.25, 77
    with cudnn_attn.Graph(backend="reference") as g:
        o, stats = g.sdpa(q, k, v, dropout=p, dropout_seed=seed, generate_stats=True)
        g.sdpa_backward(q, k, v, o, d_o, stats, dropout=p, dropout_seed=seed)
    _, _, dq, dk, dv = g(q, k, v, d_o)
    keep = dropout.keep_mask(seed, 0, (2, 2, 16, 16), p, "cpu")
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    oracle.attention_autograd(*leaves, scale=32**-0.5, keep=keep, p=p).backward(d_o.double())
    for actual, leaf in zip((dq, dk, dv), leaves):
        assert rel_err(actual, leaf.grad) < 2e-3
