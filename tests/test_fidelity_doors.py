"""Regression tests for three doors of ``cudnn_attn.sdpa`` that used to lose fidelity:

- nested (jagged) inputs dropped ``sinks=``, ``softcap=`` and ``window_size=`` (plain attention ran);
- ``torch.compile(fullgraph=True)`` broke on those keywords (dynamo met the backend block's
  ``ContextVar`` in the score-terms path);
- plain CPU calls ran the slow reference backend where torch's own SDPA kernel computes the same
  problem.

Each result is checked against a float64 oracle written out here.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TOLERANCE, rel_err

import cudnn_attn
from cudnn_attn.ops.torch import kernel as torch_kernel
from cudnn_attn.ops.torch import reasons as torch_reasons


def oracle(q, k, v, *, scale=None, causal=False, window=(-1, -1), sinks=None, softcap=None, attn_mask=None):
    """Dense attention in float64, [B, H, L, D] (K/V heads repeated for GQA); the window and the
    causal mask measured from the top-left diagonal, as ``cudnn_attn.sdpa`` defines them."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    length, keys = q.shape[-2], k.shape[-2]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-2, -1) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i, j = torch.arange(length)[:, None], torch.arange(keys)[None, :]
    keep = torch.ones(length, keys, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window[0] >= 0:
        keep &= j >= i - window[0]
    if window[1] >= 0:
        keep &= j <= i + window[1]
    s = s.masked_fill(~keep, -math.inf)
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else s + attn_mask.double()
    if sinks is not None:
        sink = sinks.double().reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1).nan_to_num(0.0)  # a row with no key gives 0, as the library does
    return p @ v


def _nested(lengths, heads, d, dtype, gen, device="cpu"):
    """A [B, H, (S), D] jagged leaf on ``device``, and its sequences as [1, H, S, D] CPU tensors."""
    seqs = [torch.randn(n, heads, d, generator=gen).to(dtype) for n in lengths]
    leaf = torch.nested.nested_tensor([t.to(device) for t in seqs], layout=torch.jagged, requires_grad=True)
    return leaf, [s.transpose(0, 1)[None] for s in seqs]


# --- 1. nested inputs take sinks, softcap and window_size ----------------------------------------

