"""Known cuDNN bugs, on the GPU: each either worked around (the result matches the reference,
no NaN) or refused up front. docs/gpu_support.md keeps the table."""

from __future__ import annotations

import pytest
import torch
from conftest import poisoned, rel_err

import cudnn_attn

pytestmark = pytest.mark.gpu

TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def randn(*shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device="cuda", dtype=dtype)


def forward_and_backward(backend, q, k, v, bias, d_o):
    with cudnn_attn.Graph(backend=backend, cache=cudnn_attn.PlanCache()) as g:
        o, stats = g.sdpa(q, k, v, attn_bias=bias, generate_stats=True)
        g.sdpa_backward(q, k, v, o, d_o, stats, attn_bias=bias)
    outs = tuple(poisoned(h) for h in g.outputs)
    result = g(q, k, v, bias, d_o, out=outs)
    torch.cuda.synchronize()
    return result


@pytest.mark.parametrize("dtype, low", [(torch.bfloat16, -200.0), (torch.float16, -30.0)], ids=["bf16", "fp16"])
@pytest.mark.parametrize("s_q, s_kv", [(64, 64), (192, 192), (320, 320), (576, 576), (100, 192), (1, 192), (1, 128)])
def test_rows_with_a_low_log_sum_exp_give_no_nan_gradients(dtype, low, s_q, s_kv):
    """cuDNN 9.19: NaN dQ at S_kv % 128 == 64 and NaN dK/dV at S_q = 1 when a row's
    log-sum-exp is low (torch issue #196678); the backward is lowered with full-length padding."""
    b, h, d = 2, 4, 128
    q, k, v = (randn(b, h, s, d, dtype=dtype, seed=i) for i, s in enumerate((s_q, s_kv, s_kv)))
    bias = torch.zeros(1, 1, s_q, s_kv, dtype=dtype, device="cuda")
    bias[..., min(5, s_q - 1), :] = low  # one row far below every other
    d_o = randn(b, h, s_q, d, dtype=dtype, seed=3)
    got = forward_and_backward("cudnn", q, k, v, bias, d_o)
    expected = forward_and_backward("reference", q, k, v, bias, d_o)
    names = ("O", "Stats", "dQ", "dK", "dV")
    for name, a, e in zip(names, got, expected):
        assert torch.isfinite(a).all(), f"{name} has NaN/inf"
        tol = 1e-3 if name == "Stats" else 2 * TOL[dtype]
        assert rel_err(a, e) < tol, name


def test_the_functional_backward_at_s_192_with_a_low_row_is_finite():
    q, k, v = (randn(1, 2, 192, 64, dtype=torch.bfloat16, seed=i).requires_grad_() for i in range(3))
    mask = torch.zeros(1, 1, 192, 192, dtype=torch.bfloat16, device="cuda")
    mask[..., 7, :] = -200.0
    cudnn_attn.sdpa(q, k, v, attn_mask=mask).float().sum().backward()
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*ref, attn_mask=mask.double()).sum().backward()
    for mine, theirs in zip((q, k, v), ref):
        assert rel_err(mine.grad, theirs.grad) < 3e-2
