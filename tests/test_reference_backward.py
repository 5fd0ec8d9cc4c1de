"""The reference backward (dQ, dK, dV, dBias) against autograd through independent float64 code."""

from __future__ import annotations

import math

import oracle
import pytest
import torch
from conftest import poisoned, randn, rel_err, split_options

import cudnn_attn

GRAD_TOL = 2e-3  # fp16 outputs of float32 math vs float64 autograd

CASES = {
    # id: (b, h_q, h_kv, s_q, s_kv, d_qk, d_v, options)
    "plain": (2, 4, 4, 16, 16, 32, 32, {}),
    "rect-dv": (1, 2, 2, 12, 20, 32, 16, {}),
    "gqa": (2, 4, 2, 16, 16, 32, 32, {}),
    "mqa-causal": (2, 4, 1, 16, 16, 32, 32, {"use_causal_mask": True}),
    "causal-br": (2, 2, 2, 10, 16, 32, 32, {"use_causal_mask_bottom_right": True}),
    "window": (2, 2, 2, 16, 16, 32, 32, {"use_causal_mask": True, "sliding_window_length": 4}),
    "padding": (3, 2, 2, 16, 16, 32, 32, {"padding": ([16, 7, 3], [16, 9, 12]), "use_causal_mask": True}),
    "bias": (2, 2, 2, 16, 16, 32, 32, {"bias": (1, 2, 16, 16)}),
    "alibi": (1, 4, 4, 16, 16, 32, 32, {"use_causal_mask": True, "use_alibi_mask": True}),
}


def _setup(case, seed=0):
    b, h_q, h_kv, s_q, s_kv, d_qk, d_v, options = CASES[case]
    options = dict(options)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        randn(b, s_q, h_q, d_qk, dtype=torch.float16, generator=gen).transpose(1, 2),
        randn(b, s_kv, h_kv, d_qk, dtype=torch.float16, generator=gen).transpose(1, 2),
        randn(b, s_kv, h_kv, d_v, dtype=torch.float16, generator=gen).transpose(1, 2),
    )
    kwargs, oracle_kwargs = split_options(options, torch.float16, gen)
    allowed_kwargs = {k: v for k, v in oracle_kwargs.items() if k in ("seq_q", "seq_kv")}
    causal = (
        "bottom_right"
        if options.get("use_causal_mask_bottom_right")
        else ("top_left" if options.get("use_causal_mask") else None)
    )
    allowed = oracle.allowed_matrix(
        b, s_q, s_kv, causal=causal, window=options.get("sliding_window_length"), **allowed_kwargs
    )
    d_o = randn(b, h_q, s_q, d_v, dtype=torch.float16, generator=gen)
    return q, k, v, d_o, kwargs, allowed


def _expected_grads(q, k, v, d_o, kwargs, allowed):
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    bias = kwargs.get("attn_bias")
    bias64 = bias.detach().double().requires_grad_() if bias is not None else None
    total_bias = bias64
    if kwargs.get("use_alibi_mask"):
        h, s_q, s_kv = q.shape[1], q.shape[2], k.shape[2]
        alibi = (
            oracle.alibi_slopes(h).view(1, h, 1, 1)
            * (torch.arange(s_kv).view(1, -1) - torch.arange(s_q).view(-1, 1)).double()
        )
        total_bias = alibi if total_bias is None else total_bias + alibi
    scale = kwargs.get("attn_scale", 1 / math.sqrt(q.shape[-1]))
    out = oracle.attention_autograd(*leaves, scale=scale, allowed=allowed, bias=total_bias)
    out.backward(d_o.double())
    return out.detach(), [x.grad for x in leaves], (bias64.grad if bias64 is not None else None)


@pytest.mark.parametrize("case", list(CASES))
def test_backward_matches_autograd(case):
    q, k, v, d_o, kwargs, allowed = _setup(case)
    with cudnn_attn.Graph(backend="reference") as fwd:
        fwd.sdpa(q, k, v, generate_stats=True, **kwargs)
    extra = [kwargs[n] for n in ("attn_bias", "seq_len_q", "seq_len_kv") if n in kwargs]
    o, stats = fwd(q, k, v, *extra)
    bias_grad = "attn_bias" in kwargs
    with cudnn_attn.Graph(backend="reference") as bwd:
        grads = bwd.sdpa_backward(q, k, v, o, d_o, stats, bias_grad=bias_grad, **kwargs)
    out = tuple(poisoned(h) for h in grads)
    actual = bwd(q, k, v, o, d_o, stats, *extra, out=out)
    expected_o, expected, expected_dbias = _expected_grads(q, k, v, d_o, kwargs, allowed)
    assert rel_err(o, expected_o) < GRAD_TOL
    for name, a, e in zip(("dQ", "dK", "dV"), actual, expected):
        source = {"dQ": q, "dK": k, "dV": v}[name]
        assert a.shape == e.shape
        assert [st for st, n in zip(a.stride(), a.shape) if n > 1] == [
            st for st, n in zip(source.stride(), a.shape) if n > 1
        ]
        assert rel_err(a, e) < GRAD_TOL, name
    if bias_grad:
        assert rel_err(actual[3], expected_dbias) < GRAD_TOL


def test_backward_matches_torch_sdpa_autograd():
    gen = torch.Generator().manual_seed(7)
    q, k, v = (randn(2, 4, 24, 32, dtype=torch.float16, generator=gen) for _ in range(3))
    d_o = randn(2, 4, 24, 32, dtype=torch.float16, generator=gen)
    with cudnn_attn.Graph(backend="reference") as g:
        o, stats = g.sdpa(q, k, v, use_causal_mask=True, generate_stats=True)
        g.sdpa_backward(q, k, v, o, d_o, stats, use_causal_mask=True)
    # One graph: the backward reads the forward's O and Stats through their handles.
    assert [h.name for h in g.inputs] == ["q", "k", "v", "dO"]
    o_val, stats_val, dq, dk, dv = g(q, k, v, d_o)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
    ref.backward(d_o.double())
    assert rel_err(o_val, ref) < GRAD_TOL
    for a, leaf in zip((dq, dk, dv), leaves):
        assert rel_err(a, leaf.grad) < GRAD_TOL


def test_bias_gradient_reduces_over_broadcast_dims():
    q, k, v, d_o, kwargs, allowed = _setup("bias", seed=3)
    bias = randn(2, 1, 1, 16, dtype=torch.float16)
    kwargs["attn_bias"] = bias
    with cudnn_attn.Graph(backend="reference") as g:
        o, stats = g.sdpa(q, k, v, attn_bias=bias, generate_stats=True)
        *_, d_bias = g.sdpa_backward(q, k, v, o, d_o, stats, attn_bias=bias, bias_grad=True)
    assert d_bias.shape == (2, 1, 1, 16)
    *_, d_bias_value = g(q, k, v, bias, d_o)
    _, _, expected = _expected_grads(q, k, v, d_o, kwargs, allowed)
    assert rel_err(d_bias_value, expected) < GRAD_TOL