NESTED = {
    # name: (q lengths, kv lengths, sdpa keywords)
    "sinks": ([5, 11, 1], None, {"sinks": True}),
    "softcap": ([5, 11, 2], None, {"softcap": 2.0}),
    "softcap-causal": ([5, 11, 2], None, {"softcap": 2.0, "is_causal": True}),
    "window-left": ([9, 4, 13], None, {"window_size": (2, -1)}),
    "window-causal": ([9, 4, 13], None, {"window_size": (3, 0)}),
    "window-is_causal": ([9, 4, 13], None, {"window_size": (1, -1), "is_causal": True}),
    "all-three": ([7, 12], None, {"sinks": True, "softcap": 3.0, "window_size": (4, 0)}),
    "window-right": ([9, 4, 13], None, {"window_size": (2, 3)}),
    "window-right-sinks": ([9, 4, 13], None, {"window_size": (-1, 1), "sinks": True}),
    "cross-sinks": ([5, 1, 9], [11, 3, 4], {"sinks": True}),
    "cross-window-causal": ([3, 6, 2], [8, 6, 5], {"window_size": (2, 0)}),
    "cross-window-left": ([3, 6, 2], [8, 6, 5], {"window_size": (1, -1)}),
    "cross-window-right": ([3, 6, 2], [8, 6, 5], {"window_size": (0, 2)}),
}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", NESTED.values(), ids=NESTED.keys())
def test_nested_inputs_get_sinks_softcap_and_window_per_sequence(case, dtype, device):
    lq, lkv, keywords = case
    heads, d = 4, 16
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("cuDNN attention takes fp16/bf16")
    gen = torch.Generator().manual_seed(sum(lq) + len(keywords))
    (q_leaf, qs), (k_leaf, ks), (v_leaf, vs) = (
        _nested(n, heads, d, dtype, gen, device) for n in (lq, lkv or lq, lkv or lq)
    )
    keywords = dict(keywords)
    sinks = None
    if keywords.get("sinks") is True:
        sinks = torch.randn(heads, generator=gen).mul(2).to(device).requires_grad_()
        keywords["sinks"] = sinks
    q, k, v = (t.transpose(1, 2) for t in (q_leaf, k_leaf, v_leaf))

    try:
        out = cudnn_attn.sdpa(q, k, v, **keywords)
    except cudnn_attn.UnsupportedError as refused:
        if device == "cpu" or "sink" in str(refused):  # sinks run on every cuDNN (folded_sink.py)
            raise
        pytest.skip(f"cuDNN refuses it by name: {refused}")  # the reason names what cuDNN lacks

    assert out.is_nested and out.dtype == dtype
    options = {
        "causal": keywords.get("is_causal", False),
        "window": keywords.get("window_size", (-1, -1)),
        "softcap": keywords.get("softcap"),
    }
    d_outs = [torch.randn(1, heads, n, d, generator=gen).to(dtype) for n in lq]
    for got, qi, ki, vi in zip(out.unbind(), qs, ks, vs):
        leaves = [t.double().requires_grad_() for t in (qi, ki, vi)]
        s64 = None if sinks is None else sinks.detach().cpu().double().requires_grad_()
        want = oracle(*leaves, sinks=s64, **options)
        assert rel_err(got.cpu(), want[0]) < TOLERANCE[dtype]
    # gradients, sequence by sequence, through the whole nested call
    out.transpose(1, 2).values().backward(torch.cat([t[0].transpose(0, 1) for t in d_outs]).to(device))
    d_sinks = torch.zeros(heads, dtype=torch.float64)
    for n, (qi, ki, vi, d_o, offset_q, offset_k) in enumerate(
        zip(qs, ks, vs, d_outs, q_leaf.offsets().tolist(), k_leaf.offsets().tolist())
    ):
        leaves = [t.double().requires_grad_() for t in (qi, ki, vi)]
        s64 = None if sinks is None else sinks.detach().cpu().double().requires_grad_()
        oracle(*leaves, sinks=s64, **options).backward(d_o.double())
        rows_q, rows_k = slice(offset_q, offset_q + qi.shape[2]), slice(offset_k, offset_k + ki.shape[2])
        for leaf, rows, want in ((q_leaf, rows_q, leaves[0]), (k_leaf, rows_k, leaves[1]), (v_leaf, rows_k, leaves[2])):
            got = leaf.grad.values()[rows].transpose(0, 1)[None].cpu()
            assert rel_err(got, want.grad) < 4 * TOLERANCE[dtype], f"sequence {n}"
        if s64 is not None:
            d_sinks += s64.grad
    if sinks is not None:
        assert rel_err(sinks.grad.cpu(), d_sinks) < 4 * TOLERANCE[dtype]


def test_nested_call_logs_no_fx_tracing_warning():
    from torch.fx import _symbolic_trace

    _symbolic_trace.is_fx_tracing_warning.cache_clear()  # torch says it once per process
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger(_symbolic_trace.__name__)
    logger.addHandler(handler)
    try:
        leaf, _ = _nested([3, 5], 2, 8, torch.float32, torch.Generator().manual_seed(0))
        q = leaf.transpose(1, 2)
        cudnn_attn.sdpa(q, q, q)
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == []


# --- 6. torch.compile(fullgraph=True) with sinks, softcap and window_size ------------------------

COMPILED = {
    "softcap": {"softcap": 5.0},
    "window": {"window_size": (3, 0)},
    "window-right": {"window_size": (2, 3)},
    "sinks": {"sinks": True},
    "sinks-mask": {"sinks": True, "attn_mask": True},
    "all-three": {"sinks": True, "softcap": 3.0, "window_size": (2, -1), "is_causal": True},
}


