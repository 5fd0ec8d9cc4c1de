"""Attention sinks (the frontend's ``sink_token`` / ``dSink_token``, gpt-oss's learned per-head
logits) on the reference backend, against a float64 oracle that appends the sink as one more
score column weighing no value."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import rel_err

import cudnn_attn as cudnn

B, H, H_KV, S, D = 2, 4, 2, 16, 32


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def oracle(q, k, v, sink, causal, lengths_kv=None):
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    if lengths_kv is not None:
        keys = torch.arange(s.shape[-1]).view(1, 1, 1, -1) >= torch.tensor(lengths_kv).view(-1, 1, 1, 1)
        s = s.masked_fill(keys, float("-inf"))
    with_sink = torch.cat([s, sink.expand(*s.shape[:-1], 1)], -1)
    p = torch.softmax(with_sink, -1)[..., :-1]
    return p @ v, torch.logsumexp(with_sink, -1, keepdim=True)


def _tensors(seed: int = 0):
    q = randn(B, H, S, D, seed=seed)
    k, v = randn(B, H_KV, S, D, seed=seed + 1), randn(B, H_KV, S, D, seed=seed + 2)
    return q, k, v, randn(1, H, 1, 1, seed=seed + 3) * 2


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_and_backward_with_sinks_match_the_oracle(causal):
    q, k, v, sink = _tensors()
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    want_o, want_lse = oracle(*leaves, causal)
    d_o = randn(*want_o.shape, seed=9)
    want_grads = torch.autograd.grad(want_o, leaves, d_o)
    f32 = [t.float() for t in (q, k, v, sink)]
    with cudnn.Graph() as g:
        o, stats = g.sdpa(f32[0], f32[1], f32[2], sink_token=f32[3], use_causal_mask=causal, generate_stats=True)
    out, lse = g(*f32)
    assert rel_err(out, want_o) < 1e-5 and rel_err(lse, want_lse) < 1e-5
    bwd = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    handles = [bwd.tensor_like(t) for t in (*f32[:3], out, d_o.float(), lse)]
    sink_h, d_sink_h = bwd.tensor_like(f32[3]), bwd.tensor_like(f32[3])
    grads = bwd.sdpa_backward(
        *handles, sink_token=sink_h, dSink_token=d_sink_h, use_causal_mask=causal, attn_scale=q.shape[-1] ** -0.5
    )
    for t in grads:
        t.set_output(True)
    got = [torch.full_like(t, float("nan")) for t in f32]
    pack = dict(zip(handles, (*f32[:3], out, d_o.float(), lse)))
    bwd.execute({**pack, sink_h: f32[3], d_sink_h: got[3], **dict(zip(grads, got[:3]))})
    for name, a, e in zip(("dQ", "dK", "dV", "dSink"), got, want_grads):
        assert rel_err(a, e) < 1e-5, name


def test_a_sink_keeps_a_sequence_without_keys_finite():
    q, k, v, sink = _tensors(5)
    lengths = torch.tensor([S, 0], dtype=torch.int32)
    f32 = [t.float() for t in (q, k, v, sink)]
    with cudnn.Graph() as g:
        g.sdpa(
            *f32[:3],
            sink_token=f32[3],
            use_padding_mask=True,
            seq_len_q=lengths,
            seq_len_kv=lengths,
            generate_stats=True,
        )
    out, lse = g(*f32[:3], lengths, f32[3])  # positional: q, k, v, the lengths, then the sink
    want_o, want_lse = oracle(q, k, v, sink, False, lengths_kv=[S, 0])
    assert rel_err(out[:1], want_o[:1]) < 1e-5 and rel_err(lse[:1], want_lse[:1]) < 1e-5
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # no key: the sink takes all the weight


def test_sink_shapes_are_checked_by_name():
    q, k, v, sink = (t.float() for t in _tensors())
    with pytest.raises(cudnn.ValidationError, match=r"sink_token: .*expected float32 \[1, 4, 1, 1\]"):
        with cudnn.Graph() as g:
            g.sdpa(q, k, v, sink_token=sink[:, :2])
    g = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    handles = [g.tensor_like(t) for t in (q, k, v, q, q)]
    lse = g.tensor(dim=(B, H, S, 1), device="cpu")
    g.sdpa_backward(*handles, lse, dSink_token=g.tensor_like(sink))
    with pytest.raises(cudnn.ValidationError, match="dSink_token: given without sink_token"):
        g.build()


@pytest.mark.parametrize("shape", ["heads", "frontend"])
def test_the_torch_form_takes_sinks_and_learns_them(shape):
    q, k, v, sink = _tensors(11)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    sinks = (sink.float().reshape(H) if shape == "heads" else sink.float()).requires_grad_()
    out = cudnn.sdpa(*leaves, is_causal=True, enable_gqa=True, sinks=sinks)
    want, _ = oracle(q, k, v, sink, True)
    assert rel_err(out, want) < 1e-5
    d_out = randn(*out.shape, seed=12).float()
    got = torch.autograd.grad(out, [*leaves, sinks], d_out)
    oracle_leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    expected = torch.autograd.grad(oracle(*oracle_leaves, True)[0], oracle_leaves, d_out.double())
    for a, e in zip(got, expected):
        assert a.shape == (e.shape if a.dim() == 4 else (H,)) and rel_err(a.reshape(e.shape), e) < 1e-5


def test_the_torch_form_checks_sinks_by_name():
    q, k, v, _ = (t.float() for t in _tensors())
    with pytest.raises(cudnn.ValidationError, match=r"sinks: shape \[3\]"):
        cudnn.sdpa(q, k, v, enable_gqa=True, sinks=torch.zeros(3))


def test_varlen_takes_sinks_and_learns_them():
    lengths = [5, 11]
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    q = randn(16, H, D, seed=20).float().requires_grad_()
    k, v = (randn(16, H_KV, D, seed=21 + i).float().requires_grad_() for i in range(2))
    sinks = randn(H, seed=23).float().requires_grad_()
    out = cudnn.varlen_sdpa(q, k, v, cu, cu, 11, 11, is_causal=True, enable_gqa=True, sinks=sinks)
    d_out = randn(*out.shape, seed=24).float()
    got = torch.autograd.grad(out, (q, k, v, sinks), d_out)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    pieces = []
    for start, n in zip((0, 5), lengths):
        part = [t[start : start + n].transpose(0, 1)[None] for t in leaves[:3]]
        pieces.append(oracle(*part, leaves[3].view(1, H, 1, 1), True)[0][0].transpose(0, 1))
    want = torch.cat(pieces)
    expected = torch.autograd.grad(want, leaves, d_out.double())
    assert rel_err(out, want) < 1e-5
    assert all(rel_err(a, e) < 1e-5 for a, e in zip(got, expected))


def test_a_decode_sink_folded_in_after_the_run_matches_the_oracle():
    """cuDNN's decode kernels take no sink: the cuDNN plan runs without it and folds it in from
    the log-sum-exp (``core/sink_fold.py``). That arithmetic, on the oracle's sink-less
    result, must give the oracle's result with the sink, a sequence without keys included."""
    from cudnn_attn.core.sink_fold import add_sink

    q, k, v, sink = _tensors(11)
    q = q[:, :, :1]
    lengths = [S, 0]
    o, lse = oracle(q, k, v, torch.full_like(sink, float("-inf")), False, lengths_kv=lengths)
    want_o, want_lse = oracle(q, k, v, sink, False, lengths_kv=lengths)
    o, lse = o.nan_to_num(0.0), lse  # no key and no sink: softmax of nothing, O = 0 as cuDNN gives it
    add_sink(o, lse, sink)
    assert rel_err(o, want_o) < 1e-6 and rel_err(lse, want_lse) < 1e-6  # weights in float32


