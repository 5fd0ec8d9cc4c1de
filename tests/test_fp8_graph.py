"""FP8 graph ops (``g.sdpa_fp8``, ``g.sdpa_fp8_backward``) on the reference backend: the
frontend's positional order and outputs, validation naming each scale, the emulation's exact
results through a graph, and accuracy against float64 attention of the dequantised inputs."""

from __future__ import annotations

import pytest
import torch

import cudnn_attn
from cudnn_attn.errors import ValidationError
from cudnn_attn.ops.reference import fp8 as reference_fp8

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


def _scale(x: torch.Tensor, dtype=E4M3) -> torch.Tensor:
    """Current scaling: the scale that maps ``x``'s amax to the format's largest value."""
    return (reference_fp8.fp8_max(dtype) / x.abs().max().float()).reshape(1, 1, 1, 1)


def _quantised(x: torch.Tensor, dtype=E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    scale = _scale(x, dtype)
    return reference_fp8.quantise(x.float(), scale, dtype), 1.0 / scale


def _problem(b=2, h=4, h_kv=4, s=48, d=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=gen)
    k, v = (torch.randn(b, h_kv, s, d, generator=gen) for _ in range(2))
    return q, k, v


def _forward_scales(q, k, v, causal=False):
    """Every forward input: FP8 q/k/v with descales, P's fixed scale, O's scale from a float estimate."""
    (q8, dq), (k8, dk), (v8, dv) = (_quantised(x) for x in (q, k, v))
    scale_s = torch.full((1, 1, 1, 1), 448.0)
    estimate = torch.nn.functional.scaled_dot_product_attention(
        q8.float() * dq, k8.float() * dk, v8.float() * dv, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1]
    )
    return (q8, k8, v8, dq, dk, dv, 1.0 / scale_s, scale_s, _scale(estimate)), estimate


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("h_kv", [4, 1], ids=["mha", "mqa"])
def test_forward_is_the_emulation_and_within_fp8_error(causal, h_kv):
    q, k, v = _problem(h_kv=h_kv)
    args, estimate = _forward_scales(q, k, v, causal)
    with cudnn_attn.Graph() as g:
        o, stats, amax_s, amax_o = g.sdpa_fp8(*args, generate_stats=True, use_causal_mask=causal)
    assert [h.name for h in g.outputs] == ["O", "Stats", "Amax_S", "Amax_O"]
    assert o.spec.dtype == E4M3 and amax_s.spec.shape == (1, 1, 1, 1) and amax_s.spec.dtype == torch.float32
    assert [h.name for h in g.inputs] == [
        "q",
        "k",
        "v",
        "descale_q",
        "descale_k",
        "descale_v",
        "descale_s",
        "scale_s",
        "scale_o",
    ]
    out, st, a_s, a_o = g(*args)

    allowed = torch.ones(48, 48).tril().bool() if causal else None
    expected = reference_fp8.forward_fp8(
        *(x.float() if x.dtype == E4M3 else x for x in args),
        allowed=allowed,
        attn_scale=32**-0.5,
        out_dtype=E4M3,
        p_dtype=E4M3,
    )
    for got, want in zip((out, st, a_s, a_o), expected):
        assert torch.equal(got.float(), want.float())
    scale_o = args[8]
    relative = float((out.float() / scale_o - estimate).norm() / estimate.norm())
    assert relative < 0.06  # the bound for random normal inputs with per-tensor scales


def test_backward_is_the_emulation_and_close_to_float64_gradients():
    q, k, v = _problem(seed=3)
    fwd_args, _ = _forward_scales(q, k, v, causal=True)
    q8, k8, v8, dq_, dk_, dv_, descale_s, scale_s, scale_o = fwd_args
    with cudnn_attn.Graph() as g:
        g.sdpa_fp8(*fwd_args, generate_stats=True, use_causal_mask=True)
    o8, stats, _, _ = g(*fwd_args)
    d_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(9))
    do8, descale_do = _quantised(d_out, E5M2)
    descale_o = 1.0 / scale_o
    # The gradients' scales, from float64 gradients of the dequantised inputs.
    leaves = [(x8.double() * s.double()).requires_grad_() for x8, s in ((q8, dq_), (k8, dk_), (v8, dv_))]
    ref_out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
    grads = torch.autograd.grad(ref_out, leaves, (do8.double() * descale_do.double()))
    scale_dp = torch.full((1, 1, 1, 1), 2.0**10)  # dS is small: scaled up into E5M2's range
    scales = (
        dq_,
        dk_,
        dv_,
        descale_o,
        descale_do,
        descale_s,
        1.0 / scale_dp,
        scale_s,
        *(_scale(gr, E4M3).float() for gr in grads),
        scale_dp,
    )
    with cudnn_attn.Graph() as g:
        outs = g.sdpa_fp8_backward(q8, k8, v8, o8, do8, stats, *scales, use_causal_mask=True)
    assert [h.name for h in outs] == ["dQ", "dK", "dV", "Amax_dQ", "Amax_dK", "Amax_dV", "Amax_dP"]
    got = g(q8, k8, v8, o8, do8, stats, *scales)
    allowed = torch.ones(48, 48).tril().bool()
    expected = reference_fp8.backward_fp8(
        q8.float(),
        k8.float(),
        v8.float(),
        o8.float(),
        do8.float(),
        stats,
        *scales,
        allowed=allowed,
        attn_scale=32**-0.5,
        grad_dtype=E4M3,
        p_dtype=E4M3,
        ds_dtype=E5M2,
    )
    for a, b in zip(got, expected):
        assert torch.equal(a.float(), b.float())
    for grad8, scale, want in zip(got[:3], scales[8:11], grads):
        relative = float((grad8.double() / scale.double() - want).norm() / want.norm())
        assert relative < 0.12


