"""``PagedAttention`` on cuDNN against the reference backend on the same step: splits (empty
chunks included), packing and the causal tail; a whole step captured in a CUDA graph and
replayed after new plans; plan and run without a host sync."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err

import cudnn_attn
from cudnn_attn.kernels import mla_decode_hopper
from cudnn_attn.runtime.late_value import LateValue, capturing

pytestmark = pytest.mark.gpu

HQ, HKV, D, PAGE = 32, 8, 128, 64


def _step(lengths, pages_per_seq, s_q=1, seed=0, layout="NHPD", page=PAGE):
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    num_pages = batch * pages_per_seq + 5
    table = torch.randperm(num_pages, generator=gen)[: batch * pages_per_seq].view(batch, pages_per_seq).int()
    shape = (num_pages, HKV, page, D) if layout == "NHPD" else (num_pages, page, HKV, D)
    k_cache, v_cache = (torch.randn(*shape, generator=gen).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(batch, HQ, s_q, D, generator=gen).to(torch.bfloat16)
    return q, k_cache, v_cache, table, torch.tensor(lengths, dtype=torch.int32)


def _both(step, sinks=None, **options):
    """The same step on cuDNN and on the reference backend (CPU); ``sinks``: a sink per head."""
    q, k_cache, v_cache, table, lengths = step
    results = []
    for device in ("cuda", "cpu"):
        on_device = options if device == "cuda" else {k: v for k, v in options.items() if k != "decode_kernel"}
        attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device=device, **on_device)
        attn.plan(table.to(device), lengths.to(device))
        extra = {"sinks": sinks.to(device)} if sinks is not None else {}
        results.append((attn.run(q.to(device), k_cache.to(device), v_cache.to(device), **extra), attn.schedule))
    return results


CASES = {
    "decode-auto": dict(lengths=[3000, 40, 4096, 1], pages=64),
    "decode-b1-long": dict(lengths=[30000], pages=512),
    "decode-split8-empty-chunks": dict(lengths=[100, 2000, 65], pages=32, splits=8),
    "decode-unpacked-split": dict(lengths=[700, 4000], pages=64, splits=4, pack=False),
    "decode-packed-unsplit-long": dict(lengths=[32768, 20000], pages=512, splits=1, pack=True),
    "decode-packed-2-splits-long": dict(lengths=[32768], pages=512, splits=2, pack=True),
    "decode-nphd": dict(lengths=[500, 1000], pages=16, layout="NPHD", splits=2),
    "mtp-4": dict(lengths=[4000, 130, 64], pages=64, s_q=4),
    "mtp-8-split": dict(lengths=[8192, 8100, 1000, 9], pages=128, s_q=8, splits=4),
    "mtp-16": dict(lengths=[2048, 17], pages=32, s_q=16),
    "triton-b1-long": dict(lengths=[30000], pages=512, decode_kernel="triton"),
    "triton-empty-and-short": dict(lengths=[0, 1, 64, 65, 3000], pages=64, decode_kernel="triton"),
    "triton-one-chunk": dict(lengths=[700, 4000], pages=64, decode_kernel="triton", splits=1),
    "triton-nphd-odd-split": dict(lengths=[500, 1000, 999], pages=16, layout="NPHD", decode_kernel="triton", splits=3),
    "cudnn-forced-b1": dict(lengths=[30000], pages=512, decode_kernel="cudnn"),
    # several query tokens in the Triton kernel: G * S_q rows of one tile, causal per row
    "triton-mtp-4": dict(lengths=[4000, 130, 64, 4], pages=64, s_q=4, decode_kernel="triton"),
    "triton-mtp-8-split-short": dict(lengths=[8192, 8100, 1000, 9], pages=128, s_q=8, splits=5, decode_kernel="triton"),
    "triton-mtp-16-nphd": dict(lengths=[2048, 17, 1500], pages=32, s_q=16, layout="NPHD", decode_kernel="triton"),
    "triton-mtp-2-one-chunk": dict(lengths=[700, 2], pages=64, s_q=2, splits=1, decode_kernel="triton"),
    "sinks-triton-mtp-4-split": dict(
        lengths=[4000, 130], pages=64, s_q=4, splits=3, decode_kernel="triton", sinks=True
    ),
    # gpt-oss's sinks: in the Triton kernel's first chunk, or folded in after cuDNN's body or merge
    "sinks-triton-split-empty": dict(lengths=[0, 1, 3000], pages=64, decode_kernel="triton", sinks=True),
    "sinks-triton-one-chunk": dict(lengths=[700, 4000], pages=64, decode_kernel="triton", splits=1, sinks=True),
    "sinks-cudnn-packed-unsplit": dict(
        lengths=[2048, 5], pages=32, decode_kernel="cudnn", splits=1, pack=True, sinks=True
    ),
    "sinks-cudnn-unpacked-unsplit": dict(
        lengths=[2048, 0], pages=32, decode_kernel="cudnn", splits=1, pack=False, sinks=True
    ),
    "sinks-cudnn-split": dict(lengths=[9000, 100], pages=256, decode_kernel="cudnn", splits=4, sinks=True),
    "sinks-mtp-4-split": dict(lengths=[4000, 130], pages=64, s_q=4, splits=2, sinks=True),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_cudnn_matches_the_reference(case):
    spec = dict(CASES[case])
    lengths, pages, s_q = spec.pop("lengths"), spec.pop("pages"), spec.pop("s_q", 1)
    step = _step(lengths, pages, s_q=s_q, seed=len(case), layout=spec.get("layout", "NHPD"))
    layout = spec.pop("layout", "NHPD")
    forced = spec.pop("decode_kernel", None)
    sinks = torch.randn(HQ, generator=torch.Generator().manual_seed(9)) * 2 if spec.pop("sinks", False) else None
    kernel = {"decode_kernel": forced} if forced else {}
    (got, schedule), (want, _) = _both(step, sinks, kv_layout=layout, **spec, **kernel)
    assert forced is None or schedule.kernel == forced
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < 1.5e-2, schedule


@pytest.mark.parametrize("s_q", [1, 4], ids=["decode", "multi-token"])
@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("kernel", ["cudnn", "triton"])
def test_a_captured_step_replays_after_new_plans(kernel, sinks, s_q):
    """Two layers captured once; each later step is plan() then replay(), and matches runs of
    the same step not captured (with sinks: folded in inside the captured step too)."""
    extra = {"sinks": torch.randn(HQ, device="cuda")} if sinks else {}
    layers = 2
    max_batch, pages = 4, 32
    attn = cudnn_attn.PagedAttention(
        HQ,
        HKV,
        D,
        PAGE,
        dtype=torch.bfloat16,
        device="cuda",
        max_batch=max_batch,
        max_pages_per_seq=pages,
        cuda_graph=True,
        decode_kernel=kernel,
    )
    first = _step([100] * max_batch, pages, s_q=s_q, seed=1)
    q = first[0].cuda()
    caches = [(first[1].cuda() * (i + 1), first[2].cuda().roll(i, 0)) for i in range(layers)]
    outs = [torch.empty_like(q) for _ in range(layers)]
    attn.plan(first[3].cuda(), first[4].cuda())
    for (k, v), out in zip(caches, outs):  # warm up: graphs built, step derived once
        attn.run(q, k, v, out=out, **extra)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for (k, v), out in zip(caches, outs):
            attn.run(q, k, v, out=out, **extra)
    eager = cudnn_attn.PagedAttention(
        HQ,
        HKV,
        D,
        PAGE,
        dtype=torch.bfloat16,
        device="cuda",
        max_batch=max_batch,
        max_pages_per_seq=pages,
        cuda_graph=True,
        splits=attn.schedule.splits,
        decode_kernel=kernel,
    )
    for seed, lengths in enumerate(([2048, 5, 777, 1300], [64, 64, 2000, 4]), start=2):
        step = _step(lengths, pages, s_q=s_q, seed=seed)
        q.copy_(step[0])
        attn.plan(step[3].cuda(), step[4].cuda())
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        eager.plan(step[3].cuda(), step[4].cuda())
        for (k, v), out in zip(caches, outs):
            assert torch.equal(out, eager.run(q, k, v, **extra))
        reference = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device="cpu")
        reference.plan(step[3], step[4])
        want = reference.run(step[0], *(c.cpu() for c in caches[-1]), **{k: v.cpu() for k, v in extra.items()})
        assert rel_err(outs[-1], want) < 1.5e-2


def _poisoned_empty(monkeypatch):
    """``torch.empty`` filling floating CUDA tensors with NaN for the rest of a test: a part's
    partial outputs and statistics that cuDNN leaves unwritten (and nothing fills) reach the
    merged output as NaN, never as the zeros a freed block held before."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        if t.is_cuda and t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.mark.parametrize("planned_from", ["gpu", "gpu-busy", "host"])
