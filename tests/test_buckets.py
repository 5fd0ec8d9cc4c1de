"""Shape buckets: many sequence lengths, a bounded number of plans, exact results."""

from __future__ import annotations

import pytest
import torch
from conftest import randn, rel_err

import cudnn_attn


@pytest.mark.parametrize("causal", [False, "bottom_right"], ids=["full", "causal-br"])
def test_many_lengths_share_a_few_plans(causal):
    cache = cudnn_attn.PlanCache()
    attend = cudnn_attn.BucketedAttention(buckets=(16, 32, 64), causal=causal, cache=cache)
    lengths = [3, 9, 16, 17, 20, 31, 33, 40, 57, 64]
    gen = torch.Generator().manual_seed(0)
    for s_kv in lengths:
        s_q = max(1, s_kv // 2)
        q = randn(2, 4, s_q, 32, dtype=torch.float16, generator=gen)
        k, v = (
            randn(2, 2, s_kv, 32, dtype=torch.float16, generator=gen),
            randn(2, 2, s_kv, 32, dtype=torch.float16, generator=gen),
        )
        out = attend(q, k, v)
        assert out.shape == q.shape
        mask = None
        if causal:
            mask = torch.ones(s_q, s_kv, dtype=torch.bool).tril(diagonal=s_kv - s_q)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True
        )
        assert rel_err(out, expected) < 1e-3, s_kv
    assert attend.plan_count <= 6  # 3 buckets for S_q x 3 for S_kv, of which these lengths use 6 pairs at most
    assert cache.stats()["builds"] == attend.plan_count < len(lengths)


def test_bshd_layout_is_kept_and_long_lengths_are_refused():
    attend = cudnn_attn.BucketedAttention(buckets=(32,))
    q = randn(1, 24, 2, 32, dtype=torch.float16).transpose(1, 2)
    out = attend(q, q, q)
    expected = torch.nn.functional.scaled_dot_product_attention(q.double(), q.double(), q.double())
    assert rel_err(out, expected) < 1e-3
    with pytest.raises(cudnn_attn.ValidationError, match="exceeds the largest bucket"):
        attend(randn(1, 2, 40, 32, dtype=torch.float16), q, q)
    with pytest.raises(cudnn_attn.ValidationError, match="ascending"):
        cudnn_attn.BucketedAttention(buckets=(64, 32))