def test_a_decode_sink_lowers_to_a_sinkless_graph_with_its_stats():
    """What the cuDNN plan is built from (no GPU needed): no sink_token in the graph, a stats
    output even when the caller asked for none; a prefill (S_q > 1) keeps the sink in the graph."""
    from cudnn_attn.core.constructors import forward_problem
    from cudnn_attn.core.mask import ScoreOptions
    from cudnn_attn.core.problem import TensorSpec
    from cudnn_attn.core.roles import UID
    from cudnn_attn.ops.cudnn import capabilities, folded_sink, lowering

    def problem(s_q: int):
        q = TensorSpec.contiguous((B, H, s_q, D), torch.bfloat16, "cuda:0")
        kv = TensorSpec.contiguous((B, H_KV, 64, D), torch.bfloat16, "cuda:0")
        sink = TensorSpec.contiguous((1, H, 1, 1), torch.float32, "cuda:0")
        return forward_problem(q, kv, kv, ScoreOptions(attn_scale=D**-0.5), stats=False, sink_token=sink)

    for s_q, after in ((1, True), (4, False)):
        p = problem(s_q)
        assert folded_sink.applies(p) is after
        tensors = json.loads(repr(lowering.lower(p).graph))["tensors"]
        uids = {t["uid"] for t in tensors.values() if not t["is_virtual"]}
        assert (UID["sink_token"] in uids) is not after and (UID["stats"] in uids) is after, tensors
        assert capabilities.unsupported_reasons(p, capabilities.Platform("H100", (9, 0), 91900, "1.32.0")) == []