@pytest.mark.parametrize(
    "options",
    [dict(decode_kernel="cudnn"), dict(decode_kernel="cudnn", splits=4), dict(decode_kernel="cudnn", splits=2)],
    ids=["plain", "split", "split-multi-token"],
)
def test_an_eager_step_binds_its_tables_again_after_each_plan(options, planned_from, monkeypatch):
    """Eager layers bind the step's tables once (``PreparedRun.bind``): every later plan, with
    other tables and lengths (empty sequences and empty chunks among them), is read afresh,
    layer after layer, into outputs (and intermediates) poisoned first. A part whose every row
    has keys skips the fill of empty rows (and is still exact) where the host knows the step's
    shortest length at the first layer: planned from host lengths, or from GPU lengths whose
    copy to the host has landed; a GPU still busy when the first layer binds keeps the fill, as
    does a part with an empty sequence or chunk."""
    s_q = 4 if options.get("splits") == 2 else 1
    pages = 32
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device="cuda", **options)
    reference = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device="cpu")
    steps = ([100, 2048, 5], [0, 1999, 64], [2048, 1999, 1700], [2048, 0, 700])
    q, k_cache, v_cache, table, seq_lens = (t.cuda() for t in _step(steps[0], pages, s_q=s_q))
    attn.plan(table, seq_lens)
    attn.run(q, k_cache, v_cache)  # the plans' first build (which reads values) before the steps
    _poisoned_empty(monkeypatch)
    for seed, lengths in enumerate(steps, start=3):
        q, k_cache, v_cache, table, seq_lens = _step(lengths, pages, s_q=s_q, seed=seed)
        on = "cpu" if planned_from == "host" else "cuda"
        table_on, lengths_on = table.to(on), seq_lens.to(on)
        layers = [(k_cache.roll(layer, 0), v_cache * (layer + 1)) for layer in range(3)]
        on_gpu = [(q.cuda(), k.cuda(), v.cuda()) for k, v in layers]  # copied before: a pageable copy waits
        outs = [torch.full((*q.shape[:-1], D), float("nan"), dtype=q.dtype, device="cuda") for _ in layers]
        torch.cuda.synchronize()
        if planned_from == "gpu-busy":
            torch.cuda._sleep(200_000_000)  # the shortest length's copy lands after the first layer binds
        attn.plan(table_on, lengths_on)
        if planned_from == "gpu":
            torch.cuda.synchronize()
        got = [attn.run(*tensors, out=out) for tensors, out in zip(on_gpu, outs)]
        reference.plan(table, seq_lens)
        empty = (torch.tensor(lengths) == 0).cuda()
        for layer, (k, v) in enumerate(layers):
            want = reference.run(q, k, v)
            assert torch.isfinite(got[layer]).all()
            assert rel_err(got[layer], want) < 1.5e-2, (seed, layer, attn.schedule)
            assert (got[layer][empty] == 0).all()
        # Which bound parts fill empty rows: every one while the GPU was busy; else each part
        # with a row whose derived length (its chunk's, its tail's) is zero.
        (derived,) = [d for d in attn._tables._derived.values() if d.get("bound")]
        fills = {key[0]: b._empty is not None or b._fix_after is not None for key, b in derived["bound"].items()}
        has_empty_row = {part: bool((derived[f"{part}_lengths"] <= 0).any()) for part in fills}
        want_fills = {part: planned_from == "gpu-busy" or has_empty_row[part] for part in fills}
        assert "body" in fills and fills == want_fills, (lengths, attn.schedule)


