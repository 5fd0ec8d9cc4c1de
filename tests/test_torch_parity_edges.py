"""Calls torch's SDPA takes that the drop-in refused or computed otherwise (a fuzzer against
torch 2.13 found them): size-1 batch and head dims torch broadcasts, dropout_p=1, scales that
are tensors, bools, inf or NaN, a head dim of 0, empty inputs of any strides, meta inputs under
autocast, and the reference backend under autocast. Each is checked against torch's own call."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import rel_err

import cudnn_attn

F = torch.nn.functional.scaled_dot_product_attention


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _both(q, k, v, **kw):
    """Ours and torch's output and gradients, on fresh leaves of the same values."""
    found = []
    for attend in (cudnn_attn.sdpa, F):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves, **kw)
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True)
        found.append((out, grads))
    return found


SHAPES = {
    "kv-one-head": ((2, 4, 3, 8), (2, 1, 5, 8), (2, 1, 5, 8)),
    "kv-batch-one": ((2, 4, 3, 8), (1, 4, 5, 8), (1, 4, 5, 8)),
    "q-one-head": ((1, 1, 3, 8), (1, 4, 5, 8), (1, 4, 5, 8)),
    "five-d": ((3, 2, 4, 3, 8), (1, 2, 1, 5, 8), (3, 1, 1, 5, 8)),
}


@pytest.mark.parametrize("shapes", SHAPES.values(), ids=SHAPES.keys())
def test_size_one_batch_and_head_dims_broadcast_as_torchs(shapes):
    """Refused before: "key: 1 heads differ from query's 4" / "batch [1] differs"."""
    q, k, v = (randn(*s, seed=i) for i, s in enumerate(shapes))
    (ours, our_grads), (theirs, their_grads) = _both(q, k, v)
    assert ours.shape == theirs.shape and rel_err(ours, theirs) < 1e-5
    assert all(rel_err(a, b) < 1e-5 for a, b in zip(our_grads, their_grads))


def test_heads_that_neither_match_nor_broadcast_are_still_refused():
    q, k = randn(1, 4, 3, 8, seed=1), randn(1, 3, 5, 8, seed=2)
    with pytest.raises(cudnn_attn.ValidationError, match="key: 3 heads"):
        cudnn_attn.sdpa(q, k, k)


@pytest.mark.parametrize(
    "kw",
    [
        dict(dropout_p=1.0),
        dict(scale=torch.tensor(0.5)),
        dict(scale=True),
        dict(dropout_p=torch.tensor(0.0)),
        dict(dropout_p=np.float32(0.0)),
    ],
    ids=["dropout-1", "tensor-scale", "bool-scale", "tensor-dropout", "numpy-dropout"],
)
def test_scalars_torch_takes_are_taken_and_computed_as_torch(kw):
    """Refused before (dropout_p must be < 1; scale a finite float)."""
    q, k, v = (randn(1, 2, 3, 8, seed=10 + i) for i in range(3))
    (ours, our_grads), (theirs, their_grads) = _both(q, k, v, **kw)
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(our_grads, their_grads))