def test_scales_are_validated_by_name():
    q, k, v = _problem()
    args, _ = _forward_scales(q, k, v)
    bad = list(args)
    bad[3] = bad[3].double()  # descale_q
    bad[7] = torch.ones(1)  # scale_s: not [1, 1, 1, 1]
    with pytest.raises(ValidationError) as error:
        with cudnn_attn.Graph() as g:
            g.sdpa_fp8(*bad)
    lines = error.value.problems
    assert any(line.startswith("descale_q:") and "float32 [1, 1, 1, 1]" in line for line in lines)
    assert any(line.startswith("scale_s:") for line in lines)
    with pytest.raises(ValidationError, match="descale_k: missing"):
        with cudnn_attn.Graph() as g:
            g.sdpa_fp8(*args[:4], None, *args[5:])


def test_fp8_data_goes_through_the_fp8_ops_and_16_bit_data_through_sdpa():
    q, k, v = _problem()
    args, _ = _forward_scales(q, k, v)
    with pytest.raises(ValidationError, match=r"q: dtype float8_e4m3fn: .*g\.sdpa_fp8"):
        with cudnn_attn.Graph() as g:
            g.sdpa(*args[:3])
    half = [x.to(torch.bfloat16) for x in (q, k, v)]
    with pytest.raises(ValidationError, match="q: dtype bfloat16; sdpa_fp8 takes"):
        with cudnn_attn.Graph() as g:
            g.sdpa_fp8(*half, *args[3:])


def test_a_repeated_fp8_recording_adopts_its_build():
    cache = cudnn_attn.PlanCache()
    q, k, v = _problem()
    results = []
    for _ in range(2):
        args, _ = _forward_scales(q, k, v)
        with cudnn_attn.Graph(cache=cache) as g:
            g.sdpa_fp8(*args)
        results.append(g(*args))
    assert len(cache.recorded) == 1
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(*results))


def test_amaxes_not_asked_for_are_not_computed():
    q, k, v = _problem()
    args, estimate = _forward_scales(q, k, v)
    with cudnn_attn.Graph() as g:
        o, _, amax_s, amax_o = g.sdpa_fp8(*args)
        amax_s.set_output(False)
    assert g.problems[0].amax_s is None and [h.name for h in g.outputs] == ["O", "Amax_O"]
    out, amax = g(*args)
    with cudnn_attn.Graph() as full:
        full.sdpa_fp8(*args)
    expected_out, _, expected_amax = full(*args)
    assert torch.equal(out.float(), expected_out.float()) and torch.equal(amax, expected_amax)


def test_the_fp8_ops_take_their_own_band_spellings():
    """The frontend's sdpa_fp8 spells the band left_bound / right_bound / sliding_window (and takes
    fn=None): the same graph as sdpa's spellings, on the same inputs."""
    q, k, v = _problem(seed=3)
    args, _ = _forward_scales(q, k, v, causal=True)
    results = []
    for keywords in (
        dict(diagonal_band_left_bound=8, diagonal_band_right_bound=0),
        dict(left_bound=8, right_bound=0, fn=None),
        dict(sliding_window=8, right_bound=0),
    ):
        with cudnn_attn.Graph() as g:
            g.sdpa_fp8(*args, generate_stats=True, **keywords)
        assert g.problems[0].options.sliding_window == 8 and g.problems[0].options.causal.value == "top_left"
        results.append(g(*args)[0].float())
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    with pytest.raises(cudnn_attn.ValidationError, match="left_bound"):
        with cudnn_attn.Graph() as g:
            g.sdpa_fp8(*args, left_bound=8, diagonal_band_left_bound=8)
