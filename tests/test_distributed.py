"""Context parallelism (``cudnn_attn.distributed``) over real process groups: gloo on the CPU
with 2 and 3 ranks, NCCL on 2 GPUs.

Each world size starts its ranks once (``distributed_workers.main``) and they run every case;
the tests here read the outcomes, one test per case. Results are compared with float64
attention over the whole, unsharded sequence (``oracle.attention_autograd``).
"""

from __future__ import annotations

import json
import math
import queue
import subprocess
import sys
import time
from pathlib import Path

import distributed_workers as workers
import pytest
import torch
import torch.multiprocessing as mp
from conftest import TOLERANCE
from distributed_workers import Attention, Fault, Packed, PackedRoundTrip, Refusal, RoundTrip

import cudnn_attn
from cudnn_attn.bench.context_parallel import PADDED, SINGLE, VARLEN, document_lengths
from cudnn_attn.distributed import context_parallel_sdpa, shard, unshard

WORLD_TIMEOUT_S = 240  # every case of a world size, ranks started included; a hang fails, never waits

ATTENTION = [
    Attention(
        f"{mode}-{'causal' if causal else 'full'}-{layout}-{'gqa' if gqa else 'mha'}",
        mode=mode,
        is_causal=causal,
        layout=layout,
        heads=4 if gqa else 2,
        kv_heads=2,
        batch=2 if gqa else 1,
        head_dim=32 if gqa else 16,
    )
    for mode in ("p2p", "all_gather")
    for causal in (True, False)
    for layout in ("zigzag", "contiguous")
    for gqa in (False, True)
] + [
    Attention("p2p-causal-zigzag-fp16-d64", dtype="float16", head_dim=64),
    Attention("all_gather-causal-zigzag-fp16-d64", mode="all_gather", dtype="float16", head_dim=64),
    Attention("p2p-causal-zigzag-bshd-views-scale", bshd=True, heads=4, kv_heads=1, scale=0.3),
    Attention("all_gather-causal-contiguous-bshd-views", mode="all_gather", layout="contiguous", bshd=True),
    # Causal sliding windows (a window of 5 reaches into the next chunk but one; 2 only into the next) and sinks.
    *(
        Attention(
            f"{mode}-window{w}-{layout}{'-sinks' if sinks else ''}",
            mode=mode,
            layout=layout,
            window=w,
            sinks=sinks,
            chunk=3,
        )
        for mode in ("p2p", "all_gather")
        for layout, w, sinks in (("zigzag", 2, False), ("zigzag", 5, True), ("contiguous", 4, False))
    ),
    Attention("p2p-full-zigzag-sinks", is_causal=False, sinks=True),
    Attention("all_gather-causal-zigzag-sinks-gqa", mode="all_gather", sinks=True, heads=4, kv_heads=1),
]
# Packed documents: each (3, 1, 2) chunks of 2W (zigzag) or W (contiguous) tokens, causal per document.
PACKED = (
    [
        Packed(
            f"packed-{mode}-{'causal' if causal else 'full'}-{layout}{'-gqa' if gqa else ''}",
            mode=mode,
            is_causal=causal,
            layout=layout,
            heads=4 if gqa else 2,
            kv_heads=2,
        )
        for mode in ("p2p", "all_gather")
        for causal, layout, gqa in ((True, "zigzag", False), (False, "zigzag", True), (True, "contiguous", True))
    ]
    + [
        Packed(
            f"packed-{mode}-window{w}-zigzag{'-sinks' if sinks else ''}",
            mode=mode,
            window=w,
            sinks=sinks,
            docs=(4, 1, 2),
        )
        for mode in ("p2p", "all_gather")
        for w, sinks in ((3, True), (9, False))
    ]
    + [
        Packed("packed-p2p-causal-zigzag-fp16-one-document", docs=(5,), dtype="float16", head_dim=64),
        Packed("packed-all_gather-full-zigzag-sinks", mode="all_gather", is_causal=False, sinks=True),
    ]
)
ROUND_TRIPS = [
    RoundTrip(f"{layout}-seq_dim{dim}", layout, dim) for layout in ("zigzag", "contiguous") for dim in (1, 2)
] + [PackedRoundTrip(f"packed-{layout}", layout) for layout in ("zigzag", "contiguous")]
REFUSALS = [
    Refusal("unequal-shard-lengths", "ValidationError", "differs across ranks", per_rank={0: {"seq": 10}}),
    Refusal("dtype-differs-across-ranks", "ValidationError", "q: dtype differs", per_rank={1: {"dtype": "float16"}}),
    Refusal(
        "heads-differ-across-ranks",
        "ValidationError",
        "q: size of dim 1 differs",
        per_rank={1: {"heads": 4, "kv_heads": 4}},
    ),
    Refusal("odd-zigzag-shard-on-one-rank", "ValidationError", "is odd", per_rank={1: {"seq": 7}}),
    Refusal("odd-zigzag-shard", "ValidationError", "shard length 7 is odd", call={"seq": 7}),
    Refusal("bad-mode", "ValidationError", "mode: 'ring'", call={"mode": "ring"}),
    Refusal("bad-layout", "ValidationError", "layout: 'striped'", call={"layout": "striped"}),
    Refusal("gqa-needs-enable_gqa", "ValidationError", "enable_gqa=True", call={"heads": 4}),
    Refusal("thd-shards-without-cu_seqlens", "ValidationError", "need cu_seqlens", call={"dims": 3}),
    Refusal("shard-not-divisible", "ValidationError", "does not split", call={"seq": 10}, op="shard"),
    Refusal(
        "unshard-unequal-shards", "ValidationError", "differs across ranks", per_rank={0: {"seq": 6}}, op="unshard"
    ),
    # A nested tensor has no sizes to read: each was torch's RuntimeError on its rank, the others waiting.
    Refusal("nested-shards", "UnsupportedError", "q: a nested (ragged) tensor", call={"dims": "nested"}),
    Refusal("nested-on-one-rank", "UnsupportedError", "q: a nested", per_rank={0: {"dims": "nested"}}),
    Refusal(
        "unshard-nested-on-one-rank", "ValidationError", "x: a nested", per_rank={1: {"dims": "nested"}}, op="unshard"
    ),
    Refusal("meta-shards", "ValidationError", "q: on meta", call={"dims": "meta"}),
    # After a valid call equal to it: the agreed signature let it skip the checks (a bare ValueError
    # on one rank, the others waiting out the timeout; 1 accepted as is_causal).
    Refusal(
        "float-window-after-an-int-one",
        "ValidationError",
        "window_size: (2.0, 0)",
        call={"window": (2.0, 0)},
        after={"window": (2, 0)},
    ),
    Refusal(
        "int-is_causal-after-true", "ValidationError", "is_causal: 1", call={"is_causal": 1}, after={"is_causal": True}
    ),
    Refusal(
        "unshard-layouts-differ-across-ranks",
        "ValidationError",
        "layout differs across ranks",
        per_rank={1: {"layout": "contiguous"}},
        op="unshard",
    ),
    Refusal("dense-max_seqlen", "ValidationError", "max_seqlen: -3 without cu_seqlens", call={"max_seqlen": -3}),
    # Packed documents, windows and sinks (base packed call: 2 documents of 6W tokens, shards of 12).
    *(
        Refusal(name, expected, text, call={"dims": 3, "seq": 12, "cu": [6, 6], **call}, per_rank=per_rank)
        for name, expected, text, call, per_rank in (
            ("packed-document-not-divisible", "ValidationError", "not a multiple", {"cu": [5, 7]}, {}),
            (
                "packed-cu_seqlens-differ-across-ranks",
                "ValidationError",
                "cu_seqlens: checksum",
                {},
                {1: {"cu": [8, 4]}},
            ),
            ("packed-cu_seqlens-ends-past-the-shards", "ValidationError", "cu_seqlens: ends at", {"cu": [6, 12]}, {}),
            ("packed-cu_seqlens-float", "ValidationError", "cu_seqlens: float32", {"cu": "float"}, {}),
            ("packed-4d-shards", "ValidationError", "expected packed [T_shard, H, D]", {"dims": 4}, {}),
            ("window-right-bound", "UnsupportedError", "causal sliding window", {"window": (4, 3)}, {}),
            ("window-without-causal", "UnsupportedError", "causal sliding window", {"window": (4, -1)}, {}),
            ("window-malformed", "ValidationError", "window_size: (4,)", {"window": (4,)}, {}),
            ("sinks-wrong-shape", "ValidationError", "sinks: shape [3]", {"sinks": (3,)}, {}),
            ("sinks-on-one-rank", "ValidationError", "sinks: given differs", {}, {0: {"sinks": (2,)}}),
        )
    ),
    Refusal(
        "packed-shard-not-divisible", "ValidationError", "not a multiple", call={"dims": 3, "cu": [5, 7]}, op="shard"
    ),
]
FAULTS = [
    *(
        Fault(
            f"out-of-memory-in-the-{where}-{mode}{'-packed' if packed else ''}{'-last-rank' if rank else ''}",
            where,
            mode,
            packed,
            rank,
        )
        for where in ("forward", "backward")
        for mode in ("p2p", "all_gather")
        for packed in (False, True)
        for rank in (0, -1)
    ),
    Fault("shard-changes-on-one-rank-p2p", "shard"),
    Fault("shard-changes-on-one-rank-all_gather", "shard", mode="all_gather"),
    Fault("shard-changes-on-one-rank-packed", "shard", packed=True),
]
FAULT_SECONDS = 30  # every rank must have raised within this of the call
# Refusals and faults first: the attention cases after them show that no rank was left stuck.
CASES = [*REFUSALS, *FAULTS, *ROUND_TRIPS, *ATTENTION, *PACKED]


