"""``merge_partials`` (the torch path, on CPU) against float64 attention computed whole.

The keys are split into chunks of random sizes (empty ones included); each chunk's partial
output and log-sum-exp are computed in float64, cast as a split-KV kernel would write them
(O in the kernel's dtype, stats in float32), then merged and compared with the whole."""

from __future__ import annotations

import pytest
import torch
from conftest import TOLERANCE, rel_err

from cudnn_attn.errors import ValidationError
from cudnn_attn.kernels.lse_merge import merge_partials

B, H, S, KEYS = 2, 3, 5, 40
LSE_TOL = 1e-6  # stats are float32: L agrees with float64 to float32 rounding
MERGE_TOL = 1e-6  # float32 arithmetic against the float64 merge of the same rounded partials
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def attend(q, k, v, visible):
    """Float64 attention of ``q`` over the keys ``k``, ``v`` that ``visible`` ``[B, H, S, K]``
    allows: ``(o [B, H, S, D], lse [B, H, S])``; a row with no visible key gives 0 and -inf."""
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1))
    return p @ v, lse


def problem(d, seed, keys=KEYS):
    """Random q, k, v (float64) and a visibility mask with two rows that see no key at all."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, d, generator=gen, dtype=torch.float64) * 2  # spread the chunks' LSEs
    k, v = (torch.randn(B, H, keys, d, generator=gen, dtype=torch.float64) for _ in range(2))
    visible = torch.rand(B, H, S, keys, generator=gen) < 0.7
    visible[0, 1, 2] = visible[1, 2, 0] = False
    return q, k, v, visible


def bounds(keys, chunks, gen):
    """``chunks`` random consecutive ranges covering ``range(keys)``, at least one of them empty."""
    cuts = torch.randint(0, keys + 1, (chunks - 2,), generator=gen).tolist()
    cuts = sorted([0, keys, *cuts, cuts[0]])  # a repeated cut: an empty chunk
    return list(zip(cuts[:-1], cuts[1:]))


def partials(q, k, v, visible, ranges, dtype):
    """Each chunk's ``(o, stats)`` stacked as ``[B, N, H, S, D]`` in ``dtype`` and ``[B, N, H, S]`` float32."""
    results = [attend(q, k[:, :, a:b], v[:, :, a:b], visible[..., a:b]) for a, b in ranges]
    o = torch.stack([o for o, _ in results], dim=1)
    stats = torch.stack([lse for _, lse in results], dim=1)
    return o.to(dtype), stats.float()


def merged64(parts):
    """The merge in float64 from the rounded partials (the exact answer to what was given)."""
    o = torch.cat([o for o, _ in parts], dim=1).double()
    stats = torch.cat([s for _, s in parts], dim=1).double()
    lse = torch.logsumexp(stats, dim=1)
    w = torch.exp(stats - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(1)).unsqueeze(-1)
    return torch.where(w > 0, w * o, 0.0).sum(dim=1), lse


def poisoned(*shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)


def check(out, lse, parts, whole, tol):
    o_whole, lse_whole = whole
    err = rel_err(out, o_whole)  # NaN fails inside rel_err
    assert err < tol, f"out against whole attention: {err:.2e} >= {tol}"
    err = rel_err(lse, lse_whole)
    assert err < LSE_TOL, f"lse against whole attention: {err:.2e}"
    exact = merged64(parts)[0]
    if out.dtype == torch.float32:
        err = rel_err(out, exact)
        assert err < MERGE_TOL, f"out against the float64 merge: {err:.2e}"
    else:  # rounded once: the exact merge's rounding, but for rare ties at float32 precision
        rounded = exact.to(out.dtype).double()
        steps = (out.double() - rounded).abs() / (torch.finfo(out.dtype).eps * rounded.abs() + 1e-30)
        assert steps.max() <= 1 and (steps > 0).double().mean() < 0.01, "more than one rounding of the exact merge"