def test_each_plan_reads_its_own_shortest_length_whatever_the_stream():
    """A step planned on a busy stream, then one planned on an idle stream: the second step's
    shortest length is its own once its copy lands, and stays its own after the first's lands."""
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device="cuda", decode_kernel="cudnn")
    busy, idle = torch.cuda.Stream(), torch.cuda.Stream()
    first = [t.cuda() for t in _step([500, 900], 16)]
    second = [t.cuda() for t in _step([300, 1000], 16)]
    torch.cuda.synchronize()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(200_000_000)
        attn.plan(first[3], first[4])
    with torch.cuda.stream(idle):
        attn.plan(second[3], second[4])
    step = attn._tables.step
    idle.synchronize()
    assert step.shortest() == 300
    torch.cuda.synchronize()
    assert step.shortest() == 300


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_step_on_another_gpu_than_the_current_one_reads_its_own_device():
    """``PagedAttention(device="cuda:1")`` planned while cuda:0 is current and idle, cuda:1 busy:
    the step's shortest length is not known until cuda:1's copy lands, and its first layer keeps
    the fill (exact, empty rows zero)."""
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device="cuda:1", decode_kernel="cudnn")
    q, k_cache, v_cache, table, lengths = (t.to("cuda:1") for t in _step([0, 700, 2000], 32, seed=4))
    attn.plan(table, lengths)
    attn.run(q, k_cache, v_cache)  # plans built
    torch.cuda.synchronize("cuda:1")
    with torch.cuda.device(1):
        torch.cuda._sleep(200_000_000)
    attn.plan(table, lengths)
    assert attn._tables.step.shortest() is None
    got = attn.run(q, k_cache, v_cache)
    torch.cuda.synchronize("cuda:1")
    assert attn._tables.step.shortest() == 0
    reference = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device="cpu")
    reference.plan(table.cpu(), lengths.cpu())
    want = reference.run(q.cpu(), k_cache.cpu(), v_cache.cpu())
    assert torch.isfinite(got).all() and (got[0] == 0).all()
    assert rel_err(got, want) < 1.5e-2


