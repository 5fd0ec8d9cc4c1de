"""``cudnn_attn.sdpa`` on jagged nested tensors, against a float64 oracle run sequence by sequence."""

from __future__ import annotations

import warnings

import oracle
import pytest
import torch
from conftest import TOLERANCE, randn, rel_err

import cudnn_attn


def _sequences(lengths, heads, d, dtype, gen):
    """One fresh [H, L, D] tensor per length."""
    return [randn(heads, n, d, dtype=dtype, generator=gen) for n in lengths]


def _nested(seqs, how="list"):
    """A [B, H, (S), D] jagged leaf built from [H, L, D] sequences, and the leaf that gets the gradient."""
    tokens = [s.transpose(0, 1) for s in seqs]  # [L, H, D]
    if how == "list":
        leaf = torch.nested.nested_tensor(tokens, layout=torch.jagged, requires_grad=True)
        return leaf.transpose(1, 2), leaf
    # packed tokens and offsets with no cached max length: the longest is computed from the offsets
    values = torch.cat(tokens).requires_grad_()
    offsets = torch.tensor([0, *torch.tensor([t.shape[0] for t in tokens]).cumsum(0).tolist()])
    return torch.nested.nested_tensor_from_jagged(values, offsets).transpose(1, 2), values


def _per_sequence(grad, how, lengths):
    """The leaf's gradient as one [H, L, D] tensor per sequence."""
    packed = grad.values() if how == "list" else grad
    return [t.transpose(0, 1) for t in packed.split(list(lengths))]


def _expected(qs, ks, vs, d_os, *, scale, causal):
    """Per sequence: the oracle's output (row by row) and gradients (autograd), in float64."""
    outs, grads = [], []
    for q, k, v, d_o in zip(qs, ks, vs, d_os):
        mask = "top_left" if causal else None
        out, _ = oracle.attention(q[None], k[None], v[None], scale=scale, causal=mask)
        outs.append(out[0])
        leaves = [t[None].double().requires_grad_() for t in (q, k, v)]
        allowed = oracle.allowed_matrix(1, q.shape[1], k.shape[1], causal=mask)
        oracle.attention_autograd(*leaves, scale=scale, allowed=allowed).backward(d_o[None].double())
        grads.append([t.grad[0] for t in leaves])
    return outs, grads


def _packed(seqs):
    return torch.cat([s.transpose(0, 1) for s in seqs])


CASES = {
    # name: (q lengths, kv lengths, H, H_kv, d_qk, d_v)
    "self": ([5, 12, 1, 9], None, 4, 4, 32, 32),
    "gqa": ([5, 12, 1, 9], None, 4, 2, 32, 32),
    "mqa-dv": ([7, 1, 16], None, 4, 1, 32, 64),
    "cross": ([5, 1, 9], [11, 3, 1], 4, 4, 16, 16),
    "cross-gqa-dv": ([1, 13, 6], [8, 2, 20], 6, 2, 32, 16),
}


