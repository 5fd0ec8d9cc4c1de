"""THD (ragged) inputs and paged K/V caches, against the dense computation they stand for."""

from __future__ import annotations

import oracle
import pytest
import torch
from cases import paged_cache
from conftest import poisoned, randn, rel_err

import cudnn_attn


def _pack(dense, lengths):
    """[B, H, S, D] -> [T, H, D] with each sequence's first lengths[b] rows, back to back."""
    return torch.cat([dense[b, :, :n].transpose(0, 1) for b, n in enumerate(lengths)])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("h_kv", [4, 2], ids=["mha", "gqa"])
def test_thd_forward_and_backward(causal, h_kv):
    gen = torch.Generator().manual_seed(11)
    lq, lkv = [5, 12, 1], [7, 12, 9]
    b, h, s, d = 3, 4, 12, 32
    q_dense = randn(b, h, s, d, dtype=torch.float16, generator=gen)
    k_dense = randn(b, h_kv, s, d, dtype=torch.float16, generator=gen)
    v_dense = randn(b, h_kv, s, d, dtype=torch.float16, generator=gen)
    q, k, v = _pack(q_dense, lq), _pack(k_dense, lkv), _pack(v_dense, lkv)
    seq_q, seq_kv = torch.tensor(lq, dtype=torch.int32), torch.tensor(lkv, dtype=torch.int32)
    mask = "bottom_right" if causal else None
    with cudnn_attn.Graph(backend="reference") as g:
        o, stats = g.sdpa(
            q,
            k,
            v,
            seq_len_q=seq_q,
            seq_len_kv=seq_kv,
            max_seq_len_q=s,
            max_seq_len_kv=s,
            use_causal_mask_bottom_right=causal,
            generate_stats=True,
        )
    assert o.shape == q.shape and stats.shape == (3, 4, 12, 1)
    o_val, stats_val = g(q, k, v, seq_q, seq_kv, out=(poisoned(o), poisoned(stats)))
    expected_o, expected_lse = oracle.attention(
        q_dense, k_dense, v_dense, scale=d**-0.5, causal=mask, seq_q=lq, seq_kv=lkv
    )
    assert rel_err(o_val, _pack(expected_o, lq)) < 1e-3
    assert rel_err(stats_val, expected_lse) < 2e-5

    d_o = randn(*o_val.shape, dtype=torch.float16, generator=gen)
    with cudnn_attn.Graph(backend="reference") as gb:
        gb.sdpa_backward(
            q,
            k,
            v,
            o_val,
            d_o,
            stats_val,
            seq_len_q=seq_q,
            seq_len_kv=seq_kv,
            max_seq_len_q=s,
            max_seq_len_kv=s,
            use_causal_mask_bottom_right=causal,
        )
    dq, dk, dv = gb(q, k, v, o_val, d_o, stats_val, seq_q, seq_kv)
    leaves = [x.double().requires_grad_() for x in (q_dense, k_dense, v_dense)]
    allowed = oracle.allowed_matrix(b, s, s, causal=mask, seq_q=lq, seq_kv=lkv)
    ref = oracle.attention_autograd(*leaves, scale=d**-0.5, allowed=allowed)
    d_o_dense = torch.zeros(b, h, s, d, dtype=torch.float64)
    for i, n in enumerate(lq):
        start = sum(lq[:i])
        d_o_dense[i, :, :n] = d_o[start : start + n].transpose(0, 1).double()
    ref.backward(d_o_dense)
    assert rel_err(dq, _pack(leaves[0].grad, lq)) < 2e-3
    assert rel_err(dk, _pack(leaves[1].grad, lkv)) < 2e-3
    assert rel_err(dv, _pack(leaves[2].grad, lkv)) < 2e-3


@pytest.mark.parametrize("layout", ["NPHD", "NHPD"])
@pytest.mark.parametrize("s_q", [1, 6], ids=["decode", "prefill"])
def test_paged_cache_matches_dense(layout, s_q):
    gen = torch.Generator().manual_seed(5)
    b, h, h_kv, s_kv, d, page = 2, 4, 2, 20, 32, 8
    q = randn(b, h, s_q, d, dtype=torch.bfloat16, generator=gen)
    k_dense = randn(b, h_kv, s_kv, d, dtype=torch.bfloat16, generator=gen)
    v_dense = randn(b, h_kv, s_kv, d, dtype=torch.bfloat16, generator=gen)
    k_cache, table_k = paged_cache(k_dense, page, layout, seed=6)
    v_cache, table_v = paged_cache(v_dense, page, layout, seed=7)
    lkv = [20, 13]
    seq_kv = torch.tensor(lkv, dtype=torch.int32)
    with cudnn_attn.Graph(backend="reference") as g:
        o, _ = g.sdpa_with_paged_cache(
            q,
            k_cache,
            v_cache,
            table_k,
            page_table_v=table_v,
            seq_len_kv=seq_kv,
            kv_cache_layout=layout,
            use_causal_mask_bottom_right=s_q > 1,
        )
    problem = g.problems[0]
    assert problem.is_paged and problem.page_size == page and problem.s_kv == 24
    out = g(
        q, k_cache, v_cache, table_k, seq_kv, table_v
    )  # the method's order: q, k, v, page_table, lengths, page_table_v
    k_pad = torch.cat([k_dense, torch.zeros(b, h_kv, 4, d, dtype=k_dense.dtype)], 2)
    v_pad = torch.cat([v_dense, torch.zeros(b, h_kv, 4, d, dtype=v_dense.dtype)], 2)
    expected, _ = oracle.attention(
        q, k_pad, v_pad, scale=d**-0.5, seq_kv=lkv, causal="bottom_right" if s_q > 1 else None
    )
    assert rel_err(out, expected) < 8e-3


def test_paged_cache_layout_is_inferred_when_unambiguous():
    q = randn(1, 8, 1, 32)
    cache = randn(6, 16, 4, 32)  # only dim 2 (4) divides 8 heads... and 16 does not
    table = torch.arange(6, dtype=torch.int32).view(1, 6)
    with cudnn_attn.Graph(backend="reference") as g:
        g.sdpa_with_paged_cache(q, cache, cache, table, seq_len_kv=torch.tensor([90], dtype=torch.int32))
    assert g.problems[0].kv_cache_layout is cudnn_attn.KVCacheLayout.NPHD
    assert g.problems[0].h_k == 4 and g.problems[0].page_size == 16


def test_ambiguous_paged_layout_asks_for_kv_cache_layout():
    q = randn(1, 16, 1, 32)
    cache = randn(6, 8, 4, 32)  # 8 and 4 both divide 16 heads
    table = torch.arange(6, dtype=torch.int32).view(1, 6)
    with pytest.raises(cudnn_attn.ValidationError, match="kv_cache_layout"):
        with cudnn_attn.Graph(backend="reference") as g:
            g.sdpa_with_paged_cache(q, cache, cache, table, seq_len_kv=torch.tensor([40], dtype=torch.int32))
