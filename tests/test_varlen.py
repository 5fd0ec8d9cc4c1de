"""``varlen_sdpa`` on the reference backend: values and gradients against per-sequence float64
attention, the checks on ``cu_seqlens``, and the bounded number of plans a run builds."""

from __future__ import annotations

import numpy as np
import oracle
import pytest
import torch
from conftest import randn, rel_err

import cudnn_attn
from cudnn_attn.errors import ValidationError
from cudnn_attn.varlen import varlen_attention


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def per_sequence(q, k, v, cu_q, cu_k, *, scale, causal=None, window=None):
    """float64 attention of each packed sequence on its own, packed back ([T_q, H, D_v]).
    Differentiable in q, k, v; tokens past the last sequence get zeros."""
    h_q, h_kv = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape[0], h_q, v.shape[-1], dtype=torch.float64)
    parts = []
    for b in range(cu_q.numel() - 1):
        (sq, eq), (sk, ek) = (int(cu_q[b]), int(cu_q[b + 1])), (int(cu_k[b]), int(cu_k[b + 1]))
        if eq == sq:
            continue
        qb = q[sq:eq].double().transpose(0, 1)[None]
        kb, vb = (x[sk:ek].double().transpose(0, 1)[None] for x in (k, v))
        if ek == sk:  # no keys: every row is fully masked, O = 0
            parts.append((sq, eq, torch.zeros(eq - sq, h_q, v.shape[-1], dtype=torch.float64)))
            continue
        allowed = oracle.allowed_matrix(1, eq - sq, ek - sk, causal=causal, window=window)
        ob = oracle.attention_autograd(qb, kb.expand(1, h_kv, -1, -1), vb, scale=scale, allowed=allowed)
        parts.append((sq, eq, ob[0].transpose(0, 1)))
    rows = [torch.zeros(0, h_q, v.shape[-1], dtype=torch.float64)]
    at = 0
    for start, end, part in parts:
        rows += [out[at:start], part]
        at = end
    rows.append(out[at:])
    return torch.cat(rows)


def packed(lengths_q, lengths_k, h=4, h_kv=4, d=32, d_v=None, extra=0, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    t_q, t_k = sum(lengths_q) + extra, sum(lengths_k) + extra
    q = randn(t_q, h, d, dtype=dtype, generator=gen)
    k = randn(t_k, h_kv, d, dtype=dtype, generator=gen)
    v = randn(t_k, h_kv, d_v or d, dtype=dtype, generator=gen)
    return q, k, v, cu(lengths_q), cu(lengths_k)


CASES = {
    "full": dict(),
    "causal": dict(is_causal=True),
    "gqa-causal": dict(is_causal=True, h_kv=2),
    "dv": dict(d_v=16),
    "window-causal": dict(is_causal=True, window_size=(3, 0)),
    "window-right-0": dict(window_size=(2, 0)),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_values_and_gradients_match_each_sequence_alone(case):
    options = dict(CASES[case])
    h_kv, d_v = options.pop("h_kv", 4), options.pop("d_v", None)
    lengths = [5, 12, 1, 9]
    q, k, v, cu_q, cu_k = packed(lengths, lengths, h_kv=h_kv, d_v=d_v, seed=hash(case) % 100)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = cudnn_attn.varlen_sdpa(*leaves, cu_q, cu_k, 12, 12, enable_gqa=h_kv != 4, **options)
    assert out.shape == (q.shape[0], 4, v.shape[-1]) and out.dtype == q.dtype
    left, right = options.get("window_size", (-1, -1))
    causal = "top_left" if options.get("is_causal") or right == 0 else None
    window = left + 1 if left >= 0 else None
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    expected = per_sequence(*ref_leaves, cu_q, cu_k, scale=32**-0.5, causal=causal, window=window)
    assert rel_err(out, expected) < 1e-2
    d_out = randn(*out.shape, generator=torch.Generator().manual_seed(5))
    out.backward(d_out)
    expected.backward(d_out.double())
    for got, want in zip(leaves, ref_leaves):
        assert rel_err(got.grad, want.grad) < 2e-2


def test_queries_and_keys_of_different_lengths_bottom_right():
    """The internal door's bottom-right alignment: each sequence's last query sees its last
    key (decoding with a cache); a sequence with no keys gives zeros."""
    lengths_q, lengths_k = [1, 3, 2], [6, 3, 0]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, seed=3)
    out = varlen_attention(q, k, v, cu_q, cu_k, 3, 6, causal="bottom_right")
    expected = per_sequence(q, k, v, cu_q, cu_k, scale=32**-0.5, causal="bottom_right")
    assert rel_err(out, expected) < 1e-2
    assert out[4:].abs().sum() == 0  # the third sequence has no keys


def test_flash_attention_reads_any_negative_window_bound_as_none_and_a_numpy_zero_softcap_as_off():
    """(-2, 0), (-5, -5) and softcap=np.float32(0) were refused; FlashAttention takes them."""
    import numpy as np

    q, k, v, cu, _ = packed([5, 7], [5, 7], seed=6)
    call = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7, max_seqlen_k=7)
    causal = cudnn_attn.varlen_sdpa(q, k, v, causal=True, **call)
    full = cudnn_attn.varlen_sdpa(q, k, v, **call)
    assert torch.equal(cudnn_attn.varlen_sdpa(q, k, v, window_size=(-2, 0), **call), causal)
    assert torch.equal(cudnn_attn.varlen_sdpa(q, k, v, window_size=(-5, -5), **call), full)
    assert torch.equal(cudnn_attn.varlen_sdpa(q, k, v, softcap=np.float32(0.0), **call), full)
    assert rel_err(full, per_sequence(q, k, v, cu, cu, scale=32**-0.5)) < 1e-2
    nested = torch.nested.nested_tensor([torch.randn(5, 4, 32), torch.randn(7, 4, 32)], layout=torch.jagged)
    with pytest.raises(ValidationError, match="q: a nested tensor; varlen takes packed"):
        cudnn_attn.varlen_sdpa(nested, k, v, **call)


