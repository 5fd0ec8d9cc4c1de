"""A sink folded into, or its gradient derived from, a result computed without it
(``core/sink_fold.py``): packed rows' dSink against the dense formula sequence by sequence,
and against autograd through a softmax with the sink's column."""

from __future__ import annotations

import torch

from cudnn_attn.core.sink_fold import packed_sink_gradient, sink_gradient

H, D = 3, 8


def _packed(lengths, max_q, gen):
    """O, dO ``[T, H, D]`` of packed rows (two rows past the last sequence), stats ``[B, H, max_q, 1]``
    (padded positions NaN: never read), sequence starts."""
    tokens = sum(lengths) + 2
    o, d_o = (torch.randn(tokens, H, D, generator=gen, dtype=torch.float64) for _ in range(2))
    stats = torch.full((len(lengths), H, max_q, 1), float("nan"), dtype=torch.float64)
    for b, n in enumerate(lengths):
        stats[b, :, :n] = torch.randn(H, n, 1, generator=gen, dtype=torch.float64) * 2
    starts = torch.tensor([0, *lengths]).cumsum(0)
    return o, d_o, stats, starts


def test_the_packed_gradient_is_the_dense_one_summed_over_sequences():
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 0, 7, 1]  # an empty sequence among them
    o, d_o, stats, starts = _packed(lengths, 8, gen)
    sink = torch.randn(1, H, 1, 1, generator=gen, dtype=torch.float64)
    got = packed_sink_gradient(o, d_o, stats, sink, starts)
    want = torch.zeros(1, H, 1, 1, dtype=torch.float64)
    for b, n in enumerate(lengths):
        if n:
            rows = slice(int(starts[b]), int(starts[b]) + n)
            dense = [t[rows].transpose(0, 1).unsqueeze(0) for t in (o, d_o)]  # [1, H, n, D]
            want += sink_gradient(*dense, stats[b : b + 1, :, :n], sink)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_the_gradient_is_autograds_through_the_sinks_column():
    """One sequence: softmax over [scores, sink], O = P V; dSink by autograd equals the formula
    given O, dO and the sink-inclusive LSE."""
    gen = torch.Generator().manual_seed(1)
    n = 6
    q, k, v, d_o = (torch.randn(n, H, D, generator=gen, dtype=torch.float64) for _ in range(4))
    sink = torch.randn(H, generator=gen, dtype=torch.float64).requires_grad_()
    scores = torch.einsum("qhd,khd->hqk", q, k) / D**0.5
    full = torch.cat([scores, sink.view(H, 1, 1).expand(H, n, 1)], -1)
    p = torch.softmax(full, -1)[..., :n]
    o = torch.einsum("hqk,khd->qhd", p, v)
    (o * d_o).sum().backward()
    lse = torch.logsumexp(full, -1)  # [H, n]
    stats = lse.view(1, H, n, 1)
    got = packed_sink_gradient(o.detach(), d_o, stats, sink.detach().view(1, H, 1, 1), torch.tensor([0, n]))
    assert torch.allclose(got.view(H), sink.grad, rtol=1e-10, atol=1e-12)