@pytest.mark.parametrize("form", ["dense", "nested"])
def test_float64_sinks_keep_float64_precision(form):
    """float64 queries and sinks: the output and every gradient, the sinks' included, as plain
    torch float64 math gives them (the sinks were rounded to float32: 1e-8 off)."""
    gen = torch.Generator().manual_seed(64)
    q, k, v = (torch.randn(2, 4, 37, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(4, generator=gen, dtype=torch.float64) * 2 + 0.123456789
    lengths = (20, 37)

    def plain(q, k, v, sinks):  # one sequence [1, H, S, D]
        scores = q @ k.transpose(-1, -2) / 4
        column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        return torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1] @ v

    def leaves():
        return [t.clone().requires_grad_() for t in (q, k, v, sinks)]

    ours, theirs = leaves(), leaves()
    if form == "nested":
        nest = [
            torch.nested.as_nested_tensor(
                [t[b, :, :n].transpose(0, 1) for b, n in enumerate(lengths)], layout=torch.jagged
            )
            for t in ours[:3]
        ]
        out = cudnn.sdpa(*(t.transpose(1, 2) for t in nest), sinks=ours[3])
        got = list(out.unbind())  # each [H, S_b, D]
    else:
        lengths = (37, 37)
        got = list(cudnn.sdpa(*ours[:3], sinks=ours[3]).unbind())
    want = [plain(*(t[b : b + 1, :, :n] for t in theirs[:3]), theirs[3])[0] for b, n in enumerate(lengths)]
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-13
    loss_ours = sum((g * g).sum() for g in got)
    loss_theirs = sum((w * w).sum() for w in want)
    for a, b in zip(torch.autograd.grad(loss_ours, ours), torch.autograd.grad(loss_theirs, theirs)):
        assert a.dtype == torch.float64 and rel_err(a, b) < 1e-12


def test_compiled_float64_sinks_keep_float64_precision():
    """torch.compile's path rounded float64 sinks and their gradient to float32 (1e-9 off eager)."""
    gen = torch.Generator().manual_seed(65)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(2, generator=gen, dtype=torch.float64).requires_grad_()
    eager = cudnn.sdpa(q, k, v, sinks=sinks)
    compiled = torch.compile(lambda q, k, v, s: cudnn.sdpa(q, k, v, sinks=s), fullgraph=True)(q, k, v, sinks)
    assert torch.equal(compiled, eager)
    assert torch.equal(*(torch.autograd.grad(out.sum(), sinks)[0] for out in (compiled, eager)))
