"""Issue 42, fidelity: what torch's SDPA and nn layers take is taken, and every mistake is answered
with the library's own error, naming the argument (all problems of a call at once)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import TOLERANCE, rel_err

import cudnn_attn
from cudnn_attn.nn import Attention

F = torch.nn.functional


def _inputs(shapes, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() for s in shapes]


def _against_torch(shapes, dtype, **kw):
    """cudnn_attn.sdpa and torch's SDPA (float64) on the same inputs: outputs and gradients."""
    q, k, v = _inputs(shapes, dtype)
    out = cudnn_attn.sdpa(q, k, v, **kw)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    mask = kw.pop("attn_mask", None)
    mask = mask.double() if mask is not None and mask.is_floating_point() else mask
    expected = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask, **kw)
    expected_grads = torch.autograd.grad(expected, (q64, k64, v64), d_out.double())
    tol = TOLERANCE[dtype] * (10 if dtype != torch.float64 else 1)
    assert rel_err(out, expected) < tol
    for name, got, want in zip("qkv", grads, expected_grads):
        assert rel_err(got, want) < tol, name


def _oracle(q, k, v, sinks=None, softcap=None, window_size=(-1, -1), is_causal=False):
    """The documented meaning of sinks, softcap and window_size (rows without keys give 0)."""
    length, keys = q.shape[-2], k.shape[-2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i, j = torch.arange(length)[:, None], torch.arange(keys)[None]
    keep = torch.ones(length, keys, dtype=torch.bool)
    left, right = window_size
    if is_causal:
        keep &= j <= i
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype).view(-1, 1, 1).expand(*s.shape[:-1], 1)], -1)
    top = s.amax(-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isinf(top), torch.zeros_like(top), top))
    total = e.sum(-1, keepdim=True)
    p = torch.where(total > 0, e / total.clamp_min(1e-300), torch.zeros_like(e))
    return (p[..., :-1] if sinks is not None else p) @ v


def _against_oracle(dtype, lengths, **kw):
    q, k, v = _inputs([(2, 4, lengths[0], 16), (2, 4, lengths[1], 16), (2, 4, lengths[1], 16)], dtype)
    leaves = [q, k, v]
    if kw.get("sinks") is not None:
        kw["sinks"] = torch.randn(4, dtype=torch.float32, generator=torch.Generator().manual_seed(2))
        kw["sinks"].requires_grad_()
        leaves.append(kw["sinks"])
    out = cudnn_attn.sdpa(q, k, v, **kw)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    grads = torch.autograd.grad(out, leaves, d_out)
    wide = [t.detach().double().requires_grad_() for t in leaves]
    expected = _oracle(*wide[:3], **{**kw, **({"sinks": wide[3]} if len(wide) > 3 else {})})
    expected_grads = torch.autograd.grad(expected, wide, d_out.double())
    tol = TOLERANCE[dtype] * (10 if dtype != torch.float64 else 1)
    assert out.dtype == dtype and rel_err(out, expected) < tol
    for i, (got, want) in enumerate(zip(grads, expected_grads)):
        # sinks are float32 logits whatever q's dtype: their gradient has float32's precision
        assert rel_err(got, want) < (tol if i < 3 else max(tol, TOLERANCE[torch.float32] * 10)), i


# ---- item 8: window_size and nn.Attention arguments ---------------------------------------------


def test_window_size_none_is_no_window():
    q, k, v = _inputs([(2, 4, 8, 16)] * 3, torch.float32)
    assert torch.equal(cudnn_attn.sdpa(q, k, v, window_size=None), cudnn_attn.sdpa(q, k, v))
    # Any negative bound is none, as FlashAttention reads it: (-2, 0) is causal, (-5, -7) full.
    assert rel_err(cudnn_attn.sdpa(q, k, v, window_size=(-2, 0)), cudnn_attn.sdpa(q, k, v, is_causal=True)) < 1e-6
    assert torch.equal(cudnn_attn.sdpa(q, k, v, window_size=(-5, -7)), cudnn_attn.sdpa(q, k, v))


@pytest.mark.parametrize("bad", [5, (1, 2, 3), (1.0, 0), "(1, 0)", (-2,)], ids=repr)
def test_window_size_not_a_pair_is_named(bad):
    q, k, v = _inputs([(2, 4, 8, 16)] * 3, torch.float32)
    with pytest.raises(cudnn_attn.ValidationError, match="window_size"):
        cudnn_attn.sdpa(q, k, v, window_size=bad)