@pytest.mark.parametrize("keywords", COMPILED.values(), ids=COMPILED.keys())
def test_fullgraph_compile_with_score_terms_equals_eager(keywords):
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(11)
    heads = 4
    q, k, v = (torch.randn(2, heads, 8, 16, generator=gen).requires_grad_() for _ in range(3))
    keywords = dict(keywords)
    if keywords.get("sinks") is True:
        keywords["sinks"] = torch.randn(heads, generator=gen).requires_grad_()
    if keywords.get("attn_mask") is True:
        keywords["attn_mask"] = torch.randn(8, 8, generator=gen).requires_grad_()

    def attend(q, k, v, **kw):
        return cudnn_attn.sdpa(q, k, v, **kw)

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    eager_out, compiled_out = attend(q, k, v, **keywords), compiled(q, k, v, **keywords)
    assert torch.equal(eager_out, compiled_out)
    leaves = [q, k, v, *(t for t in keywords.values() if isinstance(t, torch.Tensor))]
    d_out = torch.randn(eager_out.shape, generator=gen)
    for want, got in zip(
        torch.autograd.grad(eager_out, leaves, d_out), torch.autograd.grad(compiled_out, leaves, d_out)
    ):
        assert torch.equal(want, got)
    window = keywords.get("window_size", (-1, -1))
    expected = oracle(
        q,
        k,
        v,
        causal=keywords.get("is_causal", False),
        window=window,
        sinks=keywords.get("sinks"),
        softcap=keywords.get("softcap"),
        attn_mask=keywords.get("attn_mask"),
    )
    assert rel_err(compiled_out, expected) < TOLERANCE[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("keywords", COMPILED.values(), ids=COMPILED.keys())
def test_fullgraph_compile_with_score_terms_on_cuda_equals_eager(keywords):
    """The same on CUDA tensors (bf16, cuDNN's runs behind the custom ops)."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(12)
    heads = 4
    q, k, v = (torch.randn(2, heads, 64, 64, generator=gen).bfloat16().cuda().requires_grad_() for _ in range(3))
    keywords = dict(keywords)
    if keywords.get("sinks") is True:
        keywords["sinks"] = torch.randn(heads, generator=gen).cuda().requires_grad_()
    if keywords.get("attn_mask") is True:
        keywords["attn_mask"] = torch.randn(64, 64, generator=gen).bfloat16().cuda()

    def attend(q, k, v, **kw):
        return cudnn_attn.sdpa(q, k, v, **kw)

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    eager_out, compiled_out = attend(q, k, v, **keywords), compiled(q, k, v, **keywords)
    assert rel_err(compiled_out, eager_out) < TOLERANCE[torch.bfloat16]
    leaves = [q, k, v, *(t for t in keywords.values() if isinstance(t, torch.Tensor) and t.requires_grad)]
    d_out = torch.randn(eager_out.shape, generator=gen).bfloat16().cuda()
    for want, got in zip(
        torch.autograd.grad(eager_out, leaves, d_out), torch.autograd.grad(compiled_out, leaves, d_out)
    ):
        assert rel_err(got, want) < TOLERANCE[torch.bfloat16]


def test_score_terms_custom_ops_pass_torch_opcheck():
    from cudnn_attn.functional.score_terms import sdpa_terms_forward

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=gen).requires_grad_() for _ in range(3))
    sink = torch.randn(1, 2, 1, 1, generator=gen).requires_grad_()
    result = torch.library.opcheck(
        sdpa_terms_forward, (q, k, v, None, sink, 0.25, "top_left", 0.0, 3, None, 5.0, None, None)
    )
    assert set(result.values()) == {"SUCCESS"}, result


# --- 15. plain CPU calls run on torch's own SDPA kernel ------------------------------------------

PLAIN = {
    "causal": {"is_causal": True},
    "bool-mask": {"attn_mask": "bool"},
    "float-mask": {"attn_mask": "float"},
    "gqa-scale": {"enable_gqa": True, "scale": 0.3},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("keywords", PLAIN.values(), ids=PLAIN.keys())
def test_plain_cpu_calls_run_on_torchs_kernel_with_gradients(keywords, dtype):
    gen = torch.Generator().manual_seed(21)
    heads_kv = 2 if keywords.get("enable_gqa") else 4
    q = torch.randn(2, 4, 24, 16, generator=gen).to(dtype).requires_grad_()
    k, v = (torch.randn(2, heads_kv, 24, 16, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    keywords = dict(keywords)
    mask = keywords.get("attn_mask")
    if mask == "bool":
        keywords["attn_mask"] = torch.rand(24, 24, generator=gen) > 0.3
    elif mask == "float":
        keywords["attn_mask"] = torch.randn(1, 4, 24, 24, generator=gen).to(dtype)

    out = cudnn_attn.sdpa(q, k, v, **keywords)

    assert "ForCpuBackward" in type(out.grad_fn).__name__ or "Math" in type(out.grad_fn).__name__, out.grad_fn
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, **keywords))  # torch's kernel ran
    d_out = torch.randn(out.shape, generator=gen).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    window = (-1, -1)
    want = oracle(
        *leaves,
        scale=keywords.get("scale"),
        causal=keywords.get("is_causal", False),
        window=window,
        attn_mask=keywords.get("attn_mask"),
    )
    assert rel_err(out, want) < TOLERANCE[dtype]
    for got, expected in zip(grads, torch.autograd.grad(want, leaves, d_out.double())):
        assert rel_err(got, expected) < 4 * TOLERANCE[dtype]


def test_cpu_route_is_logged_and_reference_block_still_runs_the_reference(caplog):
    from cudnn_attn.runtime import prepared

    gen = torch.Generator().manual_seed(22)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=gen) for _ in range(3))  # a geometry no other test uses
    torch_kernel._said.discard(torch_reasons.ON_CPU)
    with caplog.at_level(logging.INFO, logger="cudnn_attn"):
        cudnn_attn.sdpa(q, k, v, is_causal=True)
        cudnn_attn.sdpa(q, k, v, is_causal=True)
    said = [r.getMessage() for r in caplog.records if "torch's CPU kernel" in r.getMessage()]
    assert len(said) == 1 and "runs on torch's SDPA kernel" in said[0], said
    problems = [p.problem for p in prepared.held()]
    with cudnn_attn.backend("reference"):
        out = cudnn_attn.sdpa(q, k, v, is_causal=True)
    added = [p.problem for p in prepared.held() if p.problem not in problems]
    assert added and all(p.q.shape == (1, 2, 40, 16) for p in added)  # the reference backend planned and ran it
    assert rel_err(out, oracle(q, k, v, causal=True)) < TOLERANCE[torch.float32]
    assert torch_reasons.choices(on_gpu=False)["float16/bfloat16"].startswith("torch's kernel (torch's CPU kernel")


def test_score_terms_still_run_on_the_reference_on_the_cpu():
    gen = torch.Generator().manual_seed(23)
    q, k, v = (torch.randn(1, 2, 12, 16, generator=gen) for _ in range(3))
    out = cudnn_attn.sdpa(q, k, v, softcap=4.0)
    assert type(out.grad_fn).__name__ != "ScaledDotProductFlashAttentionForCpuBackward0"
    assert rel_err(out, oracle(q, k, v, softcap=4.0)) < TOLERANCE[torch.float32]


def test_a_packed_backward_that_cannot_run_is_refused_at_the_forward(monkeypatch):
    """A call that needs gradients prepares its backward with its forward's first run of a
    geometry: a backward the backend refuses (by name: injected here) is refused there, not
    after the forward; a later call's backward finds its plan prepared."""
    from cudnn_attn import varlen

    gen = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(10, 2, 16, generator=gen).requires_grad_() for _ in range(3))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    prepared = []
    original = varlen._backward_run

    def refusing(*args, **kwargs):
        prepared.append(args)
        raise cudnn_attn.UnsupportedError(["sink_token in a ragged (THD) backward: refused (injected)"])

    monkeypatch.setattr(varlen, "_backward_run", refusing)
    sinks = torch.randn(2, generator=gen).requires_grad_()
    with pytest.raises(cudnn_attn.UnsupportedError, match="injected"):
        cudnn_attn.varlen_sdpa(q, k, v, cu, cu, 6, 6, causal=True, sinks=sinks, window_size=(3, 0))
    assert len(prepared) == 1
    with torch.no_grad():  # no gradients: no backward to prepare
        cudnn_attn.varlen_sdpa(q, k, v, cu, cu, 6, 6, causal=True, sinks=sinks, window_size=(3, 0))
    monkeypatch.setattr(varlen, "_backward_run", original)
    out = cudnn_attn.varlen_sdpa(q, k, v, cu, cu, 6, 6, causal=True, sinks=sinks, window_size=(4, 0))
    out.sum().backward()
    assert q.grad is not None and sinks.grad is not None