@pytest.mark.parametrize("how", ["list", "from_jagged"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_values_and_gradients_match_the_oracle(case, dtype, causal, how):
    lq, lkv, h, h_kv, d_qk, d_v = case
    lkv = lkv or lq
    gen = torch.Generator().manual_seed(sum(lq) * 31 + h_kv * 7 + d_v)
    qs, ks = _sequences(lq, h, d_qk, dtype, gen), _sequences(lkv, h_kv, d_qk, dtype, gen)
    vs, d_os = _sequences(lkv, h_kv, d_v, dtype, gen), _sequences(lq, h, d_v, dtype, gen)
    (q, q_leaf), (k, k_leaf), (v, v_leaf) = _nested(qs, how), _nested(ks, how), _nested(vs, how)

    out = cudnn_attn.sdpa(q, k, v, is_causal=causal, enable_gqa=h_kv != h)

    assert out.is_nested and out.layout == torch.jagged and out.dtype == dtype
    assert out.shape[:3] == q.shape[:3] and out.shape[3] == d_v  # q's ragged dim: the same offsets
    assert out.transpose(1, 2).offsets() is q.transpose(1, 2).offsets()
    expected_out, expected_grads = _expected(qs, ks, vs, d_os, scale=d_qk**-0.5, causal=causal)
    assert rel_err(out.transpose(1, 2).values(), _packed(expected_out)) < TOLERANCE[dtype]
    for got, want in zip(out.unbind(), expected_out):  # each sequence on its own, not just the whole
        assert rel_err(got, want) < TOLERANCE[dtype]

    out.transpose(1, 2).values().backward(_packed(d_os))
    for i, (leaf, lengths) in enumerate(((q_leaf, lq), (k_leaf, lkv), (v_leaf, lkv))):
        assert leaf.grad is not None
        for got, want in zip(_per_sequence(leaf.grad, how, lengths), (g[i] for g in expected_grads)):
            assert rel_err(got, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("layout", ["head-major", "qkv-view"])
def test_strided_values_give_the_same_result_and_gradients(layout):
    """Values [H, T, D] ragged at dim 2 (copied to token-major), and q/k/v as views of one packed
    [T, 3, H, D] projection (read in place), match the same numbers packed contiguously."""
    gen = torch.Generator().manual_seed(7)
    offsets = torch.tensor([0, 4, 5, 14])
    packed = randn(14, 3, 2, 16, dtype=torch.bfloat16, generator=gen)
    d_o = randn(14, 2, 16, dtype=torch.bfloat16, generator=gen)

    def run(source, views):
        out = cudnn_attn.sdpa(*views(source), is_causal=True)
        out.transpose(1, 2).values().backward(d_o)
        return out.transpose(1, 2).values(), source.grad

    def contiguous(x):
        return [torch.nested.nested_tensor_from_jagged(x[:, i].contiguous(), offsets).transpose(1, 2) for i in range(3)]

    def head_major(x):  # x: [3, H, T, D]
        return [torch.nested.nested_tensor_from_jagged(x[i], offsets, jagged_dim=2) for i in range(3)]

    def qkv_view(x):  # x: [T, 3, H, D]
        return [torch.nested.nested_tensor_from_jagged(x[:, i], offsets).transpose(1, 2) for i in range(3)]

    want_out, want_grad = run(packed.clone().requires_grad_(), contiguous)
    if layout == "head-major":
        got_out, got_grad = run(packed.permute(1, 2, 0, 3).contiguous().requires_grad_(), head_major)
        got_grad = got_grad.permute(2, 0, 1, 3)
    else:
        got_out, got_grad = run(packed.clone().requires_grad_(), qkv_view)
    assert torch.equal(got_out, want_out)
    assert torch.equal(got_grad, want_grad) and want_grad.abs().sum() > 0


def test_an_empty_query_is_refused_with_a_warm_plan_too():
    """Refused before the varlen door: the same error whether or not a plan of that geometry exists."""
    full, empty = _nt([3, 2]), _nt([0, 0])
    cudnn_attn.sdpa(full, full, full)  # a plan of this geometry now exists
    with pytest.raises(cudnn_attn.ValidationError, match="query: no tokens"):
        cudnn_attn.sdpa(empty, full, full)


def test_causal_is_top_left_per_sequence():
    """The first query of every sequence sees only its own first key: its output is that key's value."""
    gen = torch.Generator().manual_seed(3)
    lengths = [4, 1, 7]
    (q, _), (k, _), (v, _) = (_nested(_sequences(lengths, 2, 16, torch.bfloat16, gen)) for _ in range(3))
    with torch.no_grad():
        out = cudnn_attn.sdpa(q, k, v, is_causal=True)
        full = cudnn_attn.sdpa(q, k, v)
    for o, f, values in zip(out.unbind(), full.unbind(), v.unbind()):
        assert torch.equal(o[:, 0], values[:, 0])
        if values.shape[1] > 1:
            assert not torch.allclose(f[:, 0], values[:, 0], atol=1e-2)  # without the mask it mixes keys


def test_matches_torch_nested_sdpa_without_a_mask():
    """Torch's own nested SDPA (no causal mask: torch refuses one) gives the same output."""
    gen = torch.Generator().manual_seed(4)
    lengths = [6, 1, 11]
    (q, _), (k, _), (v, _) = (_nested(_sequences(lengths, 4, 32, torch.bfloat16, gen)) for _ in range(3))
    with torch.no_grad():
        ours = cudnn_attn.sdpa(q, k, v, scale=0.2)
        theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.2)
    assert rel_err(ours.transpose(1, 2).values(), theirs.transpose(1, 2).values()) < TOLERANCE[torch.bfloat16]


def test_gradient_reaches_a_shared_source_once_per_use():
    """q, k and v as views of one nested tensor (self-attention on x): x's gradient sums all three uses."""
    gen = torch.Generator().manual_seed(5)
    seqs = _sequences([3, 8, 1], 2, 16, torch.float16, gen)
    x, leaf = _nested(seqs)
    out = cudnn_attn.sdpa(x, x, x, is_causal=True)
    d_o = _sequences([3, 8, 1], 2, 16, torch.float16, gen)
    out.transpose(1, 2).values().backward(_packed(d_o))
    _, grads = _expected(seqs, seqs, seqs, d_o, scale=16**-0.5, causal=True)
    for got, want in zip(_per_sequence(leaf.grad, "list", [3, 8, 1]), grads):
        assert rel_err(got, want[0] + want[1] + want[2]) < TOLERANCE[torch.float16]


def test_dropout_is_repeatable_under_a_seed_and_drops():
    gen = torch.Generator().manual_seed(6)
    (q, _), (k, _), (v, _) = (_nested(_sequences([9, 14], 2, 16, torch.bfloat16, gen)) for _ in range(3))
    with torch.no_grad():
        torch.manual_seed(0)
        first = cudnn_attn.sdpa(q, k, v, dropout_p=0.5).transpose(1, 2).values()
        torch.manual_seed(0)
        again = cudnn_attn.sdpa(q, k, v, dropout_p=0.5).transpose(1, 2).values()
        plain = cudnn_attn.sdpa(q, k, v).transpose(1, 2).values()
    assert torch.equal(first, again)
    assert rel_err(first, plain) > 0.1


def test_a_cached_max_seqlen_below_the_real_one_is_refused():
    """The longest length comes from torch's cache; a wrong one is caught on the CPU, naming query."""
    values = randn(10, 2, 16)
    offsets = torch.tensor([0, 3, 10])
    q = torch.nested.nested_tensor_from_jagged(values, offsets, max_seqlen=4).transpose(1, 2)
    kv = torch.nested.nested_tensor_from_jagged(values, offsets).transpose(1, 2)
    with pytest.raises(cudnn_attn.ValidationError, match=r"(?m)^sdpa: query: .*above max_seqlen 4"):
        cudnn_attn.sdpa(q, kv, kv)


def _nt(lengths, heads=2, d=16, dtype=torch.bfloat16):
    return torch.nested.nested_tensor(
        [torch.randn(n, heads, d).to(dtype) for n in lengths], layout=torch.jagged
    ).transpose(1, 2)


def _bad_inputs():
    q = _nt([3, 2])
    dense = randn(2, 2, 3, 16)
    with warnings.catch_warnings():  # torch warns that the strided layout is a prototype
        warnings.simplefilter("ignore", UserWarning)
        strided = torch.nested.nested_tensor([randn(2, 3, 16), randn(2, 2, 16)])
        strided_mask = torch.nested.nested_tensor([torch.ones(3, 3, dtype=torch.bool)] * 2)
    return {
        "dense-key": ((q, dense, dense), {}, cudnn_attn.ValidationError, ["key", "value"]),
        "dense-query": ((dense, q, q), {}, cudnn_attn.ValidationError, ["query"]),
        "not-a-tensor": (([1.0], q, q), {}, cudnn_attn.ValidationError, ["query"]),
        "strided-layout": ((strided, strided, strided), {}, cudnn_attn.UnsupportedError, ["query", "key", "value"]),
        "mask": (
            (q, q, q),
            {"attn_mask": torch.ones(2, 2, 3, 3, dtype=torch.bool)},
            cudnn_attn.UnsupportedError,
            ["attn_mask"],
        ),
        "nested-mask-dense-qkv": (
            (dense, dense, dense),
            {"attn_mask": strided_mask},
            cudnn_attn.ValidationError,
            ["attn_mask"],
        ),
        "3-D": ((q.transpose(1, 2).flatten(-2), q, q), {}, cudnn_attn.ValidationError, ["query"]),
        "ragged-dim-1": ((q, q.transpose(1, 2), q), {}, cudnn_attn.ValidationError, ["key"]),
        "holes": (
            (
                torch.nested.nested_tensor_from_jagged(
                    randn(6, 2, 16), torch.tensor([0, 3, 6]), torch.tensor([2, 3])
                ).transpose(1, 2),
                q,
                q,
            ),
            {},
            cudnn_attn.UnsupportedError,
            ["query"],
        ),
        "dtype-mismatch": ((_nt([3, 2], dtype=torch.float32), q, q), {}, cudnn_attn.ValidationError, ["query"]),
        "heads-without-gqa": (
            (q, _nt([3, 2], heads=1), _nt([3, 2], heads=1)),
            {},
            cudnn_attn.ValidationError,
            ["key"],
        ),
        "head-dim": ((q, _nt([3, 2], d=32), _nt([3, 2], d=32)), {}, cudnn_attn.ValidationError, ["key"]),
        "batch": ((q, _nt([3, 2, 4]), _nt([3, 2, 4])), {}, cudnn_attn.ValidationError, ["key", "value"]),
        "kv-lengths": ((q, _nt([3, 2]), _nt([2, 3])), {}, cudnn_attn.ValidationError, ["value"]),
        "scale": ((q, q, q), {"scale": "0.5"}, cudnn_attn.ValidationError, ["scale"]),
        "dropout": ((q, q, q), {"dropout_p": 1.5}, cudnn_attn.ValidationError, ["dropout_p"]),
        "is_causal": ((q, q, q), {"is_causal": "yes"}, cudnn_attn.ValidationError, ["is_causal"]),
        "empty": ((_nt([0, 0]), q, q), {}, cudnn_attn.ValidationError, ["query"]),
    }


BAD = _bad_inputs()


@pytest.mark.parametrize("name", BAD.keys())
def test_bad_inputs_are_refused_naming_the_argument(name):
    args, kwargs, error, arguments = BAD[name]
    with pytest.raises(error) as raised:
        cudnn_attn.sdpa(*args, **kwargs)
    assert type(raised.value) is error  # not a subclass standing in for it
    named = [line.partition(":")[0] for line in raised.value.problems]
    assert sorted(set(named)) == sorted(arguments), raised.value.problems
