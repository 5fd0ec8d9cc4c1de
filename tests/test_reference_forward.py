"""The reference backend's forward, through the Graph API, against the naive float64 oracle
and against torch's own scaled_dot_product_attention where the two overlap."""

from __future__ import annotations

import math

import oracle
import pytest
import torch
from conftest import REFERENCE_TOL, poisoned, randn, rel_err, split_options

import cudnn_attn


def make_layout(b, h, s, d, layout, dtype, generator):
    """A logical [B, H, S, D] tensor stored as ``layout`` (BHSD, BSHD or SBHD)."""
    if layout == "BHSD":
        return randn(b, h, s, d, dtype=dtype, generator=generator)
    if layout == "BSHD":
        return randn(b, s, h, d, dtype=dtype, generator=generator).transpose(1, 2)
    if layout == "SBHD":
        return randn(s, b, h, d, dtype=dtype, generator=generator).permute(1, 2, 0, 3)
    raise ValueError(layout)


CASES = {
    # id: (b, h_q, h_kv, s_q, s_kv, d_qk, d_v, options)
    "plain": (2, 4, 4, 16, 16, 64, 64, {}),
    "odd-sizes": (1, 2, 2, 13, 21, 32, 32, {}),
    "dqk-ne-dv": (2, 4, 4, 16, 16, 64, 32, {}),
    "gqa": (2, 4, 2, 16, 16, 32, 32, {}),
    "mqa": (2, 4, 1, 16, 24, 32, 32, {}),
    "causal": (2, 4, 4, 16, 16, 32, 32, {"use_causal_mask": True}),
    "causal-rect": (2, 2, 2, 12, 20, 32, 32, {"use_causal_mask": True}),
    "causal-br": (2, 2, 2, 12, 20, 32, 32, {"use_causal_mask_bottom_right": True}),
    "window": (2, 2, 2, 16, 16, 32, 32, {"use_causal_mask": True, "sliding_window_length": 5}),
    "window-br": (2, 2, 2, 10, 16, 32, 32, {"use_causal_mask_bottom_right": True, "sliding_window_length": 4}),
    "window-only": (1, 2, 2, 16, 16, 32, 32, {"sliding_window_length": 3}),
    "alibi": (2, 4, 4, 16, 16, 32, 32, {"use_causal_mask": True, "use_alibi_mask": True}),
    "alibi-6-heads": (1, 6, 6, 8, 8, 32, 32, {"use_causal_mask": True, "use_alibi_mask": True}),
    "padding": (3, 2, 2, 16, 16, 32, 32, {"padding": ([16, 9, 1], [16, 5, 12])}),
    "padding-causal": (3, 2, 2, 16, 16, 32, 32, {"padding": ([16, 9, 4], [16, 5, 12]), "use_causal_mask": True}),
    "padding-causal-br": (
        3,
        2,
        2,
        16,
        16,
        32,
        32,
        {"padding": ([6, 9, 4], [16, 11, 12]), "use_causal_mask_bottom_right": True},
    ),
    "padding-empty-seq": (2, 2, 2, 8, 8, 32, 32, {"padding": ([8, 0], [8, 0])}),
    "bias-full": (2, 4, 4, 16, 16, 32, 32, {"bias": (2, 4, 16, 16)}),
    "bias-1hss": (2, 4, 4, 16, 16, 32, 32, {"bias": (1, 4, 16, 16)}),
    "bias-b11s": (2, 4, 4, 16, 16, 32, 32, {"bias": (2, 1, 1, 16)}),
    "bias-causal": (2, 4, 4, 16, 16, 32, 32, {"bias": (1, 1, 16, 16), "use_causal_mask": True}),
    "scale": (1, 2, 2, 16, 16, 32, 32, {"attn_scale": 0.05}),
}


def run_case(case, layout, dtype, seed=0):
    b, h_q, h_kv, s_q, s_kv, d_qk, d_v, options = CASES[case]
    options = dict(options)
    gen = torch.Generator().manual_seed(seed)
    q = make_layout(b, h_q, s_q, d_qk, layout, dtype, gen)
    k = make_layout(b, h_kv, s_kv, d_qk, layout, dtype, gen)
    v = make_layout(b, h_kv, s_kv, d_v, layout, dtype, gen)
    kwargs, oracle_kwargs = split_options(options, dtype, gen)
    scale = options.get("attn_scale", 1 / math.sqrt(d_qk))
    causal = (
        "bottom_right"
        if options.get("use_causal_mask_bottom_right")
        else ("top_left" if options.get("use_causal_mask") else None)
    )
    with cudnn_attn.Graph(backend="reference", cache=cudnn_attn.PlanCache()) as g:
        o, stats = g.sdpa(q, k, v, generate_stats=True, **kwargs)
    out = (poisoned(o), poisoned(stats))
    inputs = [
        x
        for x in (q, k, v, kwargs.get("attn_bias"), kwargs.get("seq_len_q"), kwargs.get("seq_len_kv"))
        if x is not None
    ]
    actual_o, actual_stats = g(*inputs, out=out)
    expected_o, expected_lse = oracle.attention(
        q,
        k,
        v,
        scale=scale,
        causal=causal,
        window=options.get("sliding_window_length"),
        alibi=options.get("use_alibi_mask", False),
        **oracle_kwargs,
    )
    return actual_o, actual_stats, expected_o, expected_lse, out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", ["BHSD", "BSHD", "SBHD"])
