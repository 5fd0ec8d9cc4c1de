"""torch's conventions on a GPU: CausalBias objects, autocast, float32 (drop-in on torch's kernel,
Graph API on cuDNN's composite float32 path) and what that path lacks, refused before it runs."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import poisoned, rel_err
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import cudnn_attn

pytestmark = pytest.mark.gpu
F = torch.nn.functional.scaled_dot_product_attention


def _qkv(b, h, l, s, d, dtype, h_kv=None, grad=False, seed=0):  # noqa: E741
    gen = torch.Generator().manual_seed(seed)
    shapes = ((b, h, l, d), (b, h_kv or h, s, d), (b, h_kv or h, s, d))
    return tuple(torch.randn(*x, generator=gen).to("cuda", dtype).requires_grad_(grad) for x in shapes)


@pytest.mark.parametrize("make", [causal_lower_right, causal_upper_left], ids=["lower_right", "upper_left"])
@pytest.mark.parametrize("l,s", [(64, 200), (128, 128)])
def test_causal_bias_on_cudnn_matches_torch(make, l, s):  # noqa: E741
    q, k, v = _qkv(2, 4, l, s, 64, torch.bfloat16, grad=True)
    ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out = cudnn_attn.sdpa(q, k, v, attn_mask=make(l, s))
    expected = F(*ref, attn_mask=make(l, s))
    assert rel_err(out, expected) < 1.6e-2
    d_out = torch.randn_like(expected)
    for g, e in zip(torch.autograd.grad(out, (q, k, v), d_out.bfloat16()), torch.autograd.grad(expected, ref, d_out)):
        assert rel_err(g, e) < 3e-2


def test_autocast_on_a_gpu_attends_in_its_dtype():
    q, k, v = _qkv(2, 4, 128, 128, 64, torch.float32)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = cudnn_attn.sdpa(q, k, v, is_causal=True)
        expected = F(q, k, v, is_causal=True)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert rel_err(out, expected) < 1.6e-2


@pytest.mark.parametrize("grad", [False, True])
def test_float32_drop_in_runs_torch_kernel_and_says_why(grad, caplog):
    q, k, v = _qkv(2, 4, 256, 256, 64, torch.float32, grad=grad)
    with caplog.at_level(logging.INFO, logger="cudnn_attn"):
        out = cudnn_attn.sdpa(q, k, v, is_causal=True)
    assert torch.equal(out, F(q, k, v, is_causal=True))  # the same kernel, to the bit
    if grad:
        out.sum().backward()
        assert q.grad is not None and q.grad.dtype == torch.float32


def test_float32_layer_trains_on_a_gpu():
    layer = cudnn_attn.nn.Attention(128, 4, num_kv_heads=2, causal=True, device="cuda")
    x = torch.randn(2, 64, 128, device="cuda")
    layer(x).square().mean().backward()
    assert layer.qkv.weight.grad is not None and torch.isfinite(layer.qkv.weight.grad).all()


@pytest.mark.parametrize(
    "h_kv,l,s,d,options",
    [
        (4, 128, 128, 64, dict(use_causal_mask=True)),
        (4, 128, 128, 256, {}),  # d_qk 256, d_v 128
        (2, 128, 200, 128, dict(use_causal_mask_bottom_right=True)),
        (4, 100, 100, 192, {}),  # d_qk 192, d_v 128
        (2, 2, 300, 128, {}),  # GQA with two query rows: right where one is not
        (1, 64, 64, 64, dict(sliding_window_length=16, use_causal_mask=True)),
        (4, 1, 300, 128, {}),  # decode without GQA
    ],
)
def test_float32_graph_runs_on_cudnn_and_matches_the_reference(h_kv, l, s, d, options):  # noqa: E741
    q, k, v = _qkv(2, 4, l, s, d, torch.float32, h_kv=h_kv)
    d_v = min(d, 128)
    v = v[..., :d_v].contiguous()
    with cudnn_attn.Graph(backend="reference") as ref:
        ref.sdpa(q.cpu(), k.cpu(), v.cpu(), generate_stats=True, **options)
    expected = ref(q.cpu(), k.cpu(), v.cpu())
    with cudnn_attn.Graph() as g:
        g.sdpa(q, k, v, generate_stats=True, **options)
    assert g.nodes[0].backend == "cudnn"
    out = g(q, k, v, out=tuple(poisoned(h) for h in g.outputs))
    torch.cuda.synchronize()
    assert rel_err(out[0], expected[0]) < 1e-5 and rel_err(out[1], expected[1]) < 1e-5


@pytest.mark.parametrize(
    "h_kv,l,d,options,reason",
    [
        (4, 128, 256, {}, "head_dim d_v=256 in float32"),
        (4, 128, 160, {}, "head_dim d_v=160 in float32"),
        (2, 1, 128, {}, "decode"),
        (4, 128, 64, dict(dropout=0.1, dropout_seed=1, dropout_offset=0), "dropout in float32"),
    ],
)
def test_float32_graph_refuses_what_cudnn_lacks_or_gets_wrong(h_kv, l, d, options, reason):  # noqa: E741
    q, k, v = _qkv(2, 4, l, 256, d, torch.float32, h_kv=h_kv)
    with pytest.raises(cudnn_attn.UnsupportedError, match=reason):
        with cudnn_attn.Graph() as g:
            g.sdpa(q, k, v, **options)


def test_float32_backward_graph_is_refused_naming_what_cudnn_lacks():
    q, k, v = _qkv(1, 4, 128, 128, 64, torch.float32)
    stats = torch.randn(1, 4, 128, 1, device="cuda")
    with pytest.raises(cudnn_attn.UnsupportedError, match="no float32 backward"):
        with cudnn_attn.Graph() as g:
            g.sdpa_backward(q, k, v, q, q, stats)
