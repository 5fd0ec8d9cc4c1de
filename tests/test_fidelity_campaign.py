"""A seeded random campaign over the torch-form features the CPU runs on the reference backend:
sinks, soft-capping and windows through ``cudnn_attn.sdpa`` (dense), ``cudnn_attn.varlen_sdpa``
(FlashAttention's semantics: windows and ``causal`` measured from each sequence's bottom-right
diagonal) and jagged nested inputs (each sequence as the dense call). Outputs and gradients are
compared with a float64 oracle written out below, by relative error (``conftest.TOLERANCE``).

Small shapes: 160 cases in well under a minute on two cores. A case's id holds its draw.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import TOLERANCE, rel_err

import cudnn_attn

SEED = 20261128
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GRAD_FACTOR = 4  # a backward chains several rounded products: gradients get 4x the output tolerance


def attention64(q, k, v, *, scale, causal=False, window=(-1, -1), sinks=None, softcap=None, bottom_right=False):
    """One sequence (or a dense batch), [B, H, L, D], in float64: scores, soft-capping, the band
    (causal and window, top-left or bottom-right diagonal), the sinks in the denominator."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    length, keys = q.shape[-2], k.shape[-2]
    s = q @ k.transpose(-2, -1) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    diagonal = torch.arange(length)[:, None] + (keys - length if bottom_right else 0)
    j = torch.arange(keys)[None, :]
    keep = torch.ones(length, keys, dtype=torch.bool)
    if causal:
        keep &= j <= diagonal
    if window[0] >= 0:
        keep &= j >= diagonal - window[0]
    if window[1] >= 0:
        keep &= j <= diagonal + window[1]
    s = s.masked_fill(~keep, -math.inf)
    if sinks is not None:
        sink = sinks.double().reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1).nan_to_num(0.0)  # a row that sees no key gives 0
    return p @ v


def _features(rng: random.Random, *, right_bounds: bool) -> dict:
    """sinks, softcap and a window, each drawn on or off (at least one on)."""
    while True:
        f = {
            "sinks": rng.random() < 0.5,
            "softcap": rng.choice([None, None, 0.7, 2.0, 8.0]),
            "causal": rng.random() < 0.5,
        }
        left = rng.choice([-1, -1, 0, 1, 3, 6])
        right = rng.choice([-1, -1, 0] + ([1, 4] if right_bounds and not f["causal"] else []))
        if f["softcap"] is not None and right > 0:
            right = -1  # softcap with a right bound > 0 is refused (FINDINGS f09)
        f["window"] = (left, right)
        if f["sinks"] or f["softcap"] is not None or f["window"] != (-1, -1):
            return f


def _tensors(gen, shapes, dtype):
    return [(torch.randn(*s, generator=gen) * 1.5).to(dtype).requires_grad_() for s in shapes]


def _check(out, want, leaves, leaves64, d_out, dtype, what, packed=lambda g: g):
    """Output, then every gradient (``packed``: a leaf's gradient as its oracle leaf's shape)."""
    assert rel_err(out, want) < TOLERANCE[dtype], f"{what}: output"
    present = [i for i, t in enumerate(leaves) if t is not None]
    got = [packed(g) for g in torch.autograd.grad(out, [leaves[i] for i in present], d_out)]
    expected = torch.autograd.grad(want, [leaves64[i] for i in present], d_out.double())
    for i, g, e in zip(present, got, expected):
        assert rel_err(g, e) < GRAD_FACTOR * TOLERANCE[dtype], f"{what}: gradient {('q', 'k', 'v', 'sinks')[i]}"


def _sinks(gen, heads):
    return (torch.randn(heads, generator=gen) * 2).requires_grad_()


# --- dense sdpa -----------------------------------------------------------------------------------


def _dense_case(n: int) -> dict:
    rng = random.Random(SEED + n)
    h_kv = rng.choice([1, 2])
    case = {
        "b": rng.choice([1, 2]),
        "h": h_kv * rng.choice([1, 2]),
        "h_kv": h_kv,
        "s": rng.randint(1, 20),
        "d": rng.choice([8, 16, 32]),
        "dtype": rng.choice(DTYPES),
        **_features(rng, right_bounds=True),
    }
    # windows need L <= S in the torch form (FINDINGS f08); without one any L runs
    windowed = case["window"] != (-1, -1)
    case["l"] = rng.randint(1, case["s"]) if windowed else rng.randint(1, 20)
    return case