@pytest.mark.parametrize("scale", [math.inf, math.nan], ids=["inf", "nan"])
def test_a_scale_that_is_not_finite_is_taken_and_gives_nan_as_torchs(scale):
    """torch computes it (its kernels disagree on the result; its math kernel gives NaN); it was
    refused here. Ours runs on torch's math kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (randn(1, 2, 3, 8, seed=20 + i) for i in range(3))
    with sdpa_kernel(SDPBackend.MATH):
        expected = F(q, k, v, scale=scale)
    assert torch.equal(cudnn_attn.sdpa(q, k, v, scale=scale).isnan(), expected.isnan())


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_a_head_dim_of_zero_gives_the_mean_of_the_values(backend):
    q, k, v = randn(1, 2, 3, 0, seed=1), randn(1, 2, 5, 0, seed=2), randn(1, 2, 5, 4, seed=3)
    with cudnn_attn.backend(backend):
        out = cudnn_attn.sdpa(q, k, v)
    assert rel_err(out, F(q, k, v)) < 1e-6 and rel_err(out[0, :, 0], v.mean(2)[0]) < 1e-6


def test_empty_inputs_of_any_strides_and_empty_masks_over_more_batch_dims():
    q = randn(1, 1, 3, 4, seed=1)
    k, v = randn(1, 1, 0, 8, seed=2)[..., ::2], randn(1, 1, 0, 4, seed=3)
    assert torch.equal(cudnn_attn.sdpa(q, k, v), F(q, k, v))
    assert torch.equal(cudnn_attn.sdpa(q, v, v, attn_mask=torch.zeros(1)), F(q, v, v, attn_mask=torch.zeros(1)))
    q5, kv5 = randn(2, 1, 1, 3, 8, seed=4), randn(2, 1, 1, 0, 8, seed=5)
    mask = torch.zeros(1, 1, 3, 0)
    assert torch.equal(cudnn_attn.sdpa(q5, kv5, kv5, attn_mask=mask), F(q5, kv5, kv5, attn_mask=mask))


def test_meta_inputs_under_autocast_give_torchs_shape():
    m = torch.empty(1, 1, 3, 8, device="meta")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cudnn_attn.sdpa(m, m, m)
    assert out.shape == (1, 1, 3, 8) and out.device.type == "meta"


@pytest.mark.parametrize("kw", [dict(window_size=(15, 15)), dict(softcap=1e4)], ids=["window", "softcap"])
def test_the_reference_backend_is_unchanged_by_an_enclosing_autocast(kw):
    """Its forward's matmuls ran in bf16 under autocast and its backward's (outside) in float32:
    dq off by 1.3 at scale 10, gradients up to 1e22 at larger logits."""
    q, k, v = (randn(1, 1, n, 16, seed=n, dtype=torch.bfloat16) for n in (4, 16, 17))
    k = k[:, :, :16]

    def run(autocast: bool):
        leaves = [t.clone().requires_grad_() for t in (q, k, v[:, :, :16])]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = cudnn_attn.sdpa(*leaves, scale=10.0, **kw)
        return (out, *torch.autograd.grad(out, leaves, torch.ones_like(out)))

    for plain, cast in zip(run(False), run(True)):
        assert torch.equal(plain, cast)


def test_broadcast_dims_run_under_torch_compile_as_eagerly():
    """The broadcast step ran on the eager path only: compiled, the call was refused."""
    q, k, v = randn(2, 4, 3, 8, seed=1), randn(2, 1, 5, 8, seed=2), randn(1, 1, 5, 8, seed=3)
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, c: cudnn_attn.sdpa(a, b, c), fullgraph=True, backend="aot_eager")
    assert rel_err(compiled(q, k, v), F(q, k, v)) < 1e-5


@pytest.mark.parametrize(
    "kw, reason",
    [
        (dict(scale=math.inf), "a scale that is inf or NaN"),
        (dict(dropout_p=1.0), "dropout_p=1: cuDNN's dropout scales by 1 / \\(1 - p\\)"),
    ],
    ids=["inf-scale", "dropout-1"],
)
def test_a_cudnn_block_refuses_what_cudnn_cannot_run_naming_why(kw, reason):
    """An inf scale was a ValidationError there ("give a finite float"); the degenerate calls'
    reason named neither case."""
    x = randn(1, 2, 3, 8, seed=4, dtype=torch.bfloat16)
    with cudnn_attn.backend("cudnn"), pytest.raises(cudnn_attn.UnsupportedError, match=reason):
        cudnn_attn.sdpa(x, x, x, **kw)


def test_compiled_sdpa_takes_dynamic_shapes_a_traced_scale_and_causal_bias_masks_in_one_graph():
    """fullgraph=True failed on the CPU once shapes went dynamic (the parity check's layout sort
    over symbolic strides), with a scale traced as an argument (math.isfinite of a SymFloat) and
    with a CausalBias mask (built again inside the traced function)."""
    from torch.nn.attention.bias import causal_lower_right

    plain = torch.compile(lambda q, k, v: cudnn_attn.sdpa(q, k, v, is_causal=True), fullgraph=True)
    scaled = torch.compile(lambda q, s: cudnn_attn.sdpa(q, q, q, scale=s), dynamic=True, fullgraph=True)
    masked = torch.compile(lambda q, k, m: cudnn_attn.sdpa(q, k, k, attn_mask=m), fullgraph=True)
    for length in (4, 6, 9):  # the second length retraces with dynamic shapes
        q, k, v = (randn(2, 2, length, 8, seed=30 + i).double() for i in range(3))
        assert rel_err(plain(q, k, v), F(q, k, v, is_causal=True)) < 1e-10
        assert rel_err(scaled(q, 0.3), F(q, q, q, scale=0.3)) < 1e-10
    q, k = randn(2, 2, 5, 8, seed=40).double(), randn(2, 2, 7, 8, seed=41).double()
    assert rel_err(masked(q, k, causal_lower_right(5, 7)), F(q, k, k, attn_mask=causal_lower_right(5, 7))) < 1e-10


@pytest.mark.parametrize("kw", [dict(dropout_p=1.0), dict(scale=math.inf)], ids=["dropout-1", "inf-scale"])
def test_nested_calls_torch_answers_degenerately_are_answered_as_torch(kw):
    """Refused on nested inputs (dropout_p must be < 1; scale finite) while dense ones ran."""

    def nested():
        parts = [torch.randn(3, 2, 8), torch.randn(2, 2, 8)]
        return torch.nested.nested_tensor(parts, layout=torch.jagged).transpose(1, 2)

    q, k, v = nested(), nested(), nested()
    ours, theirs = cudnn_attn.sdpa(q, k, v, **kw).values(), F(q, k, v, **kw).values()
    assert torch.equal(ours.isnan(), theirs.isnan()) and torch.equal(ours.nan_to_num(), theirs.nan_to_num())


def test_an_sdpa_kernel_context_that_leaves_no_kernel_is_an_unsupported_error_torchs_code_still_catches():
    """torch's bare RuntimeError came through; it is now the library's error, which a caller's
    ``except RuntimeError`` (written for torch's) still catches."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = randn(1, 2, 4, 8, seed=50)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION), pytest.raises(RuntimeError) as refused:
        cudnn_attn.sdpa(q, q, q)
    assert isinstance(refused.value, cudnn_attn.UnsupportedError) and "sdpa_kernel context" in str(refused.value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_float32_mask_beside_16_bit_queries_is_added_as_torch_adds_it(dtype):
    """torch's CPU kernel adds a float32 mask to its float32 scores as it is; cast to the
    queries' dtype first, outputs were one 16-bit step apart from torch's."""
    q, k, v = (randn(2, 2, 33, 16, seed=i, dtype=dtype) for i in range(3))
    mask = randn(33, 33, seed=3) * 3
    assert torch.equal(cudnn_attn.sdpa(q, k, v, attn_mask=mask), F(q, k, v, attn_mask=mask))


@pytest.mark.parametrize(
    "terms", [{"softcap": 50.0}, {"window_size": (2, 0)}, {"sinks": torch.zeros(2)}], ids=["softcap", "window", "sinks"]
)
def test_score_terms_broadcast_size_one_batch_and_head_dims_as_plain_calls_do(terms):
    """With a score term, K/V of batch 1 beside a query of batch 2 (and one K/V head beside
    query heads, without enable_gqa) were refused; plain calls and torch broadcast them."""
    q, k, v = randn(2, 2, 4, 8, seed=1), randn(1, 2, 4, 8, seed=2), randn(1, 2, 4, 8, seed=3)
    got = cudnn_attn.sdpa(q, k, v, **terms)
    want = cudnn_attn.sdpa(q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), **terms)
    assert torch.equal(got, want)
    q2, k2 = randn(2, 4, 4, 8, seed=4), randn(2, 1, 4, 8, seed=5)
    heads = {**terms, "sinks": torch.zeros(4)} if "sinks" in terms else terms
    assert cudnn_attn.sdpa(q2, k2, k2, **heads).shape == q2.shape


@pytest.mark.parametrize("heads,kv_heads,gqa", [(0, 0, False), (0, 0, True), (0, 2, True)])
def test_no_query_heads_give_torchs_empty_output(heads, kv_heads, gqa):
    q, k = randn(2, heads, 5, 8, seed=1), randn(2, kv_heads, 7, 8, seed=2)
    assert cudnn_attn.sdpa(q, k, k, enable_gqa=gqa).shape == F(q, k, k, enable_gqa=gqa).shape == (2, 0, 5, 8)


def test_sparse_and_meta_nested_inputs_are_named():
    """torch's RuntimeError and NotImplementedError came through (torch fails on them too)."""
    q = randn(2, 2, 4, 8, seed=1)
    with pytest.raises(cudnn_attn.ValidationError, match="attn_mask: a sparse_coo tensor"):
        cudnn_attn.sdpa(q, q, q, attn_mask=torch.ones(4, 4).to_sparse())
    with pytest.raises(cudnn_attn.ValidationError, match="query: a sparse_coo tensor"):
        cudnn_attn.sdpa(q.to_sparse(), q, q)
    nested = torch.nested.nested_tensor([randn(n, 2, 8, seed=n) for n in (3, 4)], layout=torch.jagged)
    meta = nested.transpose(1, 2).to("meta")
    with pytest.raises(cudnn_attn.UnsupportedError, match="query: a nested tensor on the meta device"):
        cudnn_attn.sdpa(meta, meta, meta)


def test_the_reference_backend_takes_empty_inputs_of_a_strided_head_dim():
    """An empty K/V (or query) whose head dim is strided: contiguous() keeps an empty tensor's
    strides, and the layout check refused what torch and "auto" run."""
    q, k = randn(1, 3, 2, 2, seed=1), randn(1, 3, 0, 2, seed=2)
    v = randn(1, 3, 0, 4, seed=3)[..., ::2]
    with cudnn_attn.backend("reference"):
        assert torch.equal(cudnn_attn.sdpa(q, k, v), F(q, k, v))
        empty_q = randn(1, 3, 0, 4, seed=4)[..., ::2]
        assert cudnn_attn.sdpa(empty_q, randn(1, 3, 5, 2, seed=5), randn(1, 3, 5, 2, seed=6)).shape == (1, 3, 0, 2)


@pytest.mark.parametrize(
    "shapes",
    [
        ((2, 3, 5, 8), (3, 7, 8), (3, 7, 8)),
        ((3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8)),
        ((5, 8), (2, 3, 7, 8), (2, 3, 7, 8)),
    ],
    ids=["3-D K/V", "3-D query", "2-D query"],
)
def test_inputs_of_other_ranks_broadcast_as_torchs(shapes):
    """torch adds the missing leading dims as size 1 and broadcasts; they were refused."""
    q, k, v = (randn(*shape, seed=i, dtype=torch.float64) for i, shape in enumerate(shapes))
    (out, grads), (want_out, want_grads) = _both(q, k, v)
    assert out.shape == want_out.shape
    for a, b in zip((out, *grads), (want_out, *want_grads)):
        assert a.shape == b.shape and rel_err(a, b) < 1e-12
