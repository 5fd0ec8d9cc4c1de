"""Fuzzing the builder: any request either runs (and matches the oracle) or raises a
ValidationError/UnsupportedError; nothing else escapes."""

from __future__ import annotations

import oracle
import torch
from conftest import rel_err
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import cudnn_attn

dims = st.integers(min_value=0, max_value=5)


@st.composite
def requests(draw):
    b, h = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 4]))
    h_kv = draw(st.sampled_from([1, 2, 2, 4, 4, 3]))
    s_q, s_kv = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    d = draw(st.sampled_from([8, 16, 16, 8, 12]))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16] * 4 + [torch.float32]))
    rank = draw(st.sampled_from([4] * 8 + [3, 2]))
    shape_q = (b, h, s_q, d)[-rank:] if rank < 4 else (b, h, s_q, d)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(*shape_q, generator=gen).to(dtype)
    k = torch.randn(b, h_kv, s_kv, d, generator=gen).to(dtype)
    v = torch.randn(b, h_kv, s_kv, d, generator=gen).to(draw(st.sampled_from([dtype] * 6 + [torch.float16])))
    options = {}
    if draw(st.integers(0, 4)) == 0:
        options["use_causal_mask"] = True
    if draw(st.integers(0, 4)) == 0:
        options["use_causal_mask_bottom_right"] = True
    if draw(st.integers(0, 4)) == 0:
        options["sliding_window_length"] = draw(st.integers(0, 4))
    if draw(st.integers(0, 4)) == 0:
        options["use_alibi_mask"] = True
    if draw(st.integers(0, 4)) == 0:
        options["dropout"] = draw(st.sampled_from([0.0, 0.2, 0.2, 1.0, -0.5]))
    if draw(st.integers(0, 4)) == 0:
        options["attn_bias"] = torch.randn(
            draw(st.sampled_from([1, b])),
            draw(st.sampled_from([1, h, 3])),
            draw(st.sampled_from([1, s_q])),
            draw(st.sampled_from([s_kv, 1])),
            generator=gen,
        ).to(dtype)
    if draw(st.integers(0, 4)) == 0:
        options.update(
            use_padding_mask=True,
            seq_len_q=torch.randint(-1, s_q + 2, (b,), generator=gen, dtype=torch.int32),
            seq_len_kv=torch.randint(0, s_kv + 1, (b,), generator=gen, dtype=torch.int32),
        )
    if draw(st.integers(0, 4)) == 0:
        options["attn_scale"] = draw(st.sampled_from([0.1, 0.3, float("inf"), "x", None]))
    return q, k, v, options


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_requests_run_correctly_or_raise_a_library_error(request):
    q, k, v, options = request
    try:
        with cudnn_attn.Graph(backend="reference", cache=cudnn_attn.PlanCache()) as g:
            g.sdpa(q, k, v, generate_stats=True, **options)
    except (cudnn_attn.ValidationError, cudnn_attn.UnsupportedError) as error:
        assert error.problems and all(isinstance(p, str) and p for p in error.problems)
        event(f"refused: {type(error).__name__}")
        return
    event("ran")
    inputs = [
        x
        for x in (q, k, v, options.get("attn_bias"), options.get("seq_len_q"), options.get("seq_len_kv"))
        if x is not None
    ]
    out, stats = g(*inputs)
    assert not torch.isnan(out).any()
    if options.get("dropout"):
        return  # the mask is checked elsewhere; here only that it runs
    causal = (
        "bottom_right"
        if options.get("use_causal_mask_bottom_right")
        else ("top_left" if options.get("use_causal_mask") else None)
    )
    expected, _ = oracle.attention(
        q,
        k,
        v,
        scale=options.get("attn_scale") or q.shape[-1] ** -0.5,
        causal=causal,
        window=options.get("sliding_window_length"),
        seq_q=options.get("seq_len_q"),
        seq_kv=options.get("seq_len_kv"),
        bias=options.get("attn_bias"),
        alibi=options.get("use_alibi_mask", False),
    )
    assert rel_err(out, expected) < 1.6e-2