def test_tokens_past_the_last_sequence_are_zero_and_unread():
    q, k, v, cu_q, cu_k = packed([4, 7], [4, 7], extra=5, seed=4)
    q[-5:], k[-5:], v[-5:] = float("nan"), float("nan"), float("nan")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = cudnn_attn.varlen_sdpa(*leaves, cu_q, cu_k, 7, 7, is_causal=True)
    assert torch.isfinite(out).all() and out[-5:].abs().sum() == 0
    out.sum().backward()
    for leaf in leaves:
        assert torch.isfinite(leaf.grad).all() and leaf.grad[-5:].abs().sum() == 0


def test_matches_dense_attention_when_every_sequence_is_full():
    q, k, v, cu_q, cu_k = packed([8, 8, 8], [8, 8, 8], seed=6)
    out = cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, 8, 8, is_causal=True)
    dense = [x.view(3, 8, 4, 32).transpose(1, 2) for x in (q, k, v)]
    expected = cudnn_attn.sdpa(*dense, is_causal=True).transpose(1, 2).reshape(24, 4, 32)
    assert rel_err(out, expected) < 1e-2


BAD = {
    "start": (lambda c: torch.tensor([1, 5, 9], dtype=torch.int32), "cu_seqlens_q: starts at 1"),
    "decreasing": (lambda c: torch.tensor([0, 6, 5], dtype=torch.int32), "cu_seqlens_q: decreases at index 2"),
    "past-end": (lambda c: torch.tensor([0, 5, 40], dtype=torch.int32), "cu_seqlens_q: ends at 40, past the"),
    "dtype": (lambda c: c.float(), "cu_seqlens_q: dtype float32; expected int32"),
    "shape": (lambda c: c[:1], r"cu_seqlens_q: shape \[1\]"),
    "device": (lambda c: c.to("meta"), "cu_seqlens_q: on meta; must be on q's device"),
    "too-long": (lambda c: torch.tensor([0, 2, 11], dtype=torch.int32), "sequence 1 has length 9, above max_seqlen 8"),
    "batch": (lambda c: torch.tensor([0, 2, 5, 9], dtype=torch.int32), "cu_seqlens_k: 2 sequences, cu_seqlens_q has 3"),
}


@pytest.mark.parametrize("bad", BAD, ids=list(BAD))
def test_bad_cu_seqlens_are_refused_naming_the_argument(bad):
    q, k, v, cu_q, cu_k = packed([4, 5], [4, 5], seed=7)
    make, message = BAD[bad]
    with pytest.raises(ValidationError, match=message):
        cudnn_attn.varlen_sdpa(q, k, v, make(cu_q), cu_k, 8, 8)


def test_other_bad_arguments_are_named():
    q, k, v, cu_q, cu_k = packed([4, 5], [4, 5], h_kv=2, seed=8)
    with pytest.raises(ValidationError, match="k: 3 heads do not divide q's 4"):  # GQA is inferred when they divide
        cudnn_attn.varlen_sdpa(q, k[:, :1].expand(-1, 3, -1), v[:, :1].expand(-1, 3, -1), cu_q, cu_k, 8, 8)
    with pytest.raises(ValidationError, match="max_seqlen_k: -1; must be an int >= 0"):
        cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, 8, -1, enable_gqa=True)
    with pytest.raises(ValidationError, match="cu_seqlens_k: sequence 1 has length 5, above max_seqlen 0"):
        cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, 8, 0, enable_gqa=True)
    with pytest.raises(ValidationError, match="cu_seqlens_q: ends at 9, past the 0 packed tokens"):
        cudnn_attn.varlen_sdpa(q[:0], k, v, cu_q, cu_k, 8, 8, enable_gqa=True)
    with pytest.raises(ValidationError, match="q: a sparse_coo tensor; expected a dense one"):
        cudnn_attn.varlen_sdpa(q.to_sparse(), k, v, cu_q, cu_k, 8, 8, enable_gqa=True)
    with pytest.raises(ValidationError, match="q: shape"):
        cudnn_attn.varlen_sdpa(q[None], k, v, cu_q, cu_k, 8, 8, enable_gqa=True)
    with pytest.raises(ValidationError, match="window_size"):
        cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, 8, 8, enable_gqa=True, window_size=(-2,))
    with pytest.raises(ValidationError, match="window_size"):  # right bounds run (FlashAttention's band)
        cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, 8, 8, enable_gqa=True, window_size=(4, 3.0))


