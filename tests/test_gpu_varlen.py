"""``varlen_sdpa`` on cuDNN against the reference backend on the same packed inputs (values and
gradients), and bad ``cu_seqlens`` on the GPU: clamped on the device, never out of bounds."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err

import cudnn_attn
from cudnn_attn.varlen import varlen_attention

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def _packed(lengths_q, lengths_k, h, h_kv, d, d_v, dtype, seed, extra=0):
    gen = torch.Generator().manual_seed(seed)
    t_q, t_k = sum(lengths_q) + extra, sum(lengths_k) + extra
    q, k, v = (
        torch.randn(t, heads, dim, generator=gen).to(dtype)
        for t, heads, dim in ((t_q, h, d), (t_k, h_kv, d), (t_k, h_kv, d_v))
    )
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (lengths_q, lengths_k)]
    return q, k, v, *cu


def _run(device, q, k, v, cu_q, cu_k, max_q, max_k, d_out, **options):
    leaves = [x.to(device).requires_grad_() for x in (q, k, v)]
    out = varlen_attention(*leaves, cu_q.to(device), cu_k.to(device), max_q, max_k, **options)
    out.backward(d_out.to(device))
    return out, [leaf.grad for leaf in leaves]


CASES = {
    "causal-bf16": dict(dtype=torch.bfloat16, causal="top_left"),
    "full-fp16-gqa": dict(dtype=torch.float16, h_kv=2),
    "causal-gqa-dv64": dict(dtype=torch.bfloat16, causal="top_left", h_kv=4, d_v=64),
    "window": dict(dtype=torch.bfloat16, causal="top_left", window_left=40),
    "bottom-right-cross": dict(dtype=torch.bfloat16, causal="bottom_right", cross=True),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_cudnn_matches_the_reference(case):
    spec = dict(CASES[case])
    dtype, h_kv, d_v = spec.pop("dtype"), spec.pop("h_kv", 8), spec.pop("d_v", 128)
    lengths_q = [37, 300, 1, 129, 64]  # five sequences: the batch bucket of 8 holds three empty ones
    lengths_k = [50, 300, 17, 129, 0] if spec.pop("cross", False) else lengths_q
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 8, h_kv, 128, d_v, dtype, seed=hash(case) % 1000, extra=3)
    d_out = torch.randn(q.shape[0], 8, d_v, generator=torch.Generator().manual_seed(1)).to(dtype)
    options = dict(spec, enable_gqa=h_kv != 8)
    got, got_grads = _run("cuda", q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k) or 1, d_out, **options)
    want, want_grads = _run("cpu", q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k) or 1, d_out, **options)
    assert rel_err(got, want) < TOLERANCE[dtype]
    assert got[-3:].abs().sum() == 0  # tokens past the last sequence
    for a, b in zip(got_grads, want_grads):
        assert rel_err(a, b) < 2 * TOLERANCE[dtype]


def test_public_varlen_sdpa_on_cuda_matches_dense_sdpa_for_full_sequences():
    q, k, v, cu_q, cu_k = _packed([256] * 3, [256] * 3, 8, 8, 64, 64, torch.bfloat16, seed=5)
    q, k, v, cu_q, cu_k = (x.cuda() for x in (q, k, v, cu_q, cu_k))
    out = cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, 256, 256, is_causal=True)
    dense = [x.view(3, 256, 8, 64).transpose(1, 2) for x in (q, k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(*dense, is_causal=True)
    assert rel_err(out, expected.transpose(1, 2).reshape(768, 8, 64)) < 1.5e-2


def test_bad_cu_seqlens_on_the_gpu_never_read_out_of_bounds():
    """Once a batch geometry has its graph, no host sync checks values on the GPU: lengths past
    max_seqlen or the packed tokens, and decreasing offsets, are clamped on the device. The
    call completes with finite values and the next valid call is right. (The call that builds
    the graph checks the values it is built with, and refuses bad ones.)"""
    q, k, v, cu_q, cu_k = _packed([64, 64], [64, 64], 8, 8, 64, 64, torch.bfloat16, seed=6)
    q, k, v = (x.cuda() for x in (q, k, v))
    with pytest.raises(cudnn_attn.ValidationError, match="cu_seqlens_q"):
        cudnn_attn.varlen_sdpa(
            q, k, v, *[torch.tensor([0, 64, 900], dtype=torch.int32, device="cuda")] * 2, 64, 64, window_size=(7, 0)
        )
    cudnn_attn.varlen_sdpa(q, k, v, cu_q.cuda(), cu_q.cuda(), 64, 64, is_causal=True)  # builds the graph
    for bad in ([0, 64, 100000], [0, 100, 50], [0, 5000, 5001]):
        bad_cu = torch.tensor(bad, dtype=torch.int32, device="cuda")
        out = cudnn_attn.varlen_sdpa(q, k, v, bad_cu, bad_cu, 64, 64, is_causal=True)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
    good = cu_q.cuda()
    out = cudnn_attn.varlen_sdpa(q, k, v, good, good, 64, 64, is_causal=True)
    expected = varlen_attention(q.cpu(), k.cpu(), v.cpu(), cu_q, cu_q, 64, 64, causal="top_left")
    assert rel_err(out, expected) < 1.5e-2


def test_a_new_packing_reuses_the_plan():
    cache = cudnn_attn.default_cache()
    sizes = []
    for seed, lengths in enumerate(([100, 200, 50], [300, 20, 10], [64, 64, 64])):
        q, k, v, cu_q, cu_k = _packed(lengths, lengths, 8, 8, 64, 64, torch.bfloat16, seed=seed)
        q, k, v, cu_q = (x.cuda() for x in (q, k, v, cu_q))
        cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_q, 300, 300, is_causal=True)
        sizes.append(cache.stats()["size"])
    assert sizes[0] == sizes[1] == sizes[2]  # three packings, three token counts, one plan
