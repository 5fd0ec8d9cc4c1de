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


def _problems(error: cudnn_attn.ValidationError) -> list[str]:
    assert str(error).startswith("BucketedAttention: "), str(error)
    return error.problems


@pytest.mark.parametrize("buckets", [(8,), (4, 8)], ids=["one-bucket", "two-buckets"])
def test_keys_and_values_of_different_lengths_are_refused_naming_v(buckets):
    """v with more rows than k was cut to k's length by the padding mask (one bucket), or hit a
    torch RuntimeError in the padding copy (two buckets); sdpa refuses both."""
    q = randn(1, 2, 5, 8, dtype=torch.float32)
    k, v = randn(1, 2, 3 if len(buckets) > 1 else 5, 8, dtype=torch.float32), randn(1, 2, 6, 8, dtype=torch.float32)
    with pytest.raises(cudnn_attn.ValidationError) as error:
        cudnn_attn.BucketedAttention(buckets=buckets)(q, k, v)
    assert [line.split(":")[0] for line in _problems(error.value)] == ["v"]
    assert f"v: 6 keys but k has {k.shape[2]}" in str(error.value)


def test_inputs_sdpa_takes_run_whatever_their_strides():
    """A head dim that is not innermost, an expanded (stride-0) k and batch 0 were refused with
    errors about the padded buffers' strides and the internal seq_len_q; sdpa runs them."""
    attend = cudnn_attn.BucketedAttention(buckets=(8, 16))
    q, k, v = (randn(2, 4, 5, 8, dtype=torch.float32) for _ in range(3))
    transposed = q.transpose(2, 3).contiguous().transpose(2, 3)  # same values, strides [160, 40, 1, 5]
    one_key = randn(2, 2, 1, 8, dtype=torch.float32).expand(2, 2, 11, 8)  # stride 0 over S
    one_head = randn(2, 1, 11, 8, dtype=torch.float32).expand(2, 2, 11, 8)  # stride 0 over H
    values = randn(2, 2, 11, 8, dtype=torch.float32)
    for args in ((transposed, k, v), (q, one_key, values), (transposed, one_head, values)):
        out = attend(*args)
        expected = cudnn_attn.sdpa(*args, enable_gqa=args[1].shape[1] != 4)
        assert out.shape == expected.shape and rel_err(out, expected) < 1e-5
    grads = []  # gradients reach the caller's views through the padded copies
    query_data, key_data = randn(2, 4, 8, 5, dtype=torch.float32), randn(2, 1, 11, 8, dtype=torch.float32)
    for run in (attend, lambda *a: torch.nn.functional.scaled_dot_product_attention(*a, enable_gqa=True)):
        query, key = query_data.clone().requires_grad_(), key_data.clone().requires_grad_()
        run(query.transpose(2, 3), key.expand(2, 2, 11, 8), values).square().sum().backward()
        grads.append((query.grad, key.grad))
    assert rel_err(grads[0][0], grads[1][0]) < 1e-5 and rel_err(grads[0][1], grads[1][1]) < 1e-5
    empty = (randn(0, 4, 5, 8, dtype=torch.float32).requires_grad_(), k[:0, :2], randn(0, 2, 5, 6, dtype=torch.float32))
    out = attend(*empty)
    assert out.shape == cudnn_attn.sdpa(*empty, enable_gqa=True).shape == (0, 4, 5, 6)
    assert out.dtype == torch.float32 and out.requires_grad
    with pytest.raises(cudnn_attn.ValidationError) as error:  # batch 0 is still checked, in the caller's names
        attend(randn(0, 3, 5, 8, dtype=torch.float32), randn(0, 2, 5, 8, dtype=torch.float32), v[:0, :2])
    assert _problems(error.value) == ["k: 2 heads do not divide q's 3 (GQA/MQA needs H_kv to divide H_q)"]
    assert "seq_len" not in str(error.value) and "strides" not in str(error.value)


q5 = torch.randn(1, 2, 5, 8)
BAD_ARGUMENTS = {
    "3-D q, k, v": (lambda: cudnn_attn.BucketedAttention(buckets=(8,))(q5[0], q5[0], q5[0]), ["q", "k", "v"]),
    "q None": (lambda: cudnn_attn.BucketedAttention(buckets=(8,))(None, q5, q5), ["q"]),
    "int v": (lambda: cudnn_attn.BucketedAttention(buckets=(8,))(q5, q5, q5.long()), ["v"]),
    "str attn_scale": (lambda: cudnn_attn.BucketedAttention(buckets=(8,))(q5, q5, q5, attn_scale="x"), ["attn_scale"]),
    "float buckets": (lambda: cudnn_attn.BucketedAttention(buckets=(4.0, 8.0)), ["buckets"]),
    "str buckets": (lambda: cudnn_attn.BucketedAttention(buckets=("a", "b")), ["buckets"]),
    "int buckets": (lambda: cudnn_attn.BucketedAttention(buckets=5), ["buckets"]),
    "tensor buckets": (lambda: cudnn_attn.BucketedAttention(buckets=torch.tensor([4, 8])), ["buckets"]),
    "descending buckets": (lambda: cudnn_attn.BucketedAttention(buckets=(64, 32)), ["buckets"]),
    "cache=3": (lambda: cudnn_attn.BucketedAttention(buckets=(8,), cache=3), ["cache"]),
    "autotune='no'": (lambda: cudnn_attn.BucketedAttention(buckets=(8,), autotune="no"), ["autotune"]),
    "bucket('a')": (lambda: cudnn_attn.BucketedAttention(buckets=(8,)).bucket("a"), ["length"]),
    "bucket(9)": (lambda: cudnn_attn.BucketedAttention(buckets=(8,)).bucket(9), ["length"]),
    "past the largest": (lambda: cudnn_attn.BucketedAttention(buckets=(4,))(q5, q5[:, :, :3], q5[:, :, :3]), ["q"]),
}


def test_the_torch_backend_is_refused_when_made_naming_what_it_lacks():
    """It was taken, then every call refused: torch's kernel takes no per-sequence lengths."""
    with pytest.raises(cudnn_attn.UnsupportedError, match="backend: 'torch'; .*per-sequence lengths"):
        cudnn_attn.BucketedAttention(buckets=(8,), backend="torch")


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_every_bad_argument_is_a_validation_error_naming_it(case):
    """These were IndexError, AttributeError, TypeError or RuntimeError (some only at the first
    call), or a ValidationError naming nothing."""
    make, names = BAD_ARGUMENTS[case]
    with pytest.raises(cudnn_attn.ValidationError) as error:
        make()
    assert [line.split(":")[0] for line in _problems(error.value)] == names