@pytest.mark.parametrize("d", [16, 80, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize(
    "o_dtype, out_dtype",
    [("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32"), ("bf16", "fp32"), ("fp32", "bf16")],
    ids=lambda name: name,
)
def test_merge_matches_whole_attention(o_dtype, out_dtype, d):
    q, k, v, visible = problem(d, seed=d)
    ranges = bounds(KEYS, 7, torch.Generator().manual_seed(d + 1))
    parts = [partials(q, k, v, visible, ranges, DTYPES[o_dtype])]
    out, lse = poisoned(B, H, S, d, dtype=DTYPES[out_dtype]), poisoned(B, H, S, dtype=torch.float32)
    assert merge_partials(parts, out, lse) is out
    tol = max(TOLERANCE[DTYPES[o_dtype]], TOLERANCE[DTYPES[out_dtype]])
    check(out, lse, parts, attend(q, k, v, visible), tol)


@pytest.mark.parametrize("tail_dtype", ["bf16", "fp32"])
def test_body_of_chunks_and_a_tail(tail_dtype):
    """Two parts: N chunks and a last chunk of one key (decode's newest token), merged in one call."""
    q, k, v, visible = problem(64, seed=3)
    body = partials(q, k, v, visible, bounds(KEYS - 1, 5, torch.Generator().manual_seed(4)), torch.bfloat16)
    tail = partials(q, k, v, visible, [(KEYS - 1, KEYS)], DTYPES[tail_dtype])
    out, lse = poisoned(B, H, S, 64, dtype=torch.float32), poisoned(B, H, S, dtype=torch.float32)
    merge_partials([body, tail], out, lse)
    check(out, lse, [body, tail], attend(q, k, v, visible), TOLERANCE[torch.bfloat16])
    without_tail = poisoned(B, H, S, 64, dtype=torch.float32)
    merge_partials([body], without_tail)
    assert rel_err(without_tail, out) > 1e-3  # the tail counts: the check above would see it missing


def test_any_number_of_parts():
    q, k, v, visible = problem(32, seed=5)
    ranges = bounds(KEYS, 6, torch.Generator().manual_seed(6))
    parts = [partials(q, k, v, visible, ranges[i : i + 2], torch.float32) for i in range(0, 6, 2)]
    out, lse = poisoned(B, H, S, 32, dtype=torch.float32), poisoned(B, H, S, dtype=torch.float32)
    merge_partials(parts, out, lse)
    check(out, lse, parts, attend(q, k, v, visible), TOLERANCE[torch.float32])


def test_strided_inputs_and_a_bshd_out_written_in_place():
    """Partials read through permuted views; ``out`` a BSHD buffer seen as ``[B, H, S, D]``."""
    q, k, v, visible = problem(48, seed=7)
    o, stats = partials(q, k, v, visible, bounds(KEYS, 4, torch.Generator().manual_seed(8)), torch.float16)
    o_view = o.permute(0, 3, 1, 2, 4).contiguous().permute(0, 2, 3, 1, 4)  # stored [B, S, N, H, D]
    stats_view = stats.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # stored [B, H, S, N]
    assert not o_view.is_contiguous() and not stats_view.is_contiguous()
    bshd = poisoned(B, S, H, 48, dtype=torch.float16)
    lse_bsh = poisoned(B, S, H, dtype=torch.float32)
    out = bshd.transpose(1, 2)
    assert merge_partials([(o_view, stats_view)], out, lse_bsh.transpose(1, 2)) is out
    assert not torch.isnan(bshd).any() and not torch.isnan(lse_bsh).any()
    check(
        bshd.transpose(1, 2), lse_bsh.transpose(1, 2), [(o, stats)], attend(q, k, v, visible), TOLERANCE[torch.float16]
    )


def test_rows_with_no_visible_key_give_zero_and_minus_inf():
    """Where every chunk is empty: O = 0 and L = -inf, no NaN; an empty chunk's O is never read."""
    q, k, v, visible = problem(16, seed=9)
    visible[1] = False  # a whole batch element sees nothing
    o, stats = partials(q, k, v, visible, bounds(KEYS, 5, torch.Generator().manual_seed(10)), torch.float32)
    o = o.masked_fill((stats == float("-inf")).unsqueeze(-1), float("nan"))  # as an unwritten buffer
    out, lse = poisoned(B, H, S, 16, dtype=torch.bfloat16), poisoned(B, H, S, dtype=torch.float32)
    merge_partials([(o, stats)], out, lse)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out[1], torch.zeros_like(out[1])) and bool((lse[1] == float("-inf")).all())
    assert out[0, 1, 2].abs().max() == 0 and lse[0, 1, 2] == float("-inf")  # an empty row next to full ones
    check(out, lse, [(o, stats)], attend(q, k, v, visible), TOLERANCE[torch.bfloat16])


def test_no_chunks_at_all():
    o, stats = torch.randn(B, 0, H, S, 8), torch.randn(B, 0, H, S)
    out, lse = poisoned(B, H, S, 8, dtype=torch.float16), poisoned(B, H, S, dtype=torch.float32)
    merge_partials([(o, stats)], out, lse)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())