def run_ranks(world: int, cases: list, init_file: Path, backend: str = "gloo") -> dict[str, dict[int, dict]]:
    """Start ``world`` ranks running ``cases``; their outcomes by case id, then rank. A rank that
    does not report in time is killed and its missing outcomes read as a hang."""
    context = mp.get_context("spawn")
    results = context.Queue()
    ranks = [
        context.Process(target=workers.main, args=(rank, world, str(init_file), backend, cases, results))
        for rank in range(world)
    ]
    for process in ranks:
        process.start()
    outcomes: dict[str, dict[int, dict]] = {case.id: {} for case in cases}
    deadline = time.monotonic() + WORLD_TIMEOUT_S
    try:
        for _ in range(world * len(cases)):
            case_id, rank, outcome = results.get(timeout=max(1.0, deadline - time.monotonic()))
            outcomes[case_id][rank] = outcome
    except queue.Empty:
        pass  # the missing outcomes say which case hung
    finally:
        for process in ranks:
            process.join(timeout=max(1.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
    return outcomes


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def world(request, tmp_path_factory):
    """``(world size, outcomes by case)``: the ranks run once per world size for the module."""
    size = request.param
    return size, run_ranks(size, CASES, tmp_path_factory.mktemp(f"world{size}") / "init")


def _outcomes(world, case_id: str) -> list[dict]:
    size, outcomes = world
    found = outcomes[case_id]
    missing = [rank for rank in range(size) if rank not in found]
    assert not missing, f"ranks {missing} reported nothing for {case_id} (hung or crashed)"
    for rank, outcome in found.items():
        assert "unexpected" not in outcome, f"rank {rank}: {outcome['unexpected']}"
    return [found[rank] for rank in range(size)]


@pytest.mark.parametrize("case", ATTENTION + PACKED, ids=[c.id for c in ATTENTION + PACKED])
def test_results_and_gradients_match_unsharded_attention(world, case):
    tol = TOLERANCE[getattr(torch, case.dtype)]
    for rank, errors in enumerate(_outcomes(world, case.id)):
        assert set(errors) == {"out", "dq", "dk", "dv"} | ({"dsinks"} if case.sinks else set())
        for name, err in errors.items():
            assert err < tol, f"rank {rank}: {name} relative error {err:.2e} (tolerance {tol:.1e})"  # NaN fails


@pytest.mark.parametrize("case", ROUND_TRIPS, ids=[c.id for c in ROUND_TRIPS])
def test_shard_holds_the_layouts_chunks_and_unshard_rejoins_them(world, case):
    for rank, checks in enumerate(_outcomes(world, case.id)):
        assert checks == {"shard_exact": 1.0, "shard_contiguous": 1.0, "round_trip_exact": 1.0}, f"rank {rank}"


@pytest.mark.parametrize("case", REFUSALS, ids=[c.id for c in REFUSALS])
def test_every_rank_refuses_alike_and_none_hangs(world, case):
    for rank, outcome in enumerate(_outcomes(world, case.id)):
        assert outcome["raised"] == case.expected, f"rank {rank}: {outcome}"
        if case.per_rank and rank not in case.per_rank and "across ranks" not in case.text:
            continue  # a rank with good arguments names the rank that refused its own
        assert case.text in outcome["message"], f"rank {rank}: {outcome['message']}"


@pytest.mark.parametrize("case", FAULTS, ids=[c.id for c in FAULTS])
def test_a_fault_on_one_rank_ends_the_call_on_every_rank(world, case):
    """Out of memory inside a block's attention on one rank (forward or backward), or one rank's
    shard changing on a later call: every rank raises, within seconds, none waits for the group's
    timeout; the failed rank its own error, the others the same kind naming it."""
    size = world[0]
    faulty = case.rank % size
    expected = "ValidationError" if case.inject == "shard" else "OutOfMemoryError"
    for rank, outcome in enumerate(_outcomes(world, case.id)):
        assert outcome["raised"] == expected, f"rank {rank}: {outcome}"
        assert outcome["seconds"] < FAULT_SECONDS, f"rank {rank} took {outcome['seconds']:.1f} s"
        if case.inject == "shard":
            assert "differs across ranks" in outcome["message"], f"rank {rank}: {outcome['message']}"
        elif rank == faulty:
            assert "(injected)" in outcome["message"], f"rank {rank}: {outcome['message']}"
        else:
            assert f"rank {faulty} failed in the {case.inject}" in outcome["message"], outcome["message"]
            assert "(injected)" in outcome["message"]


ABSENT_TIMEOUT_S = 5.0


@pytest.mark.parametrize("size", [2, 3])
def test_a_rank_that_never_calls_holds_the_others_only_for_the_group_timeout(size, tmp_path):
    """What no call can see (a rank alive in the group that never calls) is bounded by the
    process group's timeout, as docs/training.md says: the calling ranks raise once it passes."""
    context = mp.get_context("spawn")
    results, done = context.Queue(), context.Event()
    ranks = [
        context.Process(
            target=workers.absent_rank, args=(rank, size, str(tmp_path / "init"), ABSENT_TIMEOUT_S, done, results)
        )
        for rank in range(size)
    ]
    for process in ranks:
        process.start()
    try:
        outcomes = dict(results.get(timeout=90) for _ in range(size - 1))
    finally:
        done.set()
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    for rank, outcome in sorted(outcomes.items()):
        assert outcome["raised"] != "nothing", f"rank {rank} returned with rank {size - 1} absent"
        assert ABSENT_TIMEOUT_S * 0.8 <= outcome["seconds"] < ABSENT_TIMEOUT_S + 20, f"rank {rank}: {outcome}"


def test_refusal_names_the_rank_that_refused_its_arguments(world):
    outcomes = _outcomes(world, "odd-zigzag-shard-on-one-rank")
    assert "shard length 7 is odd" in outcomes[1]["message"]
    for rank in (0, *range(2, world[0])):
        assert "group: rank 1 refused its own arguments" in outcomes[rank]["message"]


@pytest.mark.parametrize("call", ["context_parallel_sdpa", "shard", "unshard"])
def test_uninitialised_group_is_refused_not_waited_on(call):
    assert not torch.distributed.is_initialized()
    x = torch.randn(1, 2, 8, 16).to(torch.bfloat16)
    run = {
        "context_parallel_sdpa": lambda: context_parallel_sdpa(x, x, x),
        "shard": lambda: shard(x),
        "unshard": lambda: unshard(x),
    }[call]
    with pytest.raises(cudnn_attn.ValidationError, match="init_process_group"):
        run()


@pytest.mark.gpu
def test_nccl_on_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs ({torch.cuda.device_count()} here)")
    # Faults first: the attention cases after them show that no rank was left stuck or broken.
    cases = [*REFUSALS, *FAULTS, *ROUND_TRIPS, *ATTENTION, *PACKED]
    outcomes = run_ranks(2, cases, tmp_path / "init", backend="nccl")
    gpu_world = (2, outcomes)
    for case in cases:
        found = _outcomes(gpu_world, case.id)
        if isinstance(case, (Attention, Packed)):
            tol = TOLERANCE[getattr(torch, case.dtype)]
            for errors in found:
                assert all(err < tol for err in errors.values()), (case.id, errors)
        elif isinstance(case, Refusal):
            assert all(o["raised"] == case.expected for o in found), (case.id, found)
        elif isinstance(case, Fault):
            expected = "ValidationError" if case.inject == "shard" else "OutOfMemoryError"
            assert all(o["raised"] == expected and o["seconds"] < FAULT_SECONDS for o in found), (case.id, found)
        else:
            assert all(all(v == 1.0 for v in o.values()) for o in found), (case.id, found)


def test_bench_runs_on_cpu_ranks(tmp_path):
    """The benchmark's CPU path (gloo ranks, tiny shapes) runs and reports every column: p2p,
    its compute-only ring, the transfers alone and the single-device attention."""
    report = tmp_path / "bench.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "cudnn_attn.bench.context_parallel",
            "--cpu",
            "--gpus",
            "2",
            "--seq",
            "64",
            "--rounds",
            "2",
            "--json",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads(report.read_text())
    assert (data["world"], data["seq"], data["rounds"]) == (2, 64, 2)
    columns = ["context_parallel p2p", "context_parallel p2p, compute only", "communication only", SINGLE]
    assert sorted(data["cells"]) == sorted(columns)
    for column in columns:
        cell = data["cells"][column]
        assert math.isfinite(cell["median_ms"]) and cell["median_ms"] > 0
        assert cell["low_ms"] <= cell["median_ms"] <= cell["high_ms"]
    assert data["rel_err_vs_single"] < TOLERANCE[torch.bfloat16]  # NaN fails
    overlap = data["overlap"]
    assert overlap["transfers_ms"] > 0 and 0.0 <= overlap["hidden_fraction"] <= 1.0
    assert "overlap: the transfers add" in run.stdout


def test_bench_packed_documents_run_on_cpu_ranks(tmp_path):
    """The benchmark's packed-documents mode on gloo ranks: seeded long-tailed lengths in multiples
    of 2W summing to S, and every column (packed over the ranks, varlen and padded on one)."""
    report = tmp_path / "bench.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "cudnn_attn.bench.context_parallel",
            "--cpu",
            "--packed",
            "--gpus",
            "2",
            "--seq",
            "128",
            "--rounds",
            "2",
            "--json",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads(report.read_text())
    assert (data["world"], data["seq"], data["documents"]["count"]) == (2, 128, len(document_lengths(128, 2, tile=1)))
    columns = ["context_parallel p2p, packed", VARLEN, PADDED]
    assert sorted(data["cells"]) == sorted(columns)
    for column in columns:
        cell = data["cells"][column]
        assert math.isfinite(cell["median_ms"]) and cell["low_ms"] <= cell["median_ms"] <= cell["high_ms"]
    assert data["rel_err_vs_single"] < TOLERANCE[torch.bfloat16]  # NaN fails
    assert "x varlen" in run.stdout


@pytest.mark.parametrize("total,world,seed", [(131072, 2, 0), (262144, 4, 0), (64, 2, 3)])
def test_bench_document_lengths_are_long_tailed_multiples_of_2w_summing_to_s(total, world, seed):
    lengths = document_lengths(total, world, seed)
    assert sum(lengths) == total and all(n > 0 and n % (2 * world) == 0 for n in lengths)
    assert lengths == document_lengths(total, world, seed)  # seeded
    if total > 1000:  # a long tail: the longest is several times the median
        assert max(lengths) > 3 * sorted(lengths)[len(lengths) // 2]