def test_a_cuda_device_past_this_hosts_last_is_refused_naming_it():
    count = torch.cuda.device_count()
    with pytest.raises(cudnn_attn.ValidationError, match=f"device: 'cuda:{count}'; this host has {count} CUDA"):
        cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device=f"cuda:{count}")
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device="cuda")
    assert attn.device == torch.device("cuda", torch.cuda.current_device())


def test_caches_laid_out_unlike_each_other_run_on_cudnn_and_are_refused_by_the_decode_kernel():
    """V stored token-major ([N, P, H, D] memory) beside a head-major K, one shape: cuDNN's calls
    take each cache's strides; the decode kernel walks both with K's, so it refuses, naming v_cache
    (not an ``AssertionError``, nor V read with K's strides)."""
    q, k_cache, v_cache, table, lengths = (t.cuda() for t in _step([300, 1000], 16, seed=3))
    v_other = v_cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)  # same values and shape
    assert v_other.stride() != k_cache.stride()
    cudnn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device="cuda", decode_kernel="cudnn")
    cudnn.plan(table, lengths)
    got = cudnn.run(q, k_cache, v_other)
    reference = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device="cpu")
    reference.plan(table.cpu(), lengths.cpu())
    assert rel_err(got, reference.run(q.cpu(), k_cache.cpu(), v_cache.cpu())) < 1.5e-2
    kernel = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device="cuda", decode_kernel="triton")
    kernel.plan(table, lengths)
    with pytest.raises(cudnn_attn.UnsupportedError, match="v_cache: strides .* differ from k_cache's"):
        kernel.run(q, k_cache, v_other)


