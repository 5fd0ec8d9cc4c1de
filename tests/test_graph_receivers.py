"""Outputs the caller receives in a tensor of its own (``dSink_token=t``, ``dBias=t``,
``rng_dump=t``) in the library's ``Graph``: every run writes ``t`` in place, and the run
returns what the recording returned (``(dQ, dK, dV)``), as the method's docstring promises."""

from __future__ import annotations

import contextlib
import gc
import weakref

import numpy as np
import pytest
import torch
from conftest import rel_err

import cudnn_attn

B, H, S, D = 2, 3, 8, 16
SCALE = 0.3


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _forward(seed: int):
    q, k, v = (randn(B, H, S, D, seed=seed + i) for i in range(3))
    sink = randn(1, H, 1, 1, seed=seed + 3)
    with cudnn_attn.Graph() as g:
        g.sdpa(q, k, v, sink_token=sink, attn_scale=SCALE, generate_stats=True, use_causal_mask=True)
    o, stats = g(q, k, v, sink)
    return q, k, v, sink, o, stats


def _sink_gradient(q, k, v, sink, d_o):
    """The float64 oracle: the sink one more score column that weighs no value."""
    leaf = sink.double().requires_grad_()
    s = (q.double() @ k.double().transpose(-1, -2)) * SCALE
    s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    p = torch.softmax(torch.cat([s, leaf.expand(B, H, S, 1)], -1), -1)[..., :-1]
    (grad,) = torch.autograd.grad(p @ v.double(), leaf, d_o.double())
    return grad


def test_a_sink_gradient_tensor_is_written_by_every_run_and_not_returned():
    q, k, v, sink, o, stats = _forward(seed=0)
    d_o = randn(B, H, S, D, seed=9)
    d_sink = torch.full((1, H, 1, 1), float("nan"))
    with cudnn_attn.Graph() as g:
        recorded = g.sdpa_backward(
            q, k, v, o, d_o, stats, sink_token=sink, dSink_token=d_sink, attn_scale=SCALE, use_causal_mask=True
        )
    d_q, d_k, d_v = g(q, k, v, o, d_o, stats, sink)
    assert len(recorded) == 3 and d_q.shape == q.shape and d_v.shape == v.shape
    assert rel_err(d_sink, _sink_gradient(q, k, v, sink, d_o)) < 1e-5
    # A second run on other inputs writes the same tensor again.
    q2, k2, v2, sink2, o2, stats2 = _forward(seed=20)
    d_sink.fill_(float("nan"))
    g(q2, k2, v2, o2, d_o, stats2, sink2)
    assert rel_err(d_sink, _sink_gradient(q2, k2, v2, sink2, d_o)) < 1e-5


def _biased_forward(seed: int):
    q, k, v = (randn(B, H, S, D, seed=seed + i) for i in range(3))
    bias = randn(1, H, S, S, seed=seed + 3)
    with cudnn_attn.Graph() as fwd:
        fwd.sdpa(q, k, v, attn_bias=bias, attn_scale=SCALE, generate_stats=True)
    return (q, k, v, bias, *fwd(q, k, v, bias))


def test_a_bias_gradient_tensor_and_an_out_mapping_that_redirects_it():
    q, k, v, bias, o, stats = _biased_forward(seed=30)
    d_o = randn(B, H, S, D, seed=34)
    d_bias = torch.full_like(bias, float("nan"))
    with cudnn_attn.Graph() as bwd:
        bwd.sdpa_backward(q, k, v, o, d_o, stats, attn_bias=bias, dBias=d_bias, attn_scale=SCALE)
    leaves = [t.double().requires_grad_() for t in (q, k, v, bias)]
    p = torch.softmax(leaves[0] @ leaves[1].transpose(-1, -2) * SCALE + leaves[3], -1)
    want = torch.autograd.grad(p @ leaves[2], leaves, d_o.double())
    got = bwd(q, k, v, o, d_o, stats, bias)
    assert len(got) == 3 and all(rel_err(g, w) < 1e-5 for g, w in zip(got, want))
    assert rel_err(d_bias, want[3]) < 1e-5
    elsewhere = torch.full_like(bias, float("nan"))
    d_bias.fill_(7.0)
    bwd(q, k, v, o, d_o, stats, bias, out={"dBias": elsewhere})
    assert rel_err(elsewhere, want[3]) < 1e-5 and torch.all(d_bias == 7.0)


def test_a_dropout_keep_mask_tensor_receives_the_mask_the_output_used():
    q, k, v = (randn(B, H, S, D, seed=40 + i) for i in range(3))
    p_drop = 0.25
    seed, offset = torch.tensor([5], dtype=torch.int64), torch.tensor([0], dtype=torch.int64)
    dump = torch.full((B, H, S, S), float("nan"))
    with cudnn_attn.Graph() as g:
        g.sdpa(q, k, v, attn_scale=SCALE, dropout=(p_drop, seed, offset), rng_dump=dump)
    o = g(q, k, v, seed, offset)
    assert isinstance(o, torch.Tensor) and set(dump.unique().tolist()) == {0.0, 1.0}
    attention = torch.softmax(q.double() @ k.double().transpose(-1, -2) * SCALE, -1)
    assert rel_err(o, (attention * dump.double() / (1 - p_drop)) @ v.double()) < 1e-5


