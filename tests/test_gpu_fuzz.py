"""The GPU fuzz campaign: the seeded requests of ``fuzz_requests.py`` on CUDA tensors (cuDNN).

Each request is made on the CPU exactly as the CPU campaign makes it (the same tensors, the same
float64 oracle); only at the library's door are its tensors copied to the GPU (``Boundary``:
layouts, offsets, aliasing and autograd kept) and the results copied back. The CUDA allocator's
free memory is filled with NaN before each request, as are ``out=`` buffers, so an unwritten
output shows. Ops: ``Graph.sdpa`` (dense and ragged), ``sdpa_backward``, paged caches,
``cudnn_attn.sdpa``, FP8 (``Graph.sdpa_fp8``, ``cudnn_attn.sdpa_fp8``) and dropout, checked
statistically (cuDNN's Philox mask is its own): kept fraction, scale, independent masks, seed
semantics, the backward given the forward's mask, and the mean over seeds.

Every accepted request must match within its dtype's tolerance (FP8's own for FP8), every
refusal must be the library's own error, nothing may hang. A valid request cuDNN cannot run
must be refused with an ``UnsupportedError`` naming why; those are counted apart and re-run in a
child process with the library's cuDNN rules switched off (``probe_refusals``): a refusal of a
request that cuDNN then runs correctly is a defect.

250 requests in the GPU suite (``-m "gpu and not slow"``, about a minute on an H100), 2,000 more
in the full run (``-m "gpu and slow"``, about 11 minutes); the counts are printed at the end of
the session (and written as JSON to ``$FUZZ_SUMMARY_JSON`` when set). The same campaign from the
command line, in parallel processes: ``python tests/fuzz_requests.py --gpu --summary full
--workers 4``; one request: ``python tests/fuzz_requests.py --gpu <op> <seed>``. Results on an
H100: docs/gpu_support.md, "GPU fuzz campaign".
The harness itself is tested on the CPU below (``target="cpu-harness"``).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from fuzz_requests import (
    GPU_CAMPAIGN,
    PROBE_VERDICTS,
    Boundary,
    Tally,
    campaign_seeds,
    device_description,
    probe_refusals,
    probe_report,
    probes_by_rule,
    run_tallied,
    summarize,
)

CHUNK = 50  # requests per item of the full run


@pytest.fixture(scope="session")
def tallies(request):
    """The session's counts per campaign size; printed when the session ends."""
    counts = {"normal": Tally(), "full": Tally()}
    yield counts
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    for size, tally in counts.items():
        if not tally.requests or reporter is None:
            continue
        reporter.write_sep("-", f"GPU fuzz campaign ({size})")
        for line in tally.report(f"{device_description()}, {size} run").splitlines():
            reporter.write_line(line)
        if getattr(tally, "probes", None):
            reporter.write_line("valid requests refused as unsupported, judged (cuDNN's own refusals; rules probed):")
            reporter.write_line(probe_report(tally.probes))
            reporter.write_line("by rule:")
            reporter.write_line(probes_by_rule(tally.probes))


def _write_summary(tallies: dict) -> None:
    """The counts so far, as JSON, to ``$FUZZ_SUMMARY_JSON`` (after every item: a run cut short keeps them)."""
    path = os.environ.get("FUZZ_SUMMARY_JSON")
    if not path:
        return
    summary = {
        size: dict(tally.as_dict(), device=device_description(), probes=getattr(tally, "probes", None))
        for size, tally in tallies.items()
        if tally.requests
    }
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)


def _run(op: str, seeds, size: str, tallies: dict) -> None:
    findings = run_tallied(op, seeds, "cuda", tallies[size])
    _write_summary(tallies)
    if findings:
        pytest.fail(
            f"{len(findings)} findings in {op} seeds {seeds.start}-{seeds.stop - 1} on the GPU "
            f"(replay one: python tests/fuzz_requests.py --gpu {op} <seed>):\n{summarize(findings)}",
            pytrace=False,
        )


def _probe(size: str, tallies: dict) -> None:
    """Each valid request refused as unsupported, re-run with the library's cuDNN rules off (in a
    child process): cuDNN must then fail to build it, or give a wrong result (the rule guards a
    bug), or the rule guards a hang. One that cuDNN runs and gets right was refused for nothing."""
    tally = tallies[size]
    if not tally.requests:
        pytest.skip(f"the {size} campaign did not run in this session (its refusals are probed after it)")
    tally.probes = probe_refusals(tally.unsupported)
    _write_summary(tallies)
    for r in tally.probes:
        assert r["verdict"] in PROBE_VERDICTS or r["verdict"] == "runs-under-rules", r
    defects = [r for r in tally.probes if r["verdict"] == "runs"]
    assert not defects, f"{len(defects)} valid requests refused that cuDNN runs correctly:\n{probe_report(defects)}"


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(GPU_CAMPAIGN["normal"]))
def test_gpu_requests_match_or_get_a_library_error(op, tallies):
    _run(op, campaign_seeds("normal", op), "normal", tallies)


