"""The eager path of ``cudnn_attn.sdpa``: one prepared run per call signature, looked up by a
flat key; training through a plain autograd.Function; torch.compile still sees one op."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import randn, rel_err

import cudnn_attn
from cudnn_attn.functional import eager as sdpa_eager
from cudnn_attn.runtime import prepared


@pytest.fixture(autouse=True)
def fresh():
    cudnn_attn.functional._clear_graphs()
    yield
    cudnn_attn.functional._clear_graphs()


def _qkv(*shape, requires_grad=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [randn(*shape, generator=gen).requires_grad_(requires_grad) for _ in range(3)]


@cudnn_attn.backend("reference")  # the graphs' path; plain "auto" CPU calls run on torch's kernel
def test_one_prepared_run_per_signature_and_new_ones_for_new_geometry():
    q, k, v = _qkv(1, 2, 8, 16)
    first = cudnn_attn.sdpa(q, k, v, is_causal=True)
    for seed in range(3):  # other data, same signature: no new entry, no new graph
        cudnn_attn.sdpa(*_qkv(1, 2, 8, 16, seed=seed + 1), is_causal=True)
    assert len(sdpa_eager._prepared) == 1 and len(prepared.held()) == 1
    cudnn_attn.sdpa(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, is_causal=True)  # BSHD q
    cudnn_attn.sdpa(q, k, v)  # not causal
    cudnn_attn.sdpa(q, q, q, is_causal=True)  # aliased
    assert len(sdpa_eager._prepared) == 4
    expected = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert rel_err(first, expected) < 1e-2


def test_a_signature_that_failed_validation_fails_every_time():
    # (Head dim 12 was the example here; validation now takes any head dim, cuDNN refusing by name.)
    q, k, v = _qkv(1, 2, 8, 16)
    k = k[..., :8]  # key's head dim differs from query's
    for _ in range(2):
        with pytest.raises(cudnn_attn.ValidationError, match="key: head dim 8 differs from query's 16"):
            cudnn_attn.sdpa(q, k, v)
    assert not sdpa_eager._prepared


@pytest.mark.parametrize("mask", [None, "float", "bool"])
@cudnn_attn.backend("reference")  # the graphs' training path; plain "auto" CPU calls run on torch's kernel
def test_eager_training_matches_float64_autograd(mask):
    q, k, v = _qkv(2, 4, 12, 16, requires_grad=True)
    gen = torch.Generator().manual_seed(5)
    attn_mask = {
        None: None,
        "float": randn(1, 4, 12, 12, generator=gen).requires_grad_(),
        "bool": torch.rand(2, 1, 12, 12, generator=gen) > 0.2,
    }[mask]
    out = cudnn_attn.sdpa(q, k, v, attn_mask=attn_mask)
    assert type(out.grad_fn).__name__ == "_TrainedBackward"  # the one training seam (runtime/training.py)
    d_o = randn(*out.shape, generator=gen)
    out.backward(d_o)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    mask64 = attn_mask
    if mask == "float":
        mask64 = attn_mask.detach().double().requires_grad_()
    ref = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=mask64)
    ref.backward(d_o.double())
    assert rel_err(out, ref) < 1e-2
    for mine, theirs in zip((q, k, v), leaves):
        assert rel_err(mine.grad, theirs.grad) < 2e-2
    if mask == "float":
        assert rel_err(attn_mask.grad, mask64.grad) < 3e-2


def test_the_eager_path_retains_no_call_tensors():
    q, k, v = _qkv(1, 2, 8, 16, requires_grad=True)
    out = cudnn_attn.sdpa(q, k, v)
    out.float().sum().backward()
    refs = [weakref.ref(t) for t in (q, k, v, out)]
    del q, k, v, out
    gc.collect()
    assert all(r() is None for r in refs), "a prepared run keeps a call's tensors alive"


def test_compile_sees_torchs_sdpa_on_the_cpu():
    q, k, v = _qkv(1, 2, 8, 16)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    compiled = torch.compile(lambda a, b, c: cudnn_attn.sdpa(a, b, c, is_causal=True), backend=backend, fullgraph=True)
    out = compiled(q, k, v)
    # On the CPU a plain call is torch's own SDPA (ON_CPU); CUDA calls are the custom op
    # cudnn_attn::sdpa_forward, and calls with score terms cudnn_attn::sdpa_terms_forward.
    assert any("scaled_dot_product_attention" in target for target in seen), seen
    assert rel_err(out, cudnn_attn.sdpa(q, k, v, is_causal=True)) < 1e-6