def test_forward_matches_oracle(case, layout):
    # fp16 inputs (float32 is not an attention io type); O is rounded to fp16 on the way out,
    # stats stay float32 and are held to the reference's own tolerance.
    actual_o, actual_stats, expected_o, expected_lse, out = run_case(case, layout, torch.float16)
    assert actual_o is out[0] and actual_stats is out[1]
    assert rel_err(actual_o, expected_o) < 1e-3
    assert rel_err(actual_stats, expected_lse) < REFERENCE_TOL


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", ["plain", "gqa", "causal-br", "padding-causal", "alibi", "bias-1hss"])
def test_forward_half_precision_inputs(case, dtype):
    # The oracle sees the same (half-precision) inputs; only the output rounding differs.
    actual_o, actual_stats, expected_o, expected_lse, _ = run_case(case, "BSHD", dtype, seed=1)
    assert actual_o.dtype == dtype
    assert rel_err(actual_o, expected_o) < {torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert rel_err(actual_stats, expected_lse) < REFERENCE_TOL


def test_fully_masked_rows_are_zero_with_minus_inf_stats():
    _, _, _, _, (o, stats) = run_case("padding-empty-seq", "BHSD", torch.float16)
    assert torch.equal(o[1], torch.zeros_like(o[1]))
    assert torch.isneginf(stats[1]).all()
    assert not torch.isnan(o).any()


def _torch_sdpa(q, k, v, **kwargs):
    return torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kwargs)


@pytest.mark.parametrize(
    "h_kv,causal,use_bias,scale",
    [
        (4, False, False, None),
        (4, True, False, None),
        (2, True, False, 0.3),
        (1, False, True, None),
        (4, True, True, 0.1),
    ],
    ids=["mha", "causal", "gqa-causal-scale", "mqa-bias", "causal-bias-scale"],
)
def test_forward_matches_torch_sdpa(h_kv, causal, use_bias, scale):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (
        randn(2, 4, 24, 32, generator=gen),
        randn(2, h_kv, 24, 32, generator=gen),
        randn(2, h_kv, 24, 32, generator=gen),
    )
    bias = randn(1, 4, 24, 24, generator=gen) if use_bias else None
    with cudnn_attn.Graph(backend="reference") as g:
        g.sdpa(q, k, v, attn_bias=bias, use_causal_mask=causal, attn_scale=scale)
    actual = g(*[x for x in (q, k, v, bias) if x is not None])
    mask = bias.double() if bias is not None else None
    if causal and bias is not None:
        tril = torch.ones(24, 24, dtype=torch.bool).tril()
        mask = mask.masked_fill(~tril, float("-inf"))
    expected = _torch_sdpa(
        q, k, v, attn_mask=mask, is_causal=causal and bias is None, scale=scale, enable_gqa=h_kv != 4
    )
    assert rel_err(actual, expected) < 8e-3  # bf16 output rounding


def test_float64_reference_is_tighter():
    """The oracle-grade mode: the reference in float64 agrees with the naive oracle to ~1e-12."""
    from cudnn_attn.ops.reference.backend import ReferenceBackend

    gen = torch.Generator().manual_seed(4)
    q, k, v = (randn(1, 2, 10, 16, dtype=torch.float16, generator=gen) for _ in range(3))
    with cudnn_attn.Graph(backend="reference") as g:
        g.sdpa(q, k, v, use_causal_mask=True, generate_stats=True)
    plan = ReferenceBackend(torch.float64).build(g.problems[0])
    o64, stats = torch.empty(1, 2, 10, 16, dtype=torch.float64), torch.empty(1, 2, 10, 1, dtype=torch.float64)
    plan({"q": q.double(), "k": k.double(), "v": v.double()}, {"o": o64, "stats": stats})
    expected, _ = oracle.attention(q, k, v, scale=1 / 4, causal="top_left")
    assert rel_err(o64, expected) < 1e-12
