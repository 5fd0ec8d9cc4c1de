"""``PagedAttention`` over FP8 K/V caches (``kv_dtype``) on the reference backend: decode and
chunked prefill against float64 attention of the dequantised caches (``k_scale * stored``),
and what FP8 caches cannot take, named."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from test_paged_attention import HKV, HQ, PAGE, D, expected, expected_packed, make_step, packed_step

import cudnn_attn
from cudnn_attn.errors import UnsupportedError, ValidationError
from cudnn_attn.ops import dispatch
from cudnn_attn.serving import schedule as paged_schedule

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_caches(k_cache, v_cache, kv_dtype):
    """The caches stored in FP8 under per-cache scales, and what they hold (float32)."""
    stored, real, scales = [], [], []
    for cache in (k_cache, v_cache):
        scale = float(cache.float().abs().max()) / torch.finfo(kv_dtype).max
        c8 = (cache.float() / scale).to(kv_dtype)
        stored.append(c8)
        real.append(c8.float() * scale)
        scales.append(scale)
    return stored, real, scales


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("s_q", [1, 4])
def test_decode_over_fp8_caches_reads_their_real_values(kv_dtype, s_q):
    q, k_cache, v_cache, table, lengths = make_step([37, 64, 5, 50], pages_per_seq=4, s_q=s_q, seed=3)
    (k8, v8), (k_real, v_real), (k_scale, v_scale) = fp8_caches(k_cache, v_cache, kv_dtype)
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, kv_dtype=kv_dtype)
    attn.plan(table, lengths)
    out = attn.run(q, k8, v8, k_scale=k_scale, v_scale=v_scale)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert rel_err(out, expected(q, k_real, v_real, table, lengths)) < 1e-2
    # Without its scales the same cache gives another answer: the scales are read.
    assert rel_err(attn.run(q, k8, v8), expected(q, k_real, v_real, table, lengths)) > 0.1


def test_chunked_prefill_over_fp8_caches():
    q_lens, kv_lens = [40, 17, 1, 0], [40, 60, 33, 0]
    q, k_cache, v_cache, table, lengths, q_lens_t = packed_step(q_lens, kv_lens, pages_per_seq=4, seed=5)
    (k8, v8), (k_real, v_real), (k_scale, v_scale) = fp8_caches(k_cache, v_cache, torch.float8_e4m3fn)
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    attn.plan(table, lengths, q_lens=q_lens_t)
    out = attn.run(q, k8, v8, k_scale=k_scale, v_scale=v_scale)
    total = sum(q_lens)
    assert rel_err(out[:total], expected_packed(q, k_real, v_real, table, lengths, q_lens_t)) < 1e-2


def test_what_fp8_caches_cannot_take_is_named():
    q, k_cache, v_cache, table, lengths = make_step([20, 9], pages_per_seq=2, seed=7)
    with pytest.raises(ValidationError, match="kv_dtype: torch.float32"):
        cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, kv_dtype=torch.float32)
    with pytest.raises(UnsupportedError, match="kv_dtype: torch.float8_e4m3fn with head dims 576/512"):
        cudnn_attn.PagedAttention(16, 1, 576, 64, dtype=torch.bfloat16, head_dim_v=512, kv_dtype=torch.float8_e4m3fn)
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    attn.plan(table, lengths)
    with pytest.raises(
        ValidationError, match="k_cache: dtype torch.bfloat16; this PagedAttention takes torch.float8_e4m3fn caches"
    ):
        attn.run(q, k_cache, v_cache)
    k8, v8 = (c.to(torch.float8_e4m3fn) for c in (k_cache, v_cache))
    with pytest.raises(ValidationError, match="k_scale: a tensor; expected a float"):
        attn.run(q, k8, v8, k_scale=torch.tensor(0.5))
    with pytest.raises(ValidationError, match="v_scale: -1.0; expected a finite float > 0"):
        attn.run(q, k8, v8, v_scale=-1.0)
    with pytest.raises(ValidationError, match="k_scale: 1000.*; expected a finite float > 0"):
        attn.run(q, k8, v8, k_scale=10**400)  # was float()'s OverflowError
    plain = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16)
    plain.plan(table, lengths)
    with pytest.raises(ValidationError, match="k_scale: 0.5; scales apply to FP8 caches"):
        plain.run(q, k_cache, v_cache, k_scale=0.5)


def test_fp8_caches_split_twice_as_finely_with_one_query_token():
    # Half the bytes per chunk: one query token wants twice the splits (bench --serving); several
    # query tokens keep the 16-bit layout.
    geometry = dict(batch=4, pages_per_seq=128, page_size=64, num_q_heads=32, num_kv_heads=8)
    geometry["kernel"] = dispatch.DECODE_KERNELS["triton"]
    plain, fp8 = (paged_schedule.choose(**geometry, s_q=1, fp8=f) for f in (False, True))
    assert fp8.kernel == "triton" and fp8.splits == min(paged_schedule.MAX_SPLITS, 2 * plain.splits) > plain.splits
    assert paged_schedule.choose(**geometry, s_q=4, fp8=True) == paged_schedule.choose(**geometry, s_q=4)
