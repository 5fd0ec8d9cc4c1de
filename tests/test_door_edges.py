"""Inputs at the edges of ``sdpa`` and ``varlen_sdpa`` that raised Python's or torch's exceptions,
or were refused naming an internal argument: a float mask of another dtype than the query's,
extra batch dims around an empty sequence, FlashAttention's scale given as text or a list,
``cu_seqlens`` of two integer dtypes, and a lower-right causal mask with more queries than keys
beside sinks or a window. Each result is checked against float64 attention written out here."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err

import cudnn_attn
from cudnn_attn.errors import ValidationError


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_a_float_mask_of_another_dtype_than_the_query_is_added_as_every_path_adds_it():
    """torch's kernel raised its RuntimeError for a float64 mask beside float32 queries; the
    score-term paths took it. Now the plain path takes it too."""
    q, k, v = (_randn(1, 2, 4, 8, seed=s) for s in range(3))
    mask = _randn(4, 4, seed=3, dtype=torch.float64)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    assert rel_err(cudnn_attn.sdpa(q, k, v, attn_mask=mask), want) < 1e-5
    assert rel_err(cudnn_attn.sdpa(q, k, v, attn_mask=mask.half()), want) < 1e-2


@pytest.mark.parametrize("shape_q,shape_k", [((2, 3, 4, 0, 8), (2, 3, 4, 9, 8)), ((2, 3, 4, 5, 8), (2, 3, 4, 0, 8))])
def test_extra_batch_dims_around_an_empty_sequence_give_torchs_shape(shape_q, shape_k):
    """A reshape to -1 rows was undefined with 0 elements (RuntimeError)."""
    q, k = _randn(*shape_q), _randn(*shape_k, seed=1)
    want = F.scaled_dot_product_attention(q, k, k)
    got = cudnn_attn.sdpa(q, k, k)
    assert got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize("bad", ["a", "0.5", [0.5], float("inf"), 10**400], ids=str)
@pytest.mark.parametrize("name", ["softmax_scale", "scale"])
def test_varlen_scales_that_are_not_finite_numbers_are_refused_by_name(name, bad):
    """Were a ValueError, a TypeError, or (a numeric string) taken."""
    q = _randn(8, 2, 16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValidationError, match=f"varlen_sdpa: {name}: .*expected a finite float or None"):
        cudnn_attn.varlen_sdpa(q, q, q, cu, cu, 8, 8, **{name: bad})


def test_varlen_softcap_takes_equal_lengths_given_in_two_integer_dtypes():
    """cu_seqlens_k in int64 beside int32 cu_seqlens_q of the same lengths was refused as if the
    lengths differed."""
    q = _randn(24, 4, 16)
    cu = torch.tensor([0, 5, 16, 24], dtype=torch.int32)
    same = cudnn_attn.varlen_sdpa(q, q, q, cu, cu, 11, 11, softcap=3.0, causal=True)
    # Not bitwise: a loaded CPU's math library may split its sums over fewer threads on a later call.
    assert rel_err(cudnn_attn.varlen_sdpa(q, q, q, cu, cu.long(), 11, 11, softcap=3.0, causal=True), same) < 1e-6


def _lower_right(q, k, v, sinks=None, left=None):
    """float64 attention under the bottom-right diagonal (key j seen by row i iff j <= i - (L - S),
    and j >= i - (L - S) - left with a window); rows that see no key give 0; a sink per head adds
    to each denominator and weighs no value."""
    q, k, v = q.double(), k.double(), v.double()
    rows, keys = q.shape[-2], k.shape[-2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    i, j = torch.arange(rows)[:, None], torch.arange(keys)[None, :]
    seen = j <= i - (rows - keys)
    if left is not None:
        seen &= j >= i - (rows - keys) - left
    s = s.masked_fill(~seen, -math.inf)
    if sinks is not None:
        heads = q.shape[1]
        s = torch.cat([s, sinks.double().view(1, heads, 1, 1).expand(*s.shape[:-1], 1)], -1)
        v = torch.cat([v, v.new_zeros(*v.shape[:-2], 1, v.shape[-1])], -2)
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


@pytest.mark.parametrize("terms", ["sinks", "window"])
def test_a_lower_right_causal_mask_with_more_queries_than_keys_runs_beside_sinks_and_windows(terms):
    """Refused before, naming use_causal_mask_bottom_right (not an argument of sdpa); plain and
    soft-capped calls took it. The first L - S rows see no key and give 0, as torch gives them."""
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = _randn(1, 2, 9, 8), _randn(1, 2, 7, 8, seed=1), _randn(1, 2, 7, 8, seed=2)
    sinks = torch.tensor([0.3, -0.5])
    options, oracle = (
        (dict(sinks=sinks), dict(sinks=sinks)) if terms == "sinks" else (dict(window_size=(3, 0)), dict(left=3))
    )
    with pytest.warns(UserWarning):  # torch warns of NaN for L > S; its own kernel gives 0 here
        mask = causal_lower_right(9, 7)
    got = cudnn_attn.sdpa(q, k, v, attn_mask=mask, **options)
    assert rel_err(got, _lower_right(q, k, v, **oracle)) < 1e-5
    assert torch.equal(got[:, :, :2], torch.zeros_like(got[:, :, :2]))


@pytest.mark.parametrize("terms", ["sinks", "softcap"])
def test_the_lower_right_split_runs_under_torch_compile_as_eagerly(terms):
    """The compiled path refused it, naming use_causal_mask_bottom_right, where the eager one ran."""
    from torch.nn.attention.bias import causal_lower_right

    leaves = [_randn(1, 2, 9, 8).requires_grad_(), *(_randn(1, 2, 7, 8, seed=s).requires_grad_() for s in (1, 2))]
    options = dict(sinks=torch.tensor([0.3, -0.5])) if terms == "sinks" else dict(softcap=2.0)
    with pytest.warns(UserWarning):
        mask = causal_lower_right(9, 7)

    def attend(q, k, v):
        return cudnn_attn.sdpa(q, k, v, attn_mask=mask, **options)

    torch._dynamo.reset()
    eager, compiled = attend(*leaves), torch.compile(attend, fullgraph=True, backend="aot_eager")(*leaves)
    assert rel_err(compiled, eager) < 1e-6
    d_out = _randn(*eager.shape, seed=5)
    for want, got in zip(torch.autograd.grad(eager, leaves, d_out), torch.autograd.grad(compiled, leaves, d_out)):
        assert rel_err(got, want) < 1e-6
    if terms == "sinks":
        assert rel_err(compiled, _lower_right(*leaves, sinks=options["sinks"])) < 1e-5


def test_refusals_around_sinks_name_sdpas_and_varlens_own_arguments():
    """Were 'generate_stats' and 'sink_token' (inner names) under backend('torch'), and varlen's
    sink errors carried no 'varlen_sdpa:'."""
    from cudnn_attn.errors import UnsupportedError

    q = _randn(1, 2, 4, 8)
    with cudnn_attn.backend("torch"), pytest.raises(UnsupportedError) as refused:
        cudnn_attn.sdpa(q, q, q, sinks=torch.zeros(2))
    assert refused.value.problems == ["sinks: torch's SDPA kernel has no attention sinks"]
    packed, cu = _randn(8, 2, 16), torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValidationError, match="^varlen_sdpa: sinks: shape \\[3\\]"):
        cudnn_attn.varlen_sdpa(packed, packed, packed, cu, cu, 8, 8, sinks=torch.zeros(3))


@pytest.mark.parametrize("bias_shape", [(1, 1, 1, 7), (1, 2, 1, 7), (1, 2, 9, 7)], ids=str)
def test_the_lower_right_split_keeps_a_bias_broadcast_over_the_queries(bias_shape):
    """A bias of one row (broadcast over the queries) was dropped by the split into rows that see
    no key and a square problem; a bias of every row is cut with the rows."""
    from cudnn_attn.core.mask import Causal
    from cudnn_attn.functional.score_terms import score_terms_sdpa

    q, k, v = _randn(1, 2, 9, 8), _randn(1, 2, 7, 8, seed=1), _randn(1, 2, 7, 8, seed=2)
    bias, sinks = _randn(*bias_shape, seed=4), torch.tensor([0.3, -0.5])
    got = score_terms_sdpa(q, k, v, bias, 8**-0.5, Causal.BOTTOM_RIGHT, 0.0, sinks)
    scores = q.double() @ k.double().transpose(-1, -2) * 8**-0.5 + bias.double()
    seen = torch.arange(7)[None, :] <= torch.arange(9)[:, None] - 2
    scores = torch.cat([scores.masked_fill(~seen, -math.inf), sinks.double().view(1, 2, 1, 1).expand(1, 2, 9, 1)], -1)
    want = torch.softmax(scores, -1)[..., :7] @ v.double()
    assert rel_err(got, want) < 1e-5
