"""The FP8 attention emulation (cudnn_attn/ops/reference/fp8.py) against independent naive
float64 implementations of cuDNN's FP8 graph, float64 autograd of the dequantised problem,
and the algebra of its scales."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import rel_err

from cudnn_attn.ops.reference import fp8 as rf
from cudnn_attn.ops.reference import math as reference_math
from cudnn_attn.ops.reference.math import ScoreTerms

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
F64 = torch.float64


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype in (E4M3, E5M2):
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def finite_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of an fp8 format, as that format."""
    every = torch.arange(256, dtype=torch.uint8).view(dtype)
    return every[torch.isfinite(every.float())]


def fp8_input(shape, dtype, gen, scale=1.0, spread=2.0) -> torch.Tensor:
    """Random normal values (std ``spread``) times ``scale``, quantised: exact fp8 values."""
    return rf.quantise(torch.randn(*shape, generator=gen) * spread, scale, dtype)


def pow2_scale(amax: float, dtype: torch.dtype) -> float:
    """The largest power of two s with amax * s <= max finite, as cuDNN's docs suggest."""
    return 2.0 ** math.floor(math.log2(rf.fp8_max(dtype) / amax))


def q64(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Saturating quantise, written independently, back in float64."""
    if dtype in (E4M3, E5M2):
        m = {E4M3: 448.0, E5M2: 57344.0}[dtype]
        return torch.clamp(x * scale, -m, m).to(dtype).to(F64)
    return (x * scale).to(dtype).to(F64)


# ---- independent float64 implementations, one (batch, head) at a time ---------------------


def naive_forward(q, k, v, sc, *, attn_scale, allowed=None, keep=None, dropout_p=0.0, p_dtype, out_dtype):
    """cuDNN's FP8 forward graph, head by head, in float64. ``sc``: dict of python floats."""
    b, h, s_q, _ = q.shape
    hk, hv = k.shape[1], v.shape[1]
    o = torch.zeros(b, h, s_q, v.shape[-1], dtype=F64)
    stats = torch.zeros(b, h, s_q, 1, dtype=F64)
    amax_s = amax_o = 0.0
    for bi in range(b):
        for hi in range(h):
            qh, kh, vh = q[bi, hi].to(F64), k[bi, hi // (h // hk)].to(F64), v[bi, hi // (h // hv)].to(F64)
            s = qh @ kh.T * attn_scale * sc["dq"] * sc["dk"]
            if allowed is not None:
                s = s.masked_fill(~allowed.expand(b, h, s_q, kh.shape[0])[bi, hi], -math.inf)
            p = torch.softmax(s, -1).nan_to_num(0.0)
            stats[bi, hi, :, 0] = torch.logsumexp(s, -1)
            if keep is not None:
                p = p * keep[bi, hi].to(F64) * (1.0 / (1.0 - dropout_p))
            amax_s = max(amax_s, p.abs().max().item())
            out = q64(p, sc["ss"], p_dtype) @ vh * sc["ds"] * sc["dv"]
            amax_o = max(amax_o, out.abs().max().item())
            o[bi, hi] = out
    return q64(o, sc["so"], out_dtype).to(out_dtype), stats, amax_s, amax_o


def naive_forward_online(q, k, v, sc, *, attn_scale, block, p_dtype):
    """cudnn-frontend's test/python/sdpa/fp8_ref.py forward loop (rescale threshold 0), float64;
    returns O before scale_o."""
    b, h, s_q, _ = q.shape
    o = torch.zeros(b, h, s_q, v.shape[-1], dtype=F64)
    for bi in range(b):
        for hi in range(h):
            qh, kh, vh = q[bi, hi].to(F64), k[bi, hi].to(F64), v[bi, hi].to(F64)
            m = torch.full((s_q, 1), -math.inf, dtype=F64)
            ell = torch.zeros(s_q, 1, dtype=F64)
            acc = torch.zeros(s_q, vh.shape[-1], dtype=F64)
            for j in range(0, kh.shape[0], block):
                s = qh @ kh[j : j + block].T * sc["dq"] * sc["dk"] * attn_scale
                m_new = torch.where(torch.isneginf(m), s.max(-1, keepdim=True).values, m)
                m_new = torch.maximum(m_new, s.max(-1, keepdim=True).values)
                corr = torch.exp(m - m_new).nan_to_num()
                corr = torch.where(m - m_new < 0, corr, torch.ones_like(corr))
                acc, ell = acc * corr, ell * corr
                p = torch.exp(s - m_new).nan_to_num()
                ell = ell + p.sum(-1, keepdim=True)
                acc = acc + q64(p, sc["ss"], p_dtype) @ vh[j : j + block] * sc["dv"] * sc["ds"]
                m = m_new
            o[bi, hi] = acc / ell.clamp(min=1.0)
    return o


def naive_backward(
    q, k, v, o, d_o, stats, sc, *, attn_scale, allowed=None, keep=None, dropout_p=0.0, p_dtype, ds_dtype, grad_dtype
):
    """cuDNN's FP8 backward graph, head by head, in float64."""
    b, h, s_q, _ = q.shape
    hk, hv = k.shape[1], v.shape[1]
    dq = torch.zeros(q.shape, dtype=F64)
    dk = torch.zeros(k.shape, dtype=F64)
    dv = torch.zeros(v.shape, dtype=F64)
    amax_dp = amax_dq = 0.0
    for bi in range(b):
        for hi in range(h):
            ki, vi = hi // (h // hk), hi // (h // hv)
            qh, kh, vh = q[bi, hi].to(F64), k[bi, ki].to(F64), v[bi, vi].to(F64)
            oh, doh = o[bi, hi].to(F64), d_o[bi, hi].to(F64)
            big_d = (doh * oh).sum(-1, keepdim=True) * sc["ddo"] * sc["do"]
            s = qh @ kh.T * attn_scale * sc["dq"] * sc["dk"]
            if allowed is not None:
                s = s.masked_fill(~allowed.expand(b, h, s_q, kh.shape[0])[bi, hi], -math.inf)
            lse = stats[bi, hi].to(F64)
            p = torch.exp(s - lse.nan_to_num(neginf=0.0)).masked_fill(torch.isneginf(s), 0.0)
            z = keep[bi, hi].to(F64) * (1.0 / (1.0 - dropout_p)) if keep is not None else None
            p8 = q64(p * z if z is not None else p, sc["ss"], p_dtype)
            dv[bi, vi] += p8.T @ doh
            d_p = doh @ vh.T * sc["ddo"] * sc["dv"]
            d_s = ((d_p * z if z is not None else d_p) - big_d) * p * attn_scale
            amax_dp = max(amax_dp, d_s.abs().max().item())
            ds8 = q64(d_s, sc["sdp"], ds_dtype)
            dqh = ds8 @ kh * sc["ddp"] * sc["dk"]
            amax_dq = max(amax_dq, dqh.abs().max().item())
            dq[bi, hi] = dqh
            dk[bi, ki] += ds8.T @ qh
    dk = dk * sc["ddp"] * sc["dq"]
    dv = dv * sc["ds"] * sc["ddo"]
    outs = [q64(x, sc[name], grad_dtype).to(grad_dtype) for x, name in ((dq, "sdq"), (dk, "sdk"), (dv, "sdv"))]
    return (*outs, amax_dq, dk.abs().max().item(), dv.abs().max().item(), amax_dp)


# ---- cases --------------------------------------------------------------------------------


def causal(s_q: int, s_kv: int) -> torch.Tensor:
    return torch.ones(s_q, s_kv, dtype=torch.bool).tril().view(1, 1, s_q, s_kv)


def with_empty_rows(b, s_q, s_kv) -> torch.Tensor:
    allowed = torch.ones(b, 1, s_q, s_kv, dtype=torch.bool)
    allowed[0, :, 3:6] = False  # fully masked rows
    allowed[-1, :, :, s_kv - 3 :] = False  # padded keys
    return allowed


CASES = {
    # id: (b, h, h_kv, s_q, s_kv, d, in_dtype, do_dtype, out_dtype, mask, dropout_p)
    "plain": (2, 2, 2, 12, 16, 16, E4M3, E4M3, E4M3, None, 0.0),
    "causal": (1, 2, 2, 16, 16, 16, E4M3, E4M3, E4M3, "causal", 0.0),
    "gqa": (2, 4, 2, 10, 12, 16, E4M3, E4M3, E4M3, None, 0.0),
    "mqa-causal": (1, 4, 1, 12, 12, 8, E4M3, E4M3, E4M3, "causal", 0.0),
    "empty-rows": (2, 2, 2, 10, 12, 16, E4M3, E4M3, E4M3, "empty", 0.0),
    "dropout": (2, 2, 2, 12, 12, 16, E4M3, E4M3, E4M3, "causal", 0.5),
    "e5m2": (1, 2, 2, 12, 12, 16, E5M2, E5M2, E5M2, None, 0.0),
    "hybrid-out-e5m2": (1, 2, 1, 12, 16, 16, E4M3, E5M2, E5M2, "causal", 0.0),
    "out-bf16": (1, 2, 2, 12, 12, 16, E4M3, E4M3, torch.bfloat16, None, 0.0),
}


def make_case(case_id, seed=0):
    b, h, hkv, s_q, s_kv, d, in_dt, do_dt, out_dt, mask, dropout_p = CASES[case_id]
    gen = torch.Generator().manual_seed(seed)
    q = fp8_input((b, h, s_q, d), in_dt, gen)
    k = fp8_input((b, hkv, s_kv, d), in_dt, gen)
    v = fp8_input((b, hkv, s_kv, d), in_dt, gen)
    d_o = fp8_input((b, h, s_q, d), do_dt, gen)
    allowed = {None: None, "causal": causal(s_q, s_kv), "empty": with_empty_rows(b, s_q, s_kv)}[mask]
    keep = torch.rand(b, h, s_q, s_kv, generator=gen) >= dropout_p if dropout_p else None
    return dict(q=q, k=k, v=v, d_o=d_o, allowed=allowed, keep=keep, dropout_p=dropout_p, out_dtype=out_dt)


# Power-of-two scales: every descale/scale product is exact.
FWD_SCALES = {"dq": 0.5, "dk": 0.25, "dv": 2.0, "ds": 1 / 256, "ss": 256.0, "so": 4.0}
BWD_SCALES = {**FWD_SCALES, "do": 0.25, "ddo": 0.5, "ddp": 1 / 64, "sdp": 64.0, "sdq": 8.0, "sdk": 2.0, "sdv": 0.5}
ATTN_SCALE = 0.125


def run_forward(c, sc, **kw):
    return rf.forward_fp8(
        c["q"],
        c["k"],
        c["v"],
        sc["dq"],
        sc["dk"],
        sc["dv"],
        sc["ds"],
        sc["ss"],
        sc["so"],
        attn_scale=ATTN_SCALE,
        allowed=c["allowed"],
        keep=c["keep"],
        dropout_p=c["dropout_p"],
        out_dtype=c["out_dtype"],
        **kw,
    )


def run_backward(c, o, stats, sc, **kw):
    return rf.backward_fp8(
        c["q"],
        c["k"],
        c["v"],
        o,
        c["d_o"],
        stats,
        sc["dq"],
        sc["dk"],
        sc["dv"],
        sc["do"],
        sc["ddo"],
        sc["ds"],
        sc["ddp"],
        sc["ss"],
        sc["sdq"],
        sc["sdk"],
        sc["sdv"],
        sc["sdp"],
        attn_scale=ATTN_SCALE,
        allowed=c["allowed"],
        keep=c["keep"],
        dropout_p=c["dropout_p"],
        **kw,
    )


def forward_o_for_backward(c, sc):
    """The forward's O as the backward reads it (fp8 in the inputs' format) and its stats."""
    o, stats, _, _ = run_forward({**c, "out_dtype": c["q"].dtype}, sc, compute_dtype=F64)
    return o, stats


# ---- quantise / dequantise ------------------------------------------------------------------


def test_fp8_max():
    assert rf.fp8_max(E4M3) == 448.0 == torch.finfo(E4M3).max
    assert rf.fp8_max(E5M2) == 57344.0 == torch.finfo(E5M2).max
    with pytest.raises(ValueError):
        rf.fp8_max(torch.bfloat16)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantise_saturates(dtype):
    m = rf.fp8_max(dtype)
    x = torch.tensor([m, m * 1.01, m * 2, 1e30, math.inf, -m * 3, -math.inf, math.nan])
    got = rf.quantise(x, 1.0, dtype).float()
    assert torch.equal(got[:-1], torch.tensor([m, m, m, m, m, -m, -m]))
    assert torch.isnan(got[-1])
    # through the scale too, in float64 as well
    assert rf.quantise(torch.tensor([3.0], dtype=F64), torch.tensor([[[[1e6]]]]), dtype).float().item() == m


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantise_round_trips_exact_values(dtype):
    values = finite_values(dtype)
    assert same_bits(rf.quantise(values.float(), 1.0, dtype), values)
    assert same_bits(rf.quantise(values.double(), 1.0, dtype), values)
    # a power-of-two scale and its descale round-trip every value that stays in range
    small = values[(values.float().abs() <= rf.fp8_max(dtype) / 4) & (values.float().abs() >= 1.0)]
    scaled = rf.quantise(small.float(), 4.0, dtype)
    assert torch.equal(rf.dequantise(scaled, 0.25), small.float())
    assert rf.dequantise(small, torch.tensor([2.0])).dtype == torch.float32


def test_quantise_rounds_to_nearest_even():
    # e4m3 between 1 and 2 steps by 1/8: midpoints go to the even mantissa
    x = torch.tensor([1.0625, 1.1875, 1.0624, 1.0626, -1.0625])
    assert rf.quantise(x, 1.0, E4M3).float().tolist() == [1.0, 1.25, 1.0, 1.125, -1.0]
    # below the smallest subnormal (2^-9) halfway rounds to zero (even)
    assert rf.quantise(torch.tensor([2.0**-10, 2.0**-9 * 1.5]), 1.0, E4M3).float().tolist() == [0.0, 2.0**-8]


def test_quantise_other_dtypes_are_a_plain_cast():
    x = torch.tensor([1.0 + 2**-12, 70000.0])
    assert torch.equal(rf.quantise(x, 1.0, torch.bfloat16), x.to(torch.bfloat16))
    assert torch.isinf(rf.quantise(x, 1.0, torch.float16)[1])


# ---- forward ------------------------------------------------------------------------------


def test_forward_unit_scales_exact_against_float64():
    """Scales of 1, e4m3 inputs: the float64 emulation equals the naive formula bit for bit."""
    c = make_case("plain")
    ones = dict.fromkeys(FWD_SCALES, 1.0)
    o, stats, amax_s, amax_o = run_forward(c, ones, compute_dtype=F64)
    o_n, stats_n, amax_s_n, amax_o_n = naive_forward(
        c["q"], c["k"], c["v"], ones, attn_scale=ATTN_SCALE, p_dtype=E4M3, out_dtype=E4M3
    )
    assert same_bits(o, o_n)
    torch.testing.assert_close(stats, stats_n, rtol=1e-13, atol=0)
    assert amax_s.item() == pytest.approx(amax_s_n, rel=1e-14) and amax_o.item() == amax_o_n
    assert amax_s.shape == amax_o.shape == (1, 1, 1, 1) and stats.shape == (2, 2, 12, 1)


@pytest.mark.parametrize("case_id", list(CASES))
def test_forward_exact_against_float64(case_id):
    c = make_case(case_id)
    o, stats, amax_s, amax_o = run_forward(c, FWD_SCALES, compute_dtype=F64)
    o_n, stats_n, amax_s_n, amax_o_n = naive_forward(
        c["q"],
        c["k"],
        c["v"],
        FWD_SCALES,
        attn_scale=ATTN_SCALE,
        allowed=c["allowed"],
        keep=c["keep"],
        dropout_p=c["dropout_p"],
        p_dtype=c["q"].dtype,
        out_dtype=c["out_dtype"],
    )
    assert o.dtype == c["out_dtype"] and same_bits(o, o_n)
    assert torch.equal(torch.isneginf(stats), torch.isneginf(stats_n))
    torch.testing.assert_close(stats, stats_n, rtol=1e-13, atol=0)
    assert amax_s.item() == pytest.approx(amax_s_n, rel=1e-14)
    assert amax_o.item() == amax_o_n


@pytest.mark.parametrize("case_id", ["plain", "gqa", "empty-rows", "dropout"])
def test_forward_float32_close_to_float64(case_id):
    """Computing in float32 moves a few fp8 roundings by one step at most."""
    c = make_case(case_id)
    o32, st32, as32, ao32 = run_forward(c, FWD_SCALES)
    o64, st64, as64, ao64 = run_forward(c, FWD_SCALES, compute_dtype=F64)
    assert st32.dtype == as32.dtype == torch.float32 and st64.dtype == F64
    step = 2.0 ** (torch.floor(torch.log2(o64.float().abs().clamp_min(2.0**-6))) - 3)
    assert ((o32.float() - o64.float()).abs() <= step).all()
    assert (o32.view(torch.uint8) != o64.view(torch.uint8)).float().mean() < 0.02
    torch.testing.assert_close(st32, st64.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(as32, as64.float(), rtol=1e-6, atol=0)
    torch.testing.assert_close(ao32, ao64.float(), rtol=1e-5, atol=0)


def quantised_problem(gen, b=2, h=4, h_kv=2, s_q=64, s_kv=64, d=64, in_dtype=E4M3, do_dtype=E4M3):
    """Random normal q, k, v, dO, quantised per tensor with scale = max / amax (current scaling)."""
    raw = [
        torch.randn(*shape, generator=gen)
        for shape in ((b, h, s_q, d), (b, h_kv, s_kv, d), (b, h_kv, s_kv, d), (b, h, s_q, d))
    ]
    out = []
    for x, dt in zip(raw, (in_dtype, in_dtype, in_dtype, do_dtype)):
        scale = rf.fp8_max(dt) / x.abs().max().item()
        out.append((rf.quantise(x, scale, dt), 1.0 / scale))
    return out


def dequantised_attention(q, k, v, descales, attn_scale, allowed=None):
    """float64 attention of the dequantised inputs, with autograd."""
    qd, kd, vd = (rf.dequantise(x, s, F64).requires_grad_() for x, s in zip((q, k, v), descales))
    group = q.shape[1] // k.shape[1]
    s = qd @ kd.repeat_interleave(group, 1).transpose(-1, -2) * attn_scale
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    o = torch.softmax(s, -1) @ vd.repeat_interleave(group, 1)
    return o, (qd, kd, vd)


@pytest.mark.parametrize("mask", [None, "causal"])
@pytest.mark.parametrize("online_block", [None, 16])
def test_forward_within_fp8_error_of_dequantised_attention(mask, online_block):
    gen = torch.Generator().manual_seed(1)
    (q, dq), (k, dk), (v, dv), _ = quantised_problem(gen)
    allowed = causal(64, 64) if mask else None
    attn = 1 / math.sqrt(64)
    common = dict(attn_scale=attn, allowed=allowed, online_block=online_block)
    # current scaling: a first pass gives amax_O, the second uses scale_O = 448 / amax_O
    _, _, amax_s, amax_o = rf.forward_fp8(q, k, v, dq, dk, dv, 1 / 448, 448.0, 1.0, **common)
    scale_o = 448.0 / amax_o
    o, stats, amax_s2, amax_o2 = rf.forward_fp8(q, k, v, dq, dk, dv, 1 / 448, 448.0, scale_o, **common)
    assert torch.equal(amax_s, amax_s2) and torch.equal(amax_o, amax_o2)
    ref, _ = dequantised_attention(q, k, v, (dq, dk, dv), attn, allowed)
    assert rel_err(rf.dequantise(o, 1 / scale_o), ref) < 0.06
    assert rf.dequantise(o, 1 / scale_o).abs().max() <= amax_o * (1 + 2**-4)
    # stats are the log-sum-exp of the (unquantised) scores of the dequantised inputs
    qd, kd = rf.dequantise(q, dq, F64), rf.dequantise(k, dk, F64).repeat_interleave(2, 1)
    s = qd @ kd.transpose(-1, -2) * attn
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    torch.testing.assert_close(stats.double(), torch.logsumexp(s, -1, keepdim=True), rtol=1e-5, atol=1e-5)
    assert amax_s.item() == pytest.approx(torch.softmax(s, -1).max().item(), rel=1e-5)


def test_forward_amaxes_are_float32_maxima():
    """amax_S = max|P| before scale_s; amax_O = max|O| before scale_o (float32 intermediates)."""
    gen = torch.Generator().manual_seed(2)
    (q, dq), (k, dk), (v, dv), _ = quantised_problem(gen, h_kv=4)
    attn, scale_s, descale_s = 0.125, 448.0, 1 / 448
    o, _, amax_s, amax_o = rf.forward_fp8(q, k, v, dq, dk, dv, descale_s, scale_s, 3.0, attn_scale=attn)
    s = (q.float() @ k.float().transpose(-1, -2)) * attn * dq * dk
    p = torch.softmax(s, -1)
    assert amax_s.item() == pytest.approx(p.max().item(), rel=1e-6)
    out = rf.quantise(p, scale_s, E4M3).float() @ v.float() * descale_s * dv
    assert amax_o.item() == pytest.approx(out.abs().max().item(), rel=1e-6)


def test_input_descales_enter_after_the_matmuls():
    """Doubling q, k, v while halving their descales changes nothing (float32, bit for bit)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (fp8_input((2, 2, 12, 16), E4M3, gen, spread=20.0) for _ in range(3))
    assert max(x.float().abs().max() for x in (q, k, v)) <= 224
    sc = [0.5, 0.25, 2.0, 1 / 256, 256.0, 8.0]
    base = rf.forward_fp8(q, k, v, *sc, attn_scale=0.3, allowed=causal(12, 12))
    for i, name in enumerate("qkv"):
        args = [q, k, v]
        args[i] = rf.quantise(args[i].float(), 2.0, E4M3)
        scales = list(sc)
        scales[i] /= 2
        got = rf.forward_fp8(*args, *scales, attn_scale=0.3, allowed=causal(12, 12))
        assert same_bits(got[0], base[0]), name
        for a, b in zip(got[1:], base[1:]):
            assert torch.equal(a, b), name


def test_scale_o_and_scale_s():
    gen = torch.Generator().manual_seed(4)
    (q, dq), (k, dk), (v, dv), _ = quantised_problem(gen, h_kv=4)
    o1, st1, as1, ao1 = rf.forward_fp8(q, k, v, dq, dk, dv, 1 / 448, 448.0, 64.0, attn_scale=0.125)
    o2, st2, as2, ao2 = rf.forward_fp8(q, k, v, dq, dk, dv, 1 / 448, 448.0, 128.0, attn_scale=0.125)
    # scale_o doubles the fp8 output wherever both lie in the normal range
    a, b = o1.float(), o2.float()
    normal = (a.abs() > 2.0**-6) & (a.abs() <= 224)
    assert normal.float().mean() > 0.9 and torch.equal(b[normal], 2 * a[normal])
    assert ((b - 2 * a).abs() <= 2.0**-8).all()  # subnormal steps of 2^-9 either side
    assert torch.equal(st1, st2) and torch.equal(as1, as2) and torch.equal(ao1, ao2)
    # a huge scale_o saturates instead of overflowing
    o_big = rf.forward_fp8(q, k, v, dq, dk, dv, 1 / 448, 448.0, 1e9, attn_scale=0.125)[0].float()
    assert not torch.isnan(o_big).any() and set(o_big.abs().unique().tolist()) <= {0.0, 448.0}
    # scale_s with its descale: same O up to P's rounding, same amax_S (taken before scale_s)
    o3, st3, as3, ao3 = rf.forward_fp8(q, k, v, dq, dk, dv, 1 / 112, 112.0, 64.0, attn_scale=0.125)
    assert torch.equal(as3, as1) and torch.equal(st3, st1)
    assert rel_err(o3.float(), o1.float()) < 0.03 and ao3.item() == pytest.approx(ao1.item(), rel=0.05)


def test_forward_fully_masked_rows():
    c = make_case("empty-rows")
    for ct in (torch.float32, F64):
        o, stats, amax_s, amax_o = run_forward(c, FWD_SCALES, compute_dtype=ct)
        assert torch.equal(o[0, :, 3:6].float(), torch.zeros_like(o[0, :, 3:6].float()))
        assert torch.isneginf(stats[0, :, 3:6]).all() and not torch.isinf(stats[1]).any()
        assert not torch.isnan(o.float()).any() and not torch.isnan(stats).any()
        assert torch.isfinite(amax_s).all() and torch.isfinite(amax_o).all()


def test_forward_blockwise_and_terms():
    """Many row blocks, or masks given as ScoreTerms, give the same bits."""
    c = make_case("dropout")
    base = run_forward(c, FWD_SCALES, compute_dtype=F64)
    mp = pytest.MonkeyPatch()
    with mp.context() as m:
        m.setattr(reference_math, "BLOCK_SCORES", 2 * 2 * 12 * 3)  # 3 query rows per block
        blocked = run_forward(c, FWD_SCALES, compute_dtype=F64)
    terms = ScoreTerms(
        scale=ATTN_SCALE,
        allowed=lambda rows: c["allowed"][:, :, rows.start : rows.stop],
        keep=c["keep"],
        dropout_p=c["dropout_p"],
    )
    s = FWD_SCALES
    by_terms = rf.forward_fp8(
        c["q"], c["k"], c["v"], s["dq"], s["dk"], s["dv"], s["ds"], s["ss"], s["so"], terms=terms, compute_dtype=F64
    )
    for other in (blocked, by_terms):
        assert same_bits(other[0], base[0])
        for a, b in zip(other[1:], base[1:]):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="not both"):
        rf.forward_fp8(c["q"], c["k"], c["v"], *FWD_SCALES.values(), terms=terms, attn_scale=1.0)


def test_inputs_may_be_upcast_fp8_values():
    c = make_case("gqa")
    s = list(FWD_SCALES.values())
    base = rf.forward_fp8(c["q"], c["k"], c["v"], *s, attn_scale=0.125)
    up = rf.forward_fp8(c["q"].float(), c["k"].float(), c["v"].float(), *s, attn_scale=0.125, p_dtype=E4M3)
    assert same_bits(up[0], base[0]) and torch.equal(up[1], base[1])
    with pytest.raises(ValueError, match="p_dtype"):
        rf.forward_fp8(c["q"].float(), c["k"], c["v"], *s)
    with pytest.raises(ValueError, match="one element"):
        rf.forward_fp8(c["q"], c["k"], c["v"], torch.ones(2), *s[1:])


def test_forward_online_matches_frontend_reference_loop():
    """online_block: the flash-style P quantisation of cudnn-frontend's fp8_ref.py."""
    c = make_case("plain")
    o, _, amax_s, amax_o = run_forward({**c, "out_dtype": torch.float64}, FWD_SCALES, compute_dtype=F64, online_block=5)
    o_n = naive_forward_online(c["q"], c["k"], c["v"], FWD_SCALES, attn_scale=ATTN_SCALE, block=5, p_dtype=E4M3)
    torch.testing.assert_close(o, o_n * FWD_SCALES["so"], rtol=1e-13, atol=0)
    assert amax_o.item() == pytest.approx(o_n.abs().max().item(), rel=1e-13)
    # amax_S is the graph's max|P| whichever way P is rounded
    assert torch.equal(amax_s, run_forward(c, FWD_SCALES, compute_dtype=F64)[2])


# ---- backward -----------------------------------------------------------------------------


@pytest.mark.parametrize("case_id", list(CASES))
def test_backward_exact_against_float64(case_id):
    c = make_case(case_id)
    o, stats = forward_o_for_backward(c, BWD_SCALES)
    grad_dtype = c["out_dtype"]
    got = run_backward(c, o, stats, BWD_SCALES, compute_dtype=F64, grad_dtype=grad_dtype)
    want = naive_backward(
        c["q"],
        c["k"],
        c["v"],
        o,
        c["d_o"],
        stats,
        BWD_SCALES,
        attn_scale=ATTN_SCALE,
        allowed=c["allowed"],
        keep=c["keep"],
        dropout_p=c["dropout_p"],
        p_dtype=c["q"].dtype,
        ds_dtype=c["d_o"].dtype,
        grad_dtype=grad_dtype,
    )
    for name, a, b in zip(("dq", "dk", "dv"), got[:3], want[:3]):
        assert a.dtype == grad_dtype and a.shape == b.shape and same_bits(a, b), name
    for name, a, b in zip(("amax_dq", "amax_dk", "amax_dv", "amax_dp"), got[3:], want[3:]):
        assert a.shape == (1, 1, 1, 1) and a.item() == b, name


@pytest.mark.parametrize("do_dtype,tol", [(E4M3, 0.06), (E5M2, 0.1)])
@pytest.mark.parametrize("mask", [None, "causal"])
def test_backward_within_fp8_error_of_autograd(do_dtype, tol, mask):
    gen = torch.Generator().manual_seed(5)
    (q, dq), (k, dk), (v, dv), (d_o, ddo) = quantised_problem(gen, do_dtype=do_dtype)
    allowed = causal(64, 64) if mask else None
    attn = 1 / math.sqrt(64)
    _, _, _, amax_o = rf.forward_fp8(q, k, v, dq, dk, dv, 1 / 448, 448.0, 1.0, attn_scale=attn, allowed=allowed)
    scale_o = 448.0 / amax_o
    o, stats, _, _ = rf.forward_fp8(q, k, v, dq, dk, dv, 1 / 448, 448.0, scale_o, attn_scale=attn, allowed=allowed)
    head = (q, k, v, o, d_o, stats, dq, dk, dv, 1 / scale_o, ddo, 1 / 448)
    # current scaling: amax_dP (and amax_dV) first, then amax_dQ/dK (they depend on dS's
    # rounding, so on scale_dP), then every scale from its amax
    ds_max = rf.fp8_max(do_dtype)
    first = rf.backward_fp8(*head, 1.0, 448.0, 1.0, 1.0, 1.0, 1.0, attn_scale=attn, allowed=allowed)
    amax_dv, amax_dp = first[5].item(), first[6].item()
    ds_scales = (amax_dp / ds_max, 448.0, 1.0, 1.0, 1.0, ds_max / amax_dp)
    second = rf.backward_fp8(*head, *ds_scales, attn_scale=attn, allowed=allowed)
    amax_dq, amax_dk = second[3].item(), second[4].item()
    assert [x.item() for x in second[5:]] == [amax_dv, amax_dp]
    scales = (amax_dp / ds_max, 448.0, 448.0 / amax_dq, 448.0 / amax_dk, 448.0 / amax_dv, ds_max / amax_dp)
    third = rf.backward_fp8(*head, *scales, attn_scale=attn, allowed=allowed)
    assert [x.item() for x in third[3:]] == [amax_dq, amax_dk, amax_dv, amax_dp]
    ref_o, leaves = dequantised_attention(q, k, v, (dq, dk, dv), attn, allowed)
    ref_o.backward(rf.dequantise(d_o, ddo, F64))
    for grad, amax, leaf in zip(third[:3], (amax_dq, amax_dk, amax_dv), leaves):
        assert grad.dtype == E4M3 and grad.shape == leaf.shape
        assert rel_err(rf.dequantise(grad, amax / 448.0), leaf.grad) < tol


def test_backward_amaxes_are_float32_maxima():
    """amax_dP is max|dS| after attn_scale, before scale_dP; amax_dQ/dK/dV before their scales."""
    gen = torch.Generator().manual_seed(6)
    (q, dq), (k, dk), (v, dv), (d_o, ddo) = quantised_problem(gen, h_kv=4)
    attn = 0.125
    o, stats, _, _ = rf.forward_fp8(q, k, v, dq, dk, dv, 1 / 448, 448.0, 100.0, attn_scale=attn)
    got = rf.backward_fp8(
        q, k, v, o, d_o, stats, dq, dk, dv, 0.01, ddo, 1 / 448, 1 / 2048, 448.0, 3.0, 5.0, 7.0, 2048.0, attn_scale=attn
    )
    f = [x.float() for x in (q, k, v, o, d_o)]
    s = f[0] @ f[1].transpose(-1, -2) * dq * dk * attn
    p = torch.exp(s - stats)
    d_p = f[4] @ f[2].transpose(-1, -2) * ddo * dv
    d_s = (d_p - (f[4] * f[3]).sum(-1, keepdim=True) * ddo * 0.01) * p * attn
    ds8 = rf.quantise(d_s, 2048.0, E4M3).float()
    assert got[6].item() == pytest.approx(d_s.abs().max().item(), rel=1e-5)
    assert got[3].item() == pytest.approx((ds8 @ f[1] / 2048 * dk).abs().max().item(), rel=1e-5)
    assert got[4].item() == pytest.approx((ds8.transpose(-1, -2) @ f[0] / 2048 * dq).abs().max().item(), rel=1e-5)
    p8 = rf.quantise(p, 448.0, E4M3).float()
    assert got[5].item() == pytest.approx((p8.transpose(-1, -2) @ f[4] / 448 * ddo).abs().max().item(), rel=1e-5)


def test_backward_scales_enter_in_the_right_places():
    c = make_case("gqa")
    o, stats = forward_o_for_backward(c, BWD_SCALES)
    sc = BWD_SCALES
    base = run_backward(c, o, stats, sc)
    # dO doubled with its descale halved, O doubled with its descale halved: the same bits
    for key, scale_key in (("d_o", "ddo"), ("o", "do")):
        src = c["d_o"] if key == "d_o" else o
        doubled = rf.quantise(src.float(), 2.0, src.dtype)
        assert doubled.float().abs().max() <= 448
        c2, o2 = dict(c), o
        if key == "d_o":
            c2["d_o"] = doubled
        else:
            o2 = doubled
        got = run_backward(c2, o2, stats, {**sc, scale_key: sc[scale_key] / 2})
        for a, b in zip(got, base):
            assert same_bits(a, b), key
    # scale_dQ/dK/dV: each output doubles where it is in the normal range; amaxes unchanged
    got = run_backward(c, o, stats, {**sc, "sdq": 2 * sc["sdq"], "sdk": 2 * sc["sdk"], "sdv": 2 * sc["sdv"]})
    for a, b in zip(got[:3], base[:3]):
        x, y = a.float(), b.float()
        normal = (y.abs() > 2.0**-6) & (y.abs() <= 224)
        assert normal.float().mean() > 0.5 and torch.equal(x[normal], 2 * y[normal])
    for a, b in zip(got[3:], base[3:]):
        assert torch.equal(a, b)
    # scale_dP with its descale: the same gradients up to dS's rounding, same amax_dP
    got = run_backward(c, o, stats, {**sc, "sdp": sc["sdp"] * 4, "ddp": sc["ddp"] / 4})
    assert torch.equal(got[6], base[6])
    for a, b in zip(got[:3], base[:3]):
        assert rel_err(a.float(), b.float()) < 0.05


def test_backward_fully_masked_rows_have_zero_gradients():
    c = make_case("empty-rows")
    o, stats = forward_o_for_backward(c, BWD_SCALES)
    for ct in (torch.float32, F64):
        d_q, d_k, d_v, *amaxes = run_backward(c, o, stats, BWD_SCALES, compute_dtype=ct)
        assert torch.equal(d_q[0, :, 3:6].float(), torch.zeros(2, 3, 16))
        # keys masked in every row of batch 1 get no gradient
        assert torch.equal(d_k[1, :, -3:].float(), torch.zeros(2, 3, 16))
        assert torch.equal(d_v[1, :, -3:].float(), torch.zeros(2, 3, 16))
        for x in (d_q, d_k, d_v):
            assert not torch.isnan(x.float()).any()
        assert all(torch.isfinite(a).all() for a in amaxes)


def test_backward_blockwise_gives_the_same_bits():
    c = make_case("mqa-causal")
    o, stats = forward_o_for_backward(c, BWD_SCALES)
    base = run_backward(c, o, stats, BWD_SCALES, compute_dtype=F64)
    with pytest.MonkeyPatch().context() as m:
        m.setattr(reference_math, "BLOCK_SCORES", 4 * 12 * 2)  # 2 query rows per block
        blocked = run_backward(c, o, stats, BWD_SCALES, compute_dtype=F64)
    for a, b in zip(blocked, base):
        assert same_bits(a, b)