@pytest.mark.parametrize(
    "args, kwargs, named",
    [
        ((128, 0), {}, "num_heads"),
        (("128", 4), {}, "embed_dim"),
        ((128, 4.0), {}, "num_heads"),
        ((128, -4), {}, "num_heads"),
        ((128, 4), {"num_kv_heads": 0}, "num_kv_heads"),
        ((128, 4), {"num_kv_heads": 3}, "num_kv_heads"),
        ((128, 3), {}, "num_heads"),
        ((128, 4), {"dropout": 1.5}, "dropout"),
        ((128, 4), {"dropout": -0.1}, "dropout"),
        ((128, 4), {"softcap": -1.0}, "softcap"),
    ],
    ids=lambda x: repr(x),
)
def test_attention_construction_refuses_by_name(args, kwargs, named):
    with pytest.raises(cudnn_attn.ValidationError, match=f"Attention: {named}:"):
        Attention(*args, **kwargs)


def test_attention_construction_lists_every_problem():
    with pytest.raises(cudnn_attn.ValidationError) as info:
        Attention(128, 0, num_kv_heads=-1, dropout=2.0)
    assert {p.split(":")[0] for p in info.value.problems} == {"num_heads", "num_kv_heads", "dropout"}


@pytest.mark.parametrize(
    "x, named",
    [
        (torch.randn(2, 16, 64), "shape"),
        (torch.randn(16), "shape"),
        (torch.randn(2, 16, 128, dtype=torch.float64), "dtype"),
        (np.zeros((2, 16, 128), np.float32), "ndarray"),
    ],
    ids=["last-dim", "1-D", "dtype", "numpy"],
)
def test_attention_forward_refuses_bad_input_by_name(x, named):
    layer = Attention(128, 4, num_kv_heads=2, causal=True)
    with pytest.raises(cudnn_attn.ValidationError, match=f"Attention: x: .*{named}"):
        layer(x)


def test_attention_takes_unbatched_input_as_multihead_attention_does():
    torch.manual_seed(0)
    layer = Attention(64, 4, num_kv_heads=2, causal=True)
    x = torch.randn(10, 64, requires_grad=True)
    y = layer(x)
    assert y.shape == (10, 64)
    assert rel_err(y, layer(x.unsqueeze(0)).squeeze(0)) < 1e-6
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


# ---- item 9: what torch's SDPA takes on the CPU --------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("head_dim", [1, 12, 20])
def test_head_dims_off_multiples_of_8_run_on_the_cpu(dtype, head_dim):
    _against_torch(
        [(2, 4, 9, head_dim), (2, 2, 7, head_dim), (2, 2, 7, head_dim)], dtype, is_causal=True, enable_gqa=True
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("lengths", [(0, 7), (5, 0), (0, 0)], ids=lambda x: f"L{x[0]}-S{x[1]}")
@pytest.mark.parametrize("is_causal", [False, True])
def test_empty_query_or_keys_match_torch(dtype, lengths, is_causal):
    l, s = lengths  # noqa: E741
    q, k, v = _inputs([(2, 4, l, 16), (2, 4, s, 16), (2, 4, s, 16)], dtype)
    out = cudnn_attn.sdpa(q, k, v, is_causal=is_causal)
    expected = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=is_causal)
    assert out.shape == expected.shape and out.dtype == dtype and torch.equal(out, expected)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    for g, t in zip(grads, (q, k, v)):  # torch's gradients: zeros of the inputs' shapes
        assert g.shape == t.shape and not g.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("mask", ["bool", "float"])
def test_is_causal_beside_attn_mask_applies_both_as_torch(dtype, mask):
    gen = torch.Generator().manual_seed(3)
    attn_mask = torch.rand(7, 9, generator=gen) > 0.3 if mask == "bool" else torch.randn(2, 1, 7, 9, generator=gen)
    _against_torch(
        [(2, 4, 7, 16), (2, 4, 9, 16), (2, 4, 9, 16)],
        dtype,
        attn_mask=attn_mask.to(torch.bool if mask == "bool" else dtype),
        is_causal=True,
    )


@pytest.mark.parametrize(
    "terms",
    [
        {"sinks": True},
        {"softcap": 5.0},
        {"window_size": (2, 0)},
        {"sinks": True, "softcap": 3.0, "window_size": (3, 1)},
    ],
    ids=repr,
)
def test_float64_runs_with_sinks_softcap_and_window(terms):
    _against_oracle(torch.float64, (9, 9), **terms)


def test_float64_refusal_no_longer_offers_fp8_to_sdpa():
    # Graph's message for a dtype no op takes names float64 among the allowed and FP8 as sdpa_fp8's.
    q = torch.randn(1, 2, 8, 16).to(torch.int32)
    with pytest.raises(cudnn_attn.ValidationError) as info:
        with cudnn_attn.Graph() as g:
            g.sdpa(q, q, q)
    assert "float64" in str(info.value)