def test_lse_is_optional_and_does_not_change_out():
    q, k, v, visible = problem(24, seed=11)
    parts = [partials(q, k, v, visible, bounds(KEYS, 5, torch.Generator().manual_seed(12)), torch.bfloat16)]
    with_lse, without = (poisoned(B, H, S, 24, dtype=torch.bfloat16) for _ in range(2))
    lse = poisoned(B, H, S, dtype=torch.float32)
    merge_partials(parts, with_lse, lse)
    merge_partials(parts, without)
    assert torch.equal(with_lse, without)
    assert rel_err(lse, attend(q, k, v, visible)[1]) < LSE_TOL


def _good():
    return [(torch.randn(B, 3, H, S, 8), torch.randn(B, 3, H, S))], torch.empty(B, H, S, 8), torch.empty(B, H, S)


def _bad(change):
    parts, out, lse = _good()
    o, stats = parts[0]
    return change(parts, o, stats, out, lse)


BAD = {
    "out-3d": ("out", lambda parts, o, s, out, lse: (parts, out[0], lse)),
    "out-int": ("out", lambda parts, o, s, out, lse: (parts, out.int(), lse)),
    "out-not-tensor": ("out", lambda parts, o, s, out, lse: (parts, None, lse)),
    "parts-empty": ("parts", lambda parts, o, s, out, lse: ([], out, lse)),
    "parts-a-tensor": ("parts", lambda parts, o, s, out, lse: (o, out, lse)),
    "part-not-a-pair": ("parts[1]", lambda parts, o, s, out, lse: ([*parts, (o,)], out, lse)),
    "o-4d": ("parts[0].o", lambda parts, o, s, out, lse: ([(o[:, 0], s)], out, lse)),
    "o-heads": ("parts[0].o", lambda parts, o, s, out, lse: ([(o[:, :, :2], s)], out, lse)),
    "o-head-dim": ("parts[0].o", lambda parts, o, s, out, lse: ([(o[..., :4], s)], out, lse)),
    "o-float64": ("parts[0].o", lambda parts, o, s, out, lse: ([(o.double(), s)], out, lse)),
    "o-device": ("parts[0].o", lambda parts, o, s, out, lse: ([(o.to("meta"), s)], out, lse)),
    "stats-fp16": ("parts[0].stats", lambda parts, o, s, out, lse: ([(o, s.half())], out, lse)),
    "stats-chunks": ("parts[0].stats", lambda parts, o, s, out, lse: ([(o, s[:, :2])], out, lse)),
    "stats-5d": ("parts[0].stats", lambda parts, o, s, out, lse: ([(o, s.unsqueeze(-1))], out, lse)),
    "tail-batch": ("parts[1].o", lambda parts, o, s, out, lse: ([*parts, (o[:1], s[:1])], out, lse)),
    "lse-shape": ("lse", lambda parts, o, s, out, lse: (parts, out, lse[:, :, :1])),
    "lse-fp16": ("lse", lambda parts, o, s, out, lse: (parts, out, lse.half())),
    "lse-4d": ("lse", lambda parts, o, s, out, lse: (parts, out, lse.unsqueeze(-1))),
}


@pytest.mark.parametrize("case", list(BAD), ids=lambda c: c)
def test_bad_arguments_raise_validation_error_naming_the_argument(case):
    name, change = BAD[case]
    parts, out, lse = _bad(change)
    with pytest.raises(ValidationError) as caught:
        merge_partials(parts, out, lse)
    assert caught.value.problems[0].startswith(f"{name}:"), caught.value.problems
    assert "merge_partials" in str(caught.value)


def test_every_problem_is_listed_at_once():
    parts, out, lse = _good()
    (o, stats), *_ = parts
    with pytest.raises(ValidationError) as caught:
        merge_partials([(o.double(), stats.half())], out, lse.half())
    assert [p.partition(":")[0] for p in caught.value.problems] == ["parts[0].o", "parts[0].stats", "lse"]


def test_the_good_arguments_of_the_bad_cases_are_accepted():
    """The error cases above differ from these by one change each."""
    parts, out, lse = _good()
    merge_partials(parts, out, lse)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