DENSE = [_dense_case(n) for n in range(80)]


def _id(case: dict) -> str:
    window = "" if case["window"] == (-1, -1) else f"-w{case['window'][0]}_{case['window'][1]}"
    return (
        f"{str(case['dtype'])[6:]}-h{case['h']}_{case['h_kv']}-l{case.get('l', '')}s{case.get('s', '')}"
        f"{'-sinks' if case['sinks'] else ''}{'' if case['softcap'] is None else '-cap' + str(case['softcap'])}"
        f"{'-causal' if case['causal'] else ''}{window}"
    )


@pytest.mark.parametrize("case", DENSE, ids=[f"{n}-{_id(c)}" for n, c in enumerate(DENSE)])
def test_dense_sdpa(case):
    gen = torch.Generator().manual_seed(SEED + case["s"] * 101 + case["l"])
    b, h, h_kv, d, dtype = case["b"], case["h"], case["h_kv"], case["d"], case["dtype"]
    q, k, v = _tensors(gen, [(b, h, case["l"], d), (b, h_kv, case["s"], d), (b, h_kv, case["s"], d)], dtype)
    sinks = _sinks(gen, h) if case["sinks"] else None
    out = cudnn_attn.sdpa(
        q,
        k,
        v,
        is_causal=case["causal"],
        enable_gqa=h != h_kv,
        sinks=sinks,
        softcap=case["softcap"],
        window_size=case["window"],
    )
    leaves64 = [t.detach().double().requires_grad_() if t is not None else None for t in (q, k, v, sinks)]
    want = attention64(
        *leaves64[:3],
        scale=d**-0.5,
        causal=case["causal"],
        window=case["window"],
        sinks=leaves64[3],
        softcap=case["softcap"],
    )
    _check(out, want, [q, k, v, sinks], leaves64, torch.randn(out.shape, generator=gen).to(dtype), dtype, "dense")


# --- varlen_sdpa (FlashAttention's semantics) -----------------------------------------------------


def _sequences_case(rng: random.Random, right_bounds: bool) -> dict:
    """Heads, head dim, dtype, features and 1-4 query lengths of a packed or nested case."""
    h_kv = rng.choice([1, 2])
    case = {
        "h": h_kv * rng.choice([1, 2]),
        "h_kv": h_kv,
        "d": rng.choice([8, 16]),
        "dtype": rng.choice(DTYPES),
        **_features(rng, right_bounds=right_bounds),
    }
    case["lq"] = [rng.randint(1, 12) for _ in range(rng.randint(1, 4))]
    return case


def _varlen_case(n: int) -> dict:
    rng = random.Random(SEED + 1000 + n)
    case = _sequences_case(rng, right_bounds=False)
    same = case["softcap"] is not None or rng.random() < 0.4  # packed softcap needs self-attention
    case["lk"] = list(case["lq"]) if same else [lq + rng.randint(0, 6) for lq in case["lq"]]
    if not case["causal"] and case["window"][1] == 0:
        case["causal"] = True  # a right bound of 0 is causal: spelled so
        case["window"] = (case["window"][0], -1) if rng.random() < 0.5 else case["window"]
    return case


VARLEN = [_varlen_case(n) for n in range(40)]