def test_random_packings_build_a_bounded_number_of_plans():
    """Plans depend on the bucketed batch size and longest length, not on the packing: 200
    random packings of 1-8 sequences of length 1-64 build at most 4 x 3 forward and as many
    backward plans."""
    cache = cudnn_attn.default_cache()  # varlen plans through it
    cache.clear()  # counters too
    gen = torch.Generator().manual_seed(9)
    for _ in range(200):
        batch = int(torch.randint(1, 9, (1,), generator=gen))
        lengths = torch.randint(1, 65, (batch,), generator=gen).tolist()
        q, k, v, cu_q, cu_k = packed(lengths, lengths, h=2, h_kv=2, d=16, seed=int(torch.randint(0, 99, (1,))))
        q.requires_grad_()
        longest = max(lengths)
        cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, longest, longest, is_causal=True).sum().backward()
    # Batch buckets 1, 2, 4, 8; length buckets 16, 32, 64; a forward and a backward plan each.
    assert cache.stats()["size"] <= 2 * 4 * 3
    assert cache.stats()["misses"] == cache.stats()["size"]


def test_views_of_one_packed_projection_are_separate_inputs():
    """q, k and v as views of one [T, 3, H, D] projection (shared storage, strided tokens)."""
    gen = torch.Generator().manual_seed(12)
    qkv = randn(21, 3, 4, 32, generator=gen).requires_grad_()
    q, k, v = qkv.unbind(1)
    cu_q = cu([9, 12])
    out = cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_q, 12, 12, is_causal=True)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = per_sequence(*leaves, cu_q, cu_q, scale=32**-0.5, causal="top_left")
    assert rel_err(out, want) < 1e-2
    out.sum().backward()
    want.sum().backward()
    assert rel_err(qkv.grad, torch.stack([x.grad for x in leaves], 1)) < 2e-2


def test_a_side_without_tokens_gives_flash_attentions_zeros():
    """Every sequence without keys, and k, v holding exactly those 0 tokens (FlashAttention's
    total_k = 0): zeros, and zero gradients; a batch without query tokens: empty outputs. Both
    were refused ("no tokens") unless a padding row was added."""
    q = torch.randn(5, 2, 16, requires_grad=True)
    none = torch.zeros(0, 2, 16, requires_grad=True)
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    out = cudnn_attn.varlen_sdpa(q, none, none, cu_q, cu_k, 3, 0)
    assert out.shape == q.shape and torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and none.grad.shape == none.shape
    out, lse = cudnn_attn.varlen_sdpa(q[:0], q, q, cu_k, cu_q, 0, 3, return_lse=True)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)


def test_a_window_bound_past_any_sequence_is_no_bound():
    """FlashAttention reads a bound past S_kv as none; one past int64 raised an OverflowError."""
    q, k, v, cu_q, cu_k = packed([4, 5], [4, 5], seed=9)
    for huge, none in (((10**30, 0), (-1, 0)), ((0, 10**30), (0, -1)), ((10**30, 10**30), (-1, -1))):
        got = cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, 8, 8, window_size=huge)
        assert torch.equal(got, cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, 8, 8, window_size=none)), huge


def test_numpy_dropout_and_the_callers_names_under_the_torch_backend():
    q, k, v, cu_q, cu_k = packed([4, 5], [4, 5], seed=10)
    found = []
    for p in (np.float32(0.25), 0.25):  # the same dropout under the same seed
        torch.manual_seed(5)
        found.append(cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, 8, 8, dropout_p=p))
    assert torch.equal(*found) and not torch.equal(found[0], cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, 8, 8))
    with cudnn_attn.backend("torch"), pytest.raises(cudnn_attn.UnsupportedError) as refused:
        cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, 8, 8, sinks=torch.zeros(q.shape[1]), softcap=2.0)
    said = str(refused.value)
    assert all(name in said for name in ("cu_seqlens_q/cu_seqlens_k:", "softcap:", "sinks:")), said
    assert not any(name in said for name in ("use_padding_mask", "score_mod", "sink_token")), said