# ---- item 10: windows with more queries than keys; softcap beside a right bound --------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("window", [(2, 0), (1, 1), (-1, 0), (3, -1)], ids=repr)
def test_window_with_more_queries_than_keys_runs_top_left(dtype, window):
    _against_oracle(dtype, (12, 5), window_size=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [(4, 4), (-1, 2), (2, 3)], ids=repr)
def test_softcap_beside_a_right_bound_runs(dtype, window):
    _against_oracle(dtype, (9, 7), softcap=3.0, window_size=window)


# ---- item 13: one ValidationError listing every problem --------------------------------------


def test_every_independent_problem_in_one_error():
    bf = torch.bfloat16
    q, k = torch.randn(2, 8, 64, 32, dtype=bf), torch.randn(3, 3, 64, 16, dtype=bf)
    with pytest.raises(cudnn_attn.ValidationError) as info:
        cudnn_attn.sdpa(q, k, k, attn_mask=torch.ones(5, 5, dtype=torch.bool), dropout_p=1.5)
    text = "\n".join(info.value.problems)
    for named in ("dropout_p", "key: 3 heads", "key: batch [3]", "key: head dim", "attn_mask: shape"):
        assert named in text, named


def test_quickstart_mistake_lists_heads_and_head_dim():
    q = torch.randn(2, 8, 128, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 4, 128, 32, dtype=torch.bfloat16)
    with pytest.raises(cudnn_attn.ValidationError) as info:
        cudnn_attn.sdpa(q, k, k)
    text = str(info.value)
    assert "4 heads differ from query's 8" in text and "head dim 32 differs from query's 64" in text


# --- 9 (ranks). Any rank torch takes: [L, E], [H, L, E], [N, ..., H, L, E] -----------------------

RANKS = {
    "2-D": ((8, 16), (12, 16), {}),
    "2-D-causal": ((8, 16), (8, 16), {"is_causal": True}),
    "5-D": ((2, 3, 4, 8, 16), (2, 3, 4, 8, 16), {"is_causal": True}),
    "5-D-gqa": ((2, 3, 4, 8, 16), (2, 3, 2, 8, 16), {"enable_gqa": True}),
    "5-D-mask": ((2, 3, 4, 8, 16), (2, 3, 4, 8, 16), {"attn_mask": (3, 4, 8, 8)}),
    "6-D": ((2, 1, 2, 2, 8, 16), (2, 1, 2, 2, 8, 16), {}),
}


@pytest.mark.parametrize("block", ["auto", "reference"])
@pytest.mark.parametrize("case", RANKS.values(), ids=RANKS.keys())
def test_any_rank_torch_takes_runs_with_its_gradients(case, block):
    q_shape, kv_shape, keywords = case
    gen = torch.Generator().manual_seed(len(q_shape) * 7 + len(keywords))
    q = torch.randn(q_shape, generator=gen).requires_grad_()
    k, v = (torch.randn(kv_shape, generator=gen).requires_grad_() for _ in range(2))
    keywords = dict(keywords)
    if "attn_mask" in keywords:
        keywords["attn_mask"] = torch.randn(keywords["attn_mask"], generator=gen)
    with cudnn_attn.backend(block):
        out = cudnn_attn.sdpa(q, k, v, **keywords)
    want = F.scaled_dot_product_attention(q, k, v, **keywords)
    assert out.shape == want.shape
    assert rel_err(out, want) < TOLERANCE[torch.float32]
    d_out = torch.randn(want.shape, generator=gen)
    for got, expected in zip(torch.autograd.grad(out, (q, k, v), d_out), torch.autograd.grad(want, (q, k, v), d_out)):
        assert rel_err(got, expected) < TOLERANCE[torch.float32]


def test_any_rank_takes_score_terms_per_row_of_its_batch():
    """A 5-D call with a window is the 4-D call of its flattened batch, reshaped back."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 4, 8, 16, generator=gen) for _ in range(3))
    out = cudnn_attn.sdpa(q, k, v, window_size=(2, 0), softcap=5.0)
    flat = cudnn_attn.sdpa(*(t.reshape(6, 4, 8, 16) for t in (q, k, v)), window_size=(2, 0), softcap=5.0)
    assert torch.equal(out, flat.reshape(2, 3, 4, 8, 16))


def test_batch_dims_that_differ_are_named():
    q, k = torch.randn(2, 3, 4, 8, 16), torch.randn(2, 2, 4, 8, 16)
    with pytest.raises(cudnn_attn.ValidationError, match=r"key: batch \[2, 2\] differs from query's \[2, 3\]"):
        cudnn_attn.sdpa(q, k, k)