def test_plan_and_run_make_no_host_sync():
    q, k_cache, v_cache, table, lengths = (t.cuda() for t in _step([1000, 3000], 64, s_q=4, seed=9))
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device="cuda")
    attn.plan(table, lengths)
    attn.run(q, k_cache, v_cache)  # builds the graphs (their first build checks values)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        attn.plan(table, lengths)
        attn.run(q, k_cache, v_cache)
        attn.run(q, k_cache, v_cache)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_late_value_is_read_once_landed_and_never_waited_for():
    """``LateValue``: None before its copy lands (the GPU busy), the value after; reading never
    syncs. ``capturing`` says when a device's current stream captures a graph."""
    value = torch.tensor(41, dtype=torch.int32, device="cuda")
    torch.cuda._sleep(200_000_000)
    late = LateValue(value + 1)
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert late.read() is None
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert late.read() == 42
    graph, seen = torch.cuda.CUDAGraph(), []
    with torch.cuda.graph(graph):
        seen.append(capturing(value.device))
        value.add_(1)
    assert seen == [True] and not capturing(value.device)


def _prefill_step(q_lens, kv_lens, pages_per_seq, seed=0, spare_tokens=0):
    _, k_cache, v_cache, table, lengths = _step(kv_lens, pages_per_seq, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(q_lens) + spare_tokens, HQ, D, generator=gen).to(torch.bfloat16)
    return q, k_cache, v_cache, table, lengths, torch.tensor(q_lens, dtype=torch.int32)


PREFILLS = {
    "mixed-1-512-over-16k": dict(q_lens=[512, 1, 300, 77, 1, 512], kv_lens=[16384, 9000, 300, 4000, 1, 700]),
    "whole-prompts": dict(q_lens=[1000, 129, 64], kv_lens=[1000, 129, 64]),
    "with-empty-slot-and-spare-rows": dict(q_lens=[33, 0, 200], kv_lens=[5000, 0, 200], spare=40),
}


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("case", PREFILLS, ids=list(PREFILLS))
def test_chunked_prefill_matches_the_reference(case, sinks):
    spec = PREFILLS[case]
    extra = {"sinks": torch.randn(HQ, generator=torch.Generator().manual_seed(8))} if sinks else {}
    q, k_cache, v_cache, table, lengths, q_lens = _prefill_step(
        spec["q_lens"], spec["kv_lens"], 256, seed=len(case), spare_tokens=spec.get("spare", 0)
    )
    results = []
    for device in ("cuda", "cpu"):
        attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device=device)
        attn.plan(table.to(device), lengths.to(device), q_lens=q_lens.to(device))
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=device)
        on = {name: t.to(device) for name, t in extra.items()}
        results.append(attn.run(q.to(device), k_cache.to(device), v_cache.to(device), out=out, **on).cpu())
    got, want = results
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < 1.5e-2


def test_a_captured_prefill_step_replays_after_new_plans():
    """Fixed token budget T: q_lens on the GPU change per step; plan() then replay() matches eager."""
    max_batch, pages, tokens = 4, 32, 512
    attn = cudnn_attn.PagedAttention(
        HQ,
        HKV,
        D,
        PAGE,
        dtype=torch.bfloat16,
        device="cuda",
        max_batch=max_batch,
        max_pages_per_seq=pages,
        cuda_graph=True,
    )
    first = _prefill_step([128] * 4, [1000] * 4, pages, seed=3)
    q = first[0].cuda()
    k, v = first[1].cuda(), first[2].cuda()
    out = torch.empty_like(q)
    attn.plan(first[3].cuda(), first[4].cuda(), q_lens=first[5].cuda())
    attn.run(q, k, v, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q, k, v, out=out)
    eager = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device="cuda")
    for seed, (q_lens, kv_lens) in enumerate(
        (([500, 1, 11], [2000, 1, 11]), ([7, 300, 5, 200], [7, 900, 64, 2000])), start=4
    ):
        step = _prefill_step(q_lens, kv_lens, pages, seed=seed, spare_tokens=tokens - sum(q_lens))
        q.copy_(step[0])
        attn.plan(step[3].cuda(), step[4].cuda(), q_lens=step[5].cuda())
        out.fill_(float("nan"))
        graph.replay()
        eager.plan(step[3].cuda(), step[4].cuda(), q_lens=step[5].cuda())
        want = eager.run(q, k, v)
        assert torch.isfinite(out).all()
        assert rel_err(out, want) < 1e-3