@pytest.mark.gpu
def test_valid_requests_refused_on_the_gpu_are_ones_cudnn_cannot_run(tallies):
    _probe("normal", tallies)


FULL_ITEMS = [
    (op, range(first, min(first + CHUNK, seeds.stop)))
    for op in GPU_CAMPAIGN["full"]
    for seeds in [campaign_seeds("full", op)]
    for first in range(seeds.start, seeds.stop, CHUNK)
]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("op,seeds", FULL_ITEMS, ids=[f"{op}-{s.start}-{s.stop - 1}" for op, s in FULL_ITEMS])
def test_gpu_full_campaign(op, seeds, tallies):
    _run(op, seeds, "full", tallies)


@pytest.mark.gpu
@pytest.mark.slow
def test_valid_requests_refused_in_the_full_campaign_are_ones_cudnn_cannot_run(tallies):
    _probe("full", tallies)


# ---- the harness, on the CPU --------------------------------------------------------------------------


@pytest.mark.parametrize("op", list(GPU_CAMPAIGN["normal"]))
def test_the_harness_runs_the_campaign_on_the_cpu(op):
    """The GPU campaign's cases (boundary, copies, the GPU's choices) on the reference backend."""
    tally = Tally()
    findings = run_tallied(op, range(25), "cpu-harness", tally)
    assert not findings, summarize(findings)
    assert tally.valid["ran and matched"] > 0 and sum(tally.malformed.values()) > 0, tally.line()


def test_the_boundary_keeps_layouts_aliasing_and_gradients():
    boundary = Boundary("cpu")
    buffer = torch.full((2, 3, 8), float("nan"), dtype=torch.float16)
    buffer[..., :5] = torch.randn(2, 3, 5).half()
    padded = buffer[..., :5]
    other_view = buffer[1:]
    twin = boundary.inward(padded)
    assert twin.untyped_storage().data_ptr() != padded.untyped_storage().data_ptr()  # a copy
    assert (twin.shape, twin.stride(), twin.storage_offset()) == (padded.shape, padded.stride(), 0)
    assert torch.equal(twin, padded)
    assert torch.isnan(twin.as_strided((2, 3, 8), (24, 8, 1))[..., 5:]).all()  # the surroundings came along
    assert boundary.inward(padded) is twin  # one tensor, one twin
    assert boundary.inward(other_view).untyped_storage().data_ptr() == twin.untyped_storage().data_ptr()
    expanded = torch.randn(1, 3, 4).expand(2, 3, 4)
    assert boundary.inward(expanded).stride() == (0, 4, 1)
    out = torch.full((2, 3), float("nan"))
    written = boundary.inward(out).fill_(7.0)  # the library writes its out= buffer
    back = boundary.outward(written, "cpu")
    assert back.data_ptr() == out.data_ptr() and bool((out == 7).all())  # the CPU original holds the result
    leaf = torch.randn(3, 4, requires_grad=True)
    (boundary.inward((leaf,))[0] * 2).sum().backward()
    assert torch.equal(leaf.grad, torch.full((3, 4), 2.0))
    boundary.outward(torch.zeros(2), "cuda")  # a result on another device than its inputs
    assert boundary.wrong_device


def test_the_harness_catches_a_wrong_result(monkeypatch):
    from cudnn_attn.ops.reference import math as reference_math

    forward = reference_math.forward

    def off_by_one_percent(*args, **kwargs):
        o, stats = forward(*args, **kwargs)
        return o * 1.01, stats

    monkeypatch.setattr(reference_math, "forward", off_by_one_percent)
    findings = run_tallied("sdpa", range(20), "cpu-harness", Tally())
    assert any(f.kind == "wrong result" for f in findings)


def test_the_campaign_sizes():
    assert 250 <= sum(GPU_CAMPAIGN["normal"].values()) <= 400
    assert sum(GPU_CAMPAIGN["full"].values()) == 2000
    for op in GPU_CAMPAIGN["full"]:
        assert not set(campaign_seeds("normal", op)) & set(campaign_seeds("full", op))
    assert {op for op, _ in FULL_ITEMS} == set(GPU_CAMPAIGN["full"])