@pytest.mark.parametrize("case", VARLEN, ids=[f"{n}-{_id(c)}-B{len(c['lq'])}" for n, c in enumerate(VARLEN)])
def test_varlen_sdpa(case):
    gen = torch.Generator().manual_seed(SEED + sum(case["lq"]) * 7 + sum(case["lk"]))
    h, h_kv, d, dtype = case["h"], case["h_kv"], case["d"], case["dtype"]
    t_q, t_k = sum(case["lq"]), sum(case["lk"])
    q, k, v = _tensors(gen, [(t_q, h, d), (t_k, h_kv, d), (t_k, h_kv, d)], dtype)
    sinks = _sinks(gen, h) if case["sinks"] else None
    cu_q = torch.tensor([0, *torch.tensor(case["lq"]).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = (
        cu_q
        if case["lk"] == case["lq"]
        else torch.tensor([0, *torch.tensor(case["lk"]).cumsum(0).tolist()], dtype=torch.int32)
    )
    out = cudnn_attn.varlen_sdpa(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max(case["lq"]),
        max(case["lk"]),
        causal=case["causal"] or None,
        window_size=case["window"],
        softcap=case["softcap"],
        sinks=sinks,
    )
    leaves64 = [t.detach().double().requires_grad_() if t is not None else None for t in (q, k, v, sinks)]
    pieces = []
    for i in range(len(case["lq"])):
        rows_q, rows_k = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        part = [t[rows].transpose(0, 1)[None] for t, rows in zip(leaves64[:3], (rows_q, rows_k, rows_k))]
        one = attention64(
            *part,
            scale=d**-0.5,
            causal=case["causal"],
            window=case["window"],
            sinks=leaves64[3],
            softcap=case["softcap"],
            bottom_right=True,
        )
        pieces.append(one[0].transpose(0, 1))
    want = torch.cat(pieces)
    _check(out, want, [q, k, v, sinks], leaves64, torch.randn(out.shape, generator=gen).to(dtype), dtype, "varlen")


# --- nested (jagged) inputs: each sequence as the dense call -------------------------------------


def _nested_case(n: int) -> dict:
    rng = random.Random(SEED + 2000 + n)
    case = _sequences_case(rng, right_bounds=True)
    cross = case["softcap"] is None and case["window"] == (-1, -1) and rng.random() < 0.5
    case["lk"] = [rng.randint(1, 12) for _ in case["lq"]] if cross else list(case["lq"])
    return case


NESTED = [_nested_case(n) for n in range(40)]


def _jagged(lengths, heads, d, dtype, gen):
    seqs = [(torch.randn(n, heads, d, generator=gen) * 1.5).to(dtype) for n in lengths]
    return torch.nested.nested_tensor(seqs, layout=torch.jagged, requires_grad=True)


@pytest.mark.parametrize("case", NESTED, ids=[f"{n}-{_id(c)}-B{len(c['lq'])}" for n, c in enumerate(NESTED)])
def test_nested_sdpa(case):
    gen = torch.Generator().manual_seed(SEED + sum(case["lq"]) * 13 + sum(case["lk"]))
    h, h_kv, d, dtype = case["h"], case["h_kv"], case["d"], case["dtype"]
    leaves = [
        _jagged(case["lq"], h, d, dtype, gen),
        _jagged(case["lk"], h_kv, d, dtype, gen),
        _jagged(case["lk"], h_kv, d, dtype, gen),
    ]
    sinks = _sinks(gen, h) if case["sinks"] else None
    q, k, v = (t.transpose(1, 2) for t in leaves)
    out = cudnn_attn.sdpa(
        q,
        k,
        v,
        is_causal=case["causal"],
        enable_gqa=h != h_kv,
        sinks=sinks,
        softcap=case["softcap"],
        window_size=case["window"],
    )
    leaves64 = [t.values().detach().double().requires_grad_() for t in leaves] + [
        None if sinks is None else sinks.detach().double().requires_grad_()
    ]
    offsets = [t.offsets() for t in leaves]
    pieces = []
    for i in range(len(case["lq"])):
        part = [t[o[i] : o[i + 1]].transpose(0, 1)[None] for t, o in zip(leaves64[:3], offsets)]
        one = attention64(
            *part,
            scale=d**-0.5,
            causal=case["causal"],
            window=case["window"],
            sinks=leaves64[3],
            softcap=case["softcap"],
        )
        pieces.append(one[0].transpose(0, 1))
    want = torch.cat(pieces)
    got = out.transpose(1, 2).values()
    d_out = torch.randn(got.shape, generator=gen).to(dtype)
    _check(got, want, [*leaves, sinks], leaves64, d_out, dtype, "nested", lambda g: g.values() if g.is_nested else g)