def test_a_frontend_pack_need_not_name_a_tensor_the_recording_already_holds():
    q, k, v, sink, o, stats = _forward(seed=50)
    d_o = randn(B, H, S, D, seed=59)
    d_sink = torch.full((1, H, 1, 1), float("nan"))
    with cudnn_attn.Graph() as g:
        d_q, d_k, d_v = g.sdpa_backward(
            q, k, v, o, d_o, stats, sink_token=sink, dSink_token=d_sink, attn_scale=SCALE, use_causal_mask=True
        )
    grads = [torch.empty_like(t) for t in (q, k, v)]
    names = dict(zip((h.name for h in g.inputs), (q, k, v, o, d_o, stats, sink)))
    g.execute({**names, d_q: grads[0], d_k: grads[1], d_v: grads[2]})
    assert rel_err(d_sink, _sink_gradient(q, k, v, sink, d_o)) < 1e-5


def test_receivers_of_two_graphs_recorded_alike_are_each_their_own():
    q, k, v, sink, o, stats = _forward(seed=60)
    d_o = randn(B, H, S, D, seed=69)
    receivers = [torch.full((1, H, 1, 1), float("nan")) for _ in range(2)]
    graphs = []
    for d_sink in receivers:
        with cudnn_attn.Graph() as g:
            g.sdpa_backward(
                q, k, v, o, d_o, stats, sink_token=sink, dSink_token=d_sink, attn_scale=SCALE, use_causal_mask=True
            )
        graphs.append(g)
    graphs[1](q, k, v, o, d_o, stats, sink)
    assert torch.isnan(receivers[0]).all() and not torch.isnan(receivers[1]).any()
    graphs[0](q, k, v, o, d_o, stats, sink)
    assert torch.equal(receivers[0], receivers[1])


@pytest.mark.parametrize(
    "receiver, message",
    [
        (torch.zeros(1, H, 1, 1, requires_grad=True), "dSink_token: requires grad"),
        (torch.zeros(1, H, 1, 1, device="meta"), "dSink_token: on meta"),
        ("read-only", "dSink_token: a read-only array"),
    ],
    ids=["requires-grad", "other-device", "read-only"],
)
def test_a_receiver_that_cannot_be_written_is_refused_by_name(receiver, message):
    q, k, v, sink, o, stats = _forward(seed=70)
    if isinstance(receiver, str):
        array = np.zeros((1, H, 1, 1), dtype=np.float32)
        array.setflags(write=False)
        receiver = array
    with pytest.raises(cudnn_attn.ValidationError, match=message):
        with cudnn_attn.Graph() as g:
            g.sdpa_backward(q, k, v, o, o, stats, sink_token=sink, dSink_token=receiver, attn_scale=SCALE)


def test_a_receiver_that_requires_grad_is_refused_after_a_build_of_the_same_geometry():
    """The refusal was skipped where the recording adopted an earlier graph's build."""
    q, k, v, sink, o, stats = _forward(seed=80)
    for receiver in (torch.zeros(1, H, 1, 1), torch.zeros(1, H, 1, 1, requires_grad=True)):
        build = pytest.raises(cudnn_attn.ValidationError) if receiver.requires_grad else contextlib.nullcontext()
        with build:
            with cudnn_attn.Graph() as g:
                g.sdpa_backward(q, k, v, o, o, stats, sink_token=sink, dSink_token=receiver, attn_scale=SCALE)


def test_a_graph_gone_leaves_no_receiver_alive():
    """A kept build held the first graph's receiving tensor (a [B, H, S, S] dBias on the GPU)."""
    q, k, v, bias, o, stats = _biased_forward(seed=90)

    def graph_and_its_receiver():
        d_bias = torch.zeros_like(bias)
        with cudnn_attn.Graph() as g:
            g.sdpa_backward(q, k, v, o, o, stats, attn_bias=bias, dBias=d_bias, attn_scale=SCALE)
        return g, weakref.ref(d_bias)

    g, receiver = graph_and_its_receiver()
    del g
    gc.collect()
    assert receiver() is None


def test_a_declared_graph_returns_a_receiver_among_its_outputs():
    """A declared graph whose node wrote a receiver raised a bare KeyError (its outputs shifted)."""
    q, k, v, sink, o, stats = _forward(seed=100)
    d_o = randn(B, H, S, D, seed=109)
    d_sink = torch.full((1, H, 1, 1), float("nan"))
    for outputs in (["dQ", "dK", "dV"], ["dQ", "dK", "dV", "dSink_token"]):
        with cudnn_attn.Graph(inputs=[q, k, v, o, d_o, stats, sink], outputs=outputs) as g:
            g.sdpa_backward(
                q, k, v, o, d_o, stats, sink_token=sink, dSink_token=d_sink, attn_scale=SCALE, use_causal_mask=True
            )
        got = g(q, k, v, o, d_o, stats, sink)
        assert [t.shape for t in got[:3]] == [q.shape] * 3
        if len(outputs) == 4:
            assert got[3] is d_sink
    assert rel_err(d_sink, _sink_gradient(q, k, v, sink, d_o)) < 1e-5
