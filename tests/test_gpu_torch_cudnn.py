"""Training calls of ``cudnn_attn.sdpa`` that torch's cuDNN op serves run through it (a C++ autograd
node), those it would get wrong or that need our plans keep our path; either way the output and
the gradients match a float64 oracle on fresh random inputs."""

import pytest
import torch

import cudnn_attn
from cudnn_attn.functional import eager

gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def _check(b, h, sq, skv, d, dtype, causal, **kwargs):
    g = torch.Generator(device="cuda").manual_seed(sq * 31 + skv)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g) for n in (sq, skv, skv))
    d_o = torch.randn(b, h, sq, d, device="cuda", dtype=dtype, generator=g)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cudnn_attn.sdpa(*leaves, is_causal=causal, **kwargs)
    grads = torch.autograd.grad(out, leaves, d_o)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=causal, **kwargs)
    want_grads = torch.autograd.grad(want, ref, d_o.double())
    for name, x, y in zip(("out", "dq", "dk", "dv"), (out, *grads), (want, *want_grads)):
        assert torch.isfinite(x).all(), name
        assert _rel(x, y) < 2e-2, (name, _rel(x, y))
    return type(out.grad_fn).__name__


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_plain_training_calls_take_torchs_cudnn_op(dtype, causal):
    eager.clear()
    node = _check(2, 4, 256, 256, 64, dtype, causal)
    assert "Cudnn" in node, node


@gpu
@needs_gpu
@pytest.mark.parametrize(
    "case",
    [
        dict(sq=192, skv=192, causal=False),  # S_kv % 128 == 64: cuDNN's NaN dQ, masked around on our path
        dict(sq=1, skv=256, causal=False),  # S_q = 1: cuDNN's NaN dK/dV
        dict(sq=128, skv=256, causal=True),  # causal with L != S: alignment is ours to keep
    ],
    ids=["skv-mod-128-is-64", "sq-1", "causal-l-ne-s"],
)
def test_calls_torchs_op_would_get_wrong_keep_our_path(case):
    eager.clear()
    node = _check(2, 4, case["sq"], case["skv"], 64, torch.bfloat16, case["causal"])
    assert "Cudnn" not in node, node


@gpu
@needs_gpu
def test_autotuning_keeps_our_plans():
    eager.clear()
    cudnn_attn.set_autotune(True)
    try:
        node = _check(1, 2, 256, 256, 64, torch.bfloat16, True)
    finally:
        cudnn_attn.set_autotune(None)
        eager.clear()
    assert "Cudnn" not in node, node
