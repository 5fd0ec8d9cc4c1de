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


# ---- found by the GPU fuzz campaign (cuDNN 9.19, H100) ------------------------------------------


def _lengths(values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def test_an_empty_query_sequence_at_s_q_1_gives_zero():
    """cuDNN wrote row 0 of a sequence with seq_len_q = 0 at S_q = 1 (S_q >= 2 gave 0)."""
    q, k, v = (
        randn(2, 2, 1, 64, dtype=torch.float16, seed=1),
        *(randn(2, 2, 8, 64, dtype=torch.float16, seed=s) for s in (2, 3)),
    )
    lengths = dict(seq_len_q=_lengths([0, 1]), seq_len_kv=_lengths([8, 8]))
    with cudnn_attn.Graph() as g:
        g.sdpa(q, k, v, use_padding_mask=True, generate_stats=True, **lengths)
    o, stats = g(q, k, v, lengths["seq_len_q"], lengths["seq_len_kv"], out=tuple(poisoned(h) for h in g.outputs))
    torch.cuda.synchronize()
    assert torch.equal(o[0], torch.zeros_like(o[0])) and torch.isneginf(stats[0]).all()
    expected = torch.softmax((q[1].float() @ k[1].float().transpose(-1, -2)) / 8, -1) @ v[1].float()
    assert rel_err(o[1], expected) < TOL[torch.float16]


def test_a_sequence_with_no_keys_has_zero_gradients():
    """cuDNN left dQ, dK, dV of a sequence with seq_len_kv = 0 as garbage (up to 1e37)."""
    q, k, v, d_o = (randn(2, 1, 8, 64, dtype=torch.float16, seed=s) for s in range(4))
    lengths = dict(seq_len_q=_lengths([8, 8]), seq_len_kv=_lengths([8, 0]))
    with cudnn_attn.Graph() as g:
        o, s = g.sdpa(q, k, v, generate_stats=True, use_padding_mask=True, **lengths)
        g.sdpa_backward(q, k, v, o, d_o, s, use_padding_mask=True, **lengths)
    outs = tuple(poisoned(h) for h in g.outputs)
    _, _, d_q, d_k, d_v = g(q, k, v, lengths["seq_len_q"], lengths["seq_len_kv"], d_o, out=outs)
    torch.cuda.synchronize()
    for grad in (d_q, d_k, d_v):
        assert torch.equal(grad[1], torch.zeros_like(grad[1]))
        assert torch.isfinite(grad[0]).all() and grad[0].abs().sum() > 0


@pytest.mark.parametrize("scale", [-0.5, 0.0])
def test_a_scale_at_or_below_zero_is_refused_by_the_graph_and_right_in_the_drop_in(scale):
    """cuDNN gave NaN for attn_scale <= 0."""
    q, k, v = (randn(1, 2, 16 if i == 0 else 7, 64, dtype=torch.float16, seed=i) for i in range(3))
    with pytest.raises(cudnn_attn.UnsupportedError, match="attn_scale"):
        with cudnn_attn.Graph() as g:
            g.sdpa(q, k, v, attn_scale=scale)
    for causal in (False, True):
        out = cudnn_attn.sdpa(q, k, v, scale=scale, is_causal=causal)
        s = (q.float() @ k.float().transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(~torch.ones(16, 7, dtype=torch.bool, device="cuda").tril(), float("-inf"))
        assert rel_err(out, s.softmax(-1) @ v.float()) < TOL[torch.float16]


def test_decode_with_a_causal_mask_and_gqa_runs_right_on_9_19():
    """The release notes' wrong result (decode, causal, GQA) was not seen on 9.19: 17 of 17 right."""
    q = randn(2, 4, 1, 64, dtype=torch.bfloat16, seed=1)
    k, v = (randn(2, 2, 40, 64, dtype=torch.bfloat16, seed=s) for s in (2, 3))
    with cudnn_attn.Graph() as g:
        g.sdpa(q, k, v, use_causal_mask_bottom_right=True)
    out = g(q, k, v, out=poisoned(g.outputs[0]))
    torch.cuda.synchronize()
    kk, vv = (t.float().repeat_interleave(2, dim=1) for t in (k, v))
    expected = torch.softmax((q.float() @ kk.transpose(-1, -2)) / 8, -1) @ vv
    assert rel_err(out, expected) < TOL[torch.bfloat16]


def test_a_page_table_wider_than_max_seq_len_kv_is_read_through_its_leading_columns():
    """cuDNN refused a table wider than ceil(max_seq_len_kv / page_size) ("block table size")."""
    page, pages_per_seq, b, h, d = 16, 6, 2, 2, 64
    cache_k = randn(b * pages_per_seq, page, h, d, dtype=torch.bfloat16, seed=1)
    cache_v = randn(b * pages_per_seq, page, h, d, dtype=torch.bfloat16, seed=2)
    table = torch.randperm(b * pages_per_seq, generator=torch.Generator().manual_seed(0)).view(b, pages_per_seq)
    table = table.to(device="cuda", dtype=torch.int32)
    q = randn(b, h, 1, d, dtype=torch.bfloat16, seed=3)
    lengths = _lengths([40, 33])
    with cudnn_attn.Graph() as g:
        g.sdpa_with_paged_cache(q, cache_k, cache_v, table, seq_len_kv=lengths, max_seq_len_kv=48)
    out = g(q, cache_k, cache_v, table, lengths, out=poisoned(g.outputs[0]))
    torch.cuda.synchronize()
    for i, n in enumerate((40, 33)):
        kk, vv = (c[table[i].long()].reshape(-1, h, d)[:n].transpose(0, 1).float() for c in (cache_k, cache_v))
        expected = torch.softmax((q[i].float() @ kk.transpose(-1, -2)) / 8, -1) @ vv
        assert rel_err(out[i], expected) < TOL[torch.bfloat16]