def test_a_prefill_step_makes_no_host_sync():
    q, k_cache, v_cache, table, lengths, q_lens = (t.cuda() for t in _prefill_step([300, 40], [3000, 40], 64, seed=8))
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device="cuda")
    attn.plan(table, lengths, q_lens=q_lens)
    attn.run(q, k_cache, v_cache)  # builds the graph
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        attn.plan(table, lengths, q_lens=q_lens)
        attn.run(q, k_cache, v_cache)
        attn.run(q, k_cache, v_cache)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_one_prefill_step_may_run_several_token_counts():
    """q_lens on the GPU and layers given q of 36 and of 20 tokens in turn: each token count
    keeps its own lengths (cut at 20 tokens the second sequence is empty), never another's."""
    q, k_cache, v_cache, table, lengths, q_lens = (
        t.cuda() for t in _prefill_step([20, 9], [3000, 40], 64, seed=12, spare_tokens=7)
    )
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device="cuda")
    attn.plan(table, lengths, q_lens=q_lens)
    wants = {}
    for tokens, planned in ((36, [20, 9]), (20, [20, 0])):
        ref = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device="cpu")
        ref.plan(table.cpu(), lengths.cpu(), q_lens=torch.tensor(planned, dtype=torch.int32))
        wants[tokens] = ref.run(q[:tokens].cpu(), k_cache.cpu(), v_cache.cpu())
    for tokens in (36, 20, 36, 20):
        got = attn.run(q[:tokens], k_cache, v_cache).cpu()
        assert rel_err(got, wants[tokens]) < 1.5e-2, tokens


@pytest.mark.parametrize("s_q", [None, 1, 4], ids=["prefill", "decode", "multi-token"])
def test_a_step_over_a_larger_cache_reads_its_own_pages(s_q):
    """A step over 8 pages, then one over 16 whose sequences live in pages 8-15, on one
    instance: the second step runs graphs built for 16 pages (one kept for 8 read page 7)."""
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(50)
    for num_pages, first_page in ((8, 0), (16, 8)):
        table = torch.arange(first_page, first_page + 8, dtype=torch.int32).view(2, 4)
        k_cache, v_cache = (torch.randn(num_pages, HKV, PAGE, D, generator=gen).to(torch.bfloat16) for _ in range(2))
        lengths = torch.tensor([200, 256], dtype=torch.int32)
        q_lens = torch.tensor([70, 33], dtype=torch.int32) if s_q is None else None
        q = torch.randn(103, HQ, D, generator=gen) if s_q is None else torch.randn(2, HQ, s_q, D, generator=gen)
        q = q.to(torch.bfloat16)
        ref = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device="cpu")
        ref.plan(table, lengths, q_lens=q_lens)
        want = ref.run(q, k_cache, v_cache)
        attn.plan(table.cuda(), lengths.cuda(), q_lens=None if q_lens is None else q_lens.cuda())
        got = attn.run(q.cuda(), k_cache.cuda(), v_cache.cuda()).cpu()
        assert rel_err(got, want) < 1.5e-2, num_pages


def test_pages_past_the_cache_are_clamped_on_the_gpu_without_a_sync_and_refused_from_the_host():
    """A GPU page table is not read on the host: a page past the cache reads its last page,
    without a sync or an error. A host page table is checked at run, on a GPU too."""
    q, k_cache, v_cache, table, lengths = _step([200, 256], 4, seed=60)
    num_pages = k_cache.shape[0]
    bad = table.clone()
    bad[1, 3] = num_pages + 3
    clamped = bad.clamp(max=num_pages - 1)
    ref = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device="cpu")
    ref.plan(clamped, lengths)
    want = ref.run(q, k_cache, v_cache)
    q, k_cache, v_cache = q.cuda(), k_cache.cuda(), v_cache.cuda()
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device="cuda")
    attn.plan(table.cuda(), lengths.cuda())
    attn.run(q, k_cache, v_cache)  # builds the graphs
    bad_on_gpu, lengths_on_gpu = bad.cuda(), lengths.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        attn.plan(bad_on_gpu, lengths_on_gpu)
        got = attn.run(q, k_cache, v_cache)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rel_err(got.cpu(), want) < 1.5e-2
    attn.plan(bad, lengths)
    with pytest.raises(cudnn_attn.ValidationError, match=f"sequence 1, entry 3 is page {num_pages + 3}"):
        attn.run(q, k_cache, v_cache)


