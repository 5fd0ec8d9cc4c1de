"""``varlen_sdpa`` as FlashAttention's ``flash_attn_varlen_func``: its keywords and positional order,
its log-sum-exp, grouped-query attention inferred from head counts, and conflicting spellings.

Every value is checked against float64 attention computed here, sequence by sequence, with the
mask written out: FlashAttention's ``causal`` aligned bottom-right, torch's ``is_causal`` top-left.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import randn, rel_err

import cudnn_attn
from cudnn_attn.errors import UnsupportedError, ValidationError
from cudnn_attn.runtime import prepared

TOL = 2e-2  # bf16 inputs and outputs against float64
LSE_TOL = 1e-5  # the log-sum-exp is float32, from the same bf16 inputs as the oracle


def cu(lengths, device="cpu"):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def packed(lengths_q, lengths_k, h=4, h_kv=4, d=32, seed=0, extra=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = randn(sum(lengths_q) + extra, h, d, generator=gen, device=device)
    k = randn(sum(lengths_k), h_kv, d, generator=gen, device=device)
    v = randn(sum(lengths_k), h_kv, d, generator=gen, device=device)
    return q, k, v, cu(lengths_q, device), cu(lengths_k, device)


def oracle(q, k, v, cu_q, cu_k, *, scale=None, align=None, window=(-1, -1), softcap=None, sinks=None):
    """float64 attention of each sequence on its own: ``(out [T_q, H, D_v], lse [H, T_q])``.
    ``align``: None, "top_left" or "bottom_right" (the causal mask's diagonal); the window is
    measured from that diagonal. K/V heads are repeated for GQA. Differentiable in q, k, v."""
    h, h_kv = q.shape[1], k.shape[1]
    q64 = q.double()
    k64, v64 = (x.double().repeat_interleave(h // h_kv, dim=1) for x in (k, v))
    scale = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    outs, lses, at = [], [], 0
    for b in range(cu_q.numel() - 1):
        (sq, eq), (sk, ek) = (int(cu_q[b]), int(cu_q[b + 1])), (int(cu_k[b]), int(cu_k[b + 1]))
        n_q, n_k = eq - sq, ek - sk
        s = torch.einsum("qhd,khd->hqk", q64[sq:eq], k64[sk:ek]) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
        diag = i + (n_k - n_q if align == "bottom_right" else 0)
        keep = torch.ones(n_q, n_k, dtype=torch.bool)
        if align is not None:
            keep &= j <= diag
        if window[0] >= 0:
            keep &= j >= diag - window[0]
        if window[1] >= 0:
            keep &= j <= diag + window[1]
        s = s.masked_fill(~keep, -math.inf)
        if sinks is not None:  # a logit per head in every denominator, weighing no value
            s = torch.cat([s, sinks.double().view(h, 1, 1).expand(h, n_q, 1)], dim=-1)
        lse = torch.logsumexp(s, dim=-1)  # [H, n_q]; -inf where nothing is kept
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
        p = p[..., :n_k]
        outs.append(torch.einsum("hqk,khd->qhd", p, v64[sk:ek]))
        lses.append(lse)
        at = eq
    rest = q.shape[0] - at  # tokens no sequence covers: zero rows, -inf
    outs.append(torch.zeros(rest, h, v.shape[-1], dtype=torch.float64))
    lses.append(torch.full((h, rest), -math.inf, dtype=torch.float64))
    return torch.cat(outs), torch.cat(lses, dim=1)


# Unequal lengths (fewer queries than keys, as with a prefix cache), so the alignments differ.
LENGTHS_Q, LENGTHS_K = [3, 5, 4], [7, 5, 9]


def test_causal_is_flash_attentions_bottom_right_and_is_causal_torchs_top_left():
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K, seed=1)
    fa = cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, 5, 9, causal=True)
    torch_form = cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, 5, 9, is_causal=True)
    assert rel_err(fa, oracle(q, k, v, cu_q, cu_k, align="bottom_right")[0]) < TOL
    assert rel_err(torch_form, oracle(q, k, v, cu_q, cu_k, align="top_left")[0]) < TOL
    assert rel_err(fa, torch_form) > 0.1  # the two masks differ here, and each was honoured


def test_causal_on_equal_lengths_is_is_causal():
    q, k, v, cu_q, _ = packed([6, 3, 7], [6, 3, 7], seed=2)
    fa = cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_q.clone(), 7, 7, causal=True)
    assert torch.equal(fa, cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_q, 7, 7, is_causal=True))
    assert rel_err(fa, oracle(q, k, v, cu_q, cu_q, align="top_left")[0]) < TOL


ALIASES = {  # FlashAttention's spelling, torch's spelling, the oracle's options
    "softmax_scale": (dict(softmax_scale=0.3), dict(scale=0.3), dict(scale=0.3)),
    "softcap-0-is-off": (dict(softcap=0.0), dict(softcap=None), dict()),
    "softcap": (dict(softcap=2.0, causal=True), dict(softcap=2.0, is_causal=True), dict(softcap=2.0, align="top_left")),
    "window": (dict(causal=True, window_size=(2, 0)), dict(window_size=(2, 0)), dict(align="top_left", window=(2, 0))),
    "causal-false": (dict(causal=False), dict(is_causal=False), dict()),
}


@pytest.mark.parametrize("case", ALIASES, ids=list(ALIASES))
def test_each_flash_attention_keyword_matches_its_torch_name(case):
    fa_kw, torch_kw, expected = ALIASES[case]
    q, k, v, cu_q, _ = packed([5, 8, 2], [5, 8, 2], seed=3)
    fa = cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_q, 8, 8, **fa_kw)
    assert torch.equal(fa, cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_q, 8, 8, **torch_kw))
    assert rel_err(fa, oracle(q, k, v, cu_q, cu_q, **expected)[0]) < TOL


def test_positional_call_in_flash_attentions_order():
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K, seed=4)
    # (q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, window_size, softcap,
    #  alibi_slopes, deterministic, return_attn_probs, block_table)
    out, lse, probs = cudnn_attn.varlen_sdpa(
        q, k, v, cu_q, cu_k, 5, 9, 0.0, 0.25, True, (3, 0), 0.0, None, False, True, None
    )
    expected, expected_lse = oracle(q, k, v, cu_q, cu_k, scale=0.25, align="bottom_right", window=(3, 0))
    assert probs is None
    assert rel_err(out, expected) < TOL
    assert rel_err(lse, expected_lse) < LSE_TOL


def test_positional_dropout_p_is_dropout():
    q, k, v, cu_q, _ = packed([6, 10], [6, 10], seed=5)
    torch.manual_seed(0)
    first = cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_q, 10, 10, 0.5)
    torch.manual_seed(0)
    again = cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_q, 10, 10, dropout_p=0.5)
    assert torch.equal(first, again)
    assert rel_err(first, cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_q, 10, 10)) > 0.1


LSE_CASES = {
    "plain": dict(),
    "causal-bottom-right": dict(causal=True),
    "is-causal": dict(is_causal=True),
    "scale": dict(softmax_scale=0.7),
    "softcap": dict(softcap=1.5),
    "window": dict(is_causal=True, window_size=(3, 0)),
    "gqa": dict(h_kv=2, causal=True),
    "sinks": dict(sinks=True),
}
ORACLE_OPTIONS = {
    "causal": ("align", "bottom_right"),
    "is_causal": ("align", "top_left"),
    "softmax_scale": ("scale", None),
    "softcap": ("softcap", None),
    "window_size": ("window", None),
}


@pytest.mark.parametrize("case", LSE_CASES, ids=list(LSE_CASES))
@pytest.mark.parametrize("flag", ["return_lse", "return_attn_probs"])
def test_the_log_sum_exp_is_float64s_per_token(case, flag):
    options = dict(LSE_CASES[case])
    h_kv = options.pop("h_kv", 4)
    # a sequence with no queries, one with no keys, and tokens past the last sequence
    q, k, v, cu_q, cu_k = packed([3, 0, 5, 2], [7, 4, 9, 0], h_kv=h_kv, seed=6, extra=2)
    expected = {}
    for name, value in options.items():
        if name == "sinks":
            options["sinks"] = expected["sinks"] = torch.randn(4, generator=torch.Generator().manual_seed(9))
            continue
        key, fixed = ORACLE_OPTIONS[name]
        expected[key] = fixed if fixed is not None else value
    got = cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, 5, 9, **options, **{flag: True})
    assert len(got) == (3 if flag == "return_attn_probs" else 2)
    out, lse = got[0], got[1]
    expected_out, expected_lse = oracle(q, k, v, cu_q, cu_k, **expected)
    assert lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32
    assert rel_err(lse, expected_lse) < LSE_TOL  # -inf exactly where no key is seen
    assert rel_err(out, expected_out) < TOL


def test_the_log_sum_exp_is_the_same_when_training_and_not_differentiable():
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K, seed=7)
    _, lse = cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, 5, 9, causal=True, return_lse=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse_train = cudnn_attn.varlen_sdpa(*leaves, cu_q, cu_k, 5, 9, causal=True, return_lse=True)
    assert torch.equal(lse, lse_train)
    assert out.requires_grad and not lse_train.requires_grad
    out.float().square().sum().backward()  # the backward still runs with the extra output
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)


@pytest.mark.parametrize("groups", [2, 4])
def test_grouped_query_attention_is_inferred_from_head_counts(groups):
    h = 8
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K, h=h, h_kv=h // groups, seed=8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cudnn_attn.varlen_sdpa(*leaves, cu_q, cu_k, 5, 9, causal=True)
    torch.manual_seed(1)
    d_out = torch.randn(out.shape, dtype=torch.float64)
    out.double().mul(d_out).sum().backward()
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    expected, _ = oracle(*leaves64, cu_q, cu_k, align="bottom_right")
    expected.mul(d_out).sum().backward()
    assert rel_err(out, expected) < TOL
    for got, want in zip(leaves, leaves64):
        assert rel_err(got.grad, want.grad) < 3e-2
    flagged = cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, 5, 9, causal=True, enable_gqa=True)
    assert torch.equal(flagged, out.detach())  # the torch flag still accepted, same result


CONFLICTS = {
    "scale": (dict(softmax_scale=0.1, scale=0.2), ["softmax_scale: 0.1", "scale: 0.2"]),
    "causal": (dict(causal=True, is_causal=False), ["causal: True", "is_causal: False"]),
    "causal-both": (dict(causal=True, is_causal=True), ["causal: True", "is_causal: True"]),
    "flag-type": (dict(deterministic="yes"), ["deterministic: 'yes'; expected True or False"]),
}


@pytest.mark.parametrize("case", CONFLICTS, ids=list(CONFLICTS))
def test_conflicting_spellings_are_refused_naming_both(case):
    kwargs, phrases = CONFLICTS[case]
    q, k, v, cu_q, _ = packed([4, 4], [4, 4], seed=9)
    with pytest.raises(ValidationError) as raised:
        cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_q, 4, 4, **kwargs)
    for phrase in phrases:
        assert phrase in str(raised.value)


def test_agreeing_spellings_are_accepted():
    q, k, v, cu_q, _ = packed([4, 4], [4, 4], seed=10)
    one = cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_q, 4, 4, scale=0.2)
    both = cudnn_attn.varlen_sdpa(
        q, k, v, cu_q, cu_q, 4, 4, softmax_scale=0.2, scale=0.2, causal=False, is_causal=False
    )
    assert torch.equal(one, both)


UNSUPPORTED = {
    "alibi_slopes": (dict(alibi_slopes=torch.ones(4)), "alibi_slopes: cuDNN's ALiBi takes no slopes tensor"),
    "block_table": (dict(block_table=torch.zeros(2, 1, dtype=torch.int32)), "block_table: paged K/V caches"),
}


@pytest.mark.parametrize("case", UNSUPPORTED, ids=list(UNSUPPORTED))
def test_what_cudnn_cannot_take_says_why(case):
    kwargs, phrase = UNSUPPORTED[case]
    q, k, v, cu_q, _ = packed([4, 4], [4, 4], seed=11)
    with pytest.raises(UnsupportedError, match=phrase):
        cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_q, 4, 4, **kwargs)


def _backward_problems():
    return [run.problem for run in prepared.held() if run.problem.op.name == "BACKWARD" and run.problem.is_thd]


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_reaches_the_backward(deterministic):
    prepared.clear()
    q, k, v, cu_q, _ = packed([5, 6], [5, 6], h=2, h_kv=2, d=24, seed=12)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cudnn_attn.varlen_sdpa(*leaves, cu_q, cu_q, 6, 6, causal=True, deterministic=deterministic)
    out.float().sum().backward()
    problems = _backward_problems()
    assert problems and all(p.deterministic is deterministic for p in problems)


# cuDNN: the same calls where its path differs from the reference (ragged stats, bottom-right
# alignment on ragged tensors, the deterministic backward).


# cuDNN 9.19 drops the padding mask beside a score modifier: soft-capping over packed sequences
# runs there only as causal self-attention (below); the unbounded case is refused, by name.
GPU_LSE_CASES = {name: case for name, case in LSE_CASES.items() if name != "softcap"}


@pytest.mark.gpu
def test_gpu_softcap_over_packed_sequences_is_refused_where_cudnn_would_read_past_them():
    q, k, v, cu_q, cu_k = packed([3, 5, 2], [7, 9, 4], seed=13, device="cuda")
    with pytest.raises(cudnn_attn.UnsupportedError, match="no padding mask"):
        cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, 5, 9, softcap=1.5)


@pytest.mark.gpu
def test_gpu_softcap_log_sum_exp_over_packed_self_attention_on_cudnn():
    q, k, v, cu_q, _ = packed([7, 9, 4], [7, 9, 4], seed=13, extra=2, device="cuda")
    out, lse = cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_q, 9, 9, softcap=1.5, causal=True, return_lse=True)
    expected_out, expected_lse = oracle(*(t.cpu() for t in (q, k, v, cu_q, cu_q)), softcap=1.5, align="top_left")
    assert rel_err(out, expected_out) < TOL
    assert rel_err(lse, expected_lse) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_LSE_CASES, ids=list(GPU_LSE_CASES))
def test_gpu_log_sum_exp_on_cudnn(case):
    options = dict(LSE_CASES[case])
    h_kv = options.pop("h_kv", 4)
    q, k, v, cu_q, cu_k = packed([3, 5, 2], [7, 9, 4], h_kv=h_kv, seed=13, extra=2, device="cuda")
    expected = {}
    for name, value in options.items():
        if name == "sinks":
            options["sinks"] = torch.randn(4, generator=torch.Generator().manual_seed(9)).cuda()
            expected["sinks"] = options["sinks"].cpu()
            continue
        key, fixed = ORACLE_OPTIONS[name]
        expected[key] = fixed if fixed is not None else value
    out, lse = cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, 5, 9, **options, return_lse=True)
    cpu = [t.cpu() for t in (q, k, v, cu_q, cu_k)]
    expected_out, expected_lse = oracle(*cpu, **expected)
    assert rel_err(out, expected_out) < TOL
    assert rel_err(lse, expected_lse) < 1e-3


@pytest.mark.gpu
def test_gpu_bottom_right_causal_and_gqa_with_gradients_on_cudnn():
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K, h=8, h_kv=2, seed=14, device="cuda")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cudnn_attn.varlen_sdpa(*leaves, cu_q, cu_k, 5, 9, causal=True, window_size=(4, 0))
    d_out = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out.double().mul(d_out.cuda()).sum().backward()
    leaves64 = [t.cpu().double().requires_grad_() for t in (q, k, v)]
    expected, _ = oracle(*leaves64, cu_q.cpu(), cu_k.cpu(), align="bottom_right", window=(4, 0))
    expected.mul(d_out).sum().backward()
    assert rel_err(out, expected) < TOL
    for got, want in zip(leaves, leaves64):
        assert rel_err(got.grad, want.grad) < 3e-2


@pytest.mark.gpu
def test_gpu_deterministic_backward_repeats_bit_for_bit():
    q, k, v, cu_q, _ = packed([300, 500, 212], [300, 500, 212], h=8, d=64, seed=15, device="cuda")
    grads = []
    for _ in range(3):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = cudnn_attn.varlen_sdpa(*leaves, cu_q, cu_q, 500, 500, causal=True, deterministic=True)
        out.float().square().sum().backward()
        grads.append([t.grad for t in leaves])
    for again in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], again))