MLA_CASES = {
    "h128-auto-triton": dict(heads=128, lengths=[2048, 700, 0], kernel="triton"),
    "h128-cudnn": dict(heads=128, lengths=[2048, 700], forced="cudnn"),
    "h128-triton-sinks": dict(heads=128, lengths=[3000, 1], kernel="triton", sinks=True),
    "h16-b2-triton-nphd-split3": dict(heads=16, lengths=[4096, 100], kernel="triton", layout="NPHD", splits=3),
    "h16-b1-auto": dict(heads=16, lengths=[32000], kernel="triton on Hopper"),
    # eager, one sequence over 2k tokens: cuDNN's reads cost the GPU less than our launches the host
    "h16-b1-eager-small-cudnn": dict(heads=16, lengths=[2048], kernel="cudnn"),
    "h16-mtp-2": dict(heads=16, lengths=[1000, 64], kernel="cudnn", s_q=2),
}


@pytest.mark.parametrize("case", MLA_CASES, ids=list(MLA_CASES))
def test_mla_decode_matches_the_reference(case):
    """DeepSeek-V3's MLA geometry: one latent head of 576 (512 + rope 64) shared by every query
    head, V the latent's first 512 dims (a view of the same cache), page 64: the Triton MLA
    kernel (chosen, or forced) and cuDNN's paths against the reference backend."""
    spec = MLA_CASES[case]
    heads, lengths, layout, s_q = spec["heads"], spec["lengths"], spec.get("layout", "NHPD"), spec.get("s_q", 1)
    d, dv, page = 576, 512, 64
    pages = max(lengths) // page + 1
    gen = torch.Generator().manual_seed(len(case))
    table = torch.randperm(len(lengths) * pages + 3, generator=gen)[: len(lengths) * pages].view(-1, pages).int()
    shape = (len(lengths) * pages + 3, 1, page, d) if layout == "NHPD" else (len(lengths) * pages + 3, page, 1, d)
    latent = torch.randn(*shape, generator=gen).bfloat16()
    q = torch.randn(len(lengths), heads, s_q, d, generator=gen).bfloat16()
    sinks = torch.randn(heads, generator=gen) * 2 if spec.get("sinks") else None
    results = []
    for device in ("cuda", "cpu"):
        options = dict(splits=spec.get("splits"), kv_layout=layout)
        if device == "cuda" and "forced" in spec:
            options["decode_kernel"] = spec["forced"]
        attn = cudnn_attn.PagedAttention(
            heads, 1, d, page, dtype=torch.bfloat16, head_dim_v=dv, scale=192**-0.5, device=device, **options
        )
        cache = latent.to(device)
        attn.plan(table.to(device), torch.tensor(lengths, dtype=torch.int32, device=device))
        extra = {"sinks": sinks.to(device)} if sinks is not None else {}
        results.append((attn.run(q.to(device), cache, cache[..., :dv], **extra).cpu(), attn.schedule))
    (got, schedule), (want, _) = results
    expected = spec.get("kernel", spec.get("forced"))
    if expected == "triton on Hopper":  # one sequence of 16 heads: our kernel only where the Hopper one serves
        expected = "triton" if mla_decode_hopper.serves(torch.device("cuda"), page, d, dv) else "cudnn"
    assert schedule.kernel == expected, schedule
    assert torch.isfinite(got).all() and rel_err(got, want) < 1.5e-2, schedule
