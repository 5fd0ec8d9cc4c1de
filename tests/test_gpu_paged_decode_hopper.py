"""The GQA decode kernel's Hopper form (``kernels/paged_decode_hopper.py``) and its Triton form
against float64 attention over the pages: every head dim, page size and layout it serves, sinks,
several query tokens, empty sequences, an engine's combined K/V tensor; caches whose rows past
each sequence's end hold NaN, outputs poisoned with NaN."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from conftest import rel_err

import cudnn_attn
from cudnn_attn.kernels import paged_decode_hopper as hopper_form
from cudnn_attn.kernels.paged_decode import paged_decode, supported
from cudnn_attn.kernels.paged_decode_hopper import paged_decode_hopper, usable

pytestmark = pytest.mark.gpu

TWENTY = [0] + [37 * i + 5 for i in range(1, 20)]  # 160 programs over 132 SMs

CASES = {  # q heads, kv heads, d, page, layout, lengths, s_q, splits, sink, dtype, stages
    "gqa4-one-split": (32, 8, 128, 64, "NHPD", [1000, 64, 4096], 1, 1, False, torch.bfloat16, None),
    "gqa4-splits-empty": (32, 8, 128, 64, "NHPD", [3000, 1, 0, 65], 1, 4, False, torch.bfloat16, None),
    "gqa4-nphd-sink": (32, 8, 128, 64, "NPHD", [2000, 777], 7, 1, True, torch.bfloat16, None),
    "two-stages": (32, 8, 128, 64, "NHPD", [4095, 130, 64], 1, 5, True, torch.bfloat16, 2),
    "mtp4-causal": (32, 8, 128, 64, "NHPD", [4000, 130, 4], 4, 3, False, torch.bfloat16, None),
    "mtp8-64-rows": (64, 8, 128, 128, "NPHD", [2500, 8], 8, 2, True, torch.bfloat16, None),
    "d64-page256": (8, 8, 64, 256, "NPHD", [3000, 300], 1, 2, False, torch.bfloat16, None),
    "d256-page128": (16, 2, 256, 128, "NHPD", [1500, 129], 2, 3, True, torch.bfloat16, None),
    "mqa-many-splits": (8, 1, 128, 64, "NHPD", [8192], 1, 40, True, torch.bfloat16, None),
    "fp16": (32, 8, 128, 64, "NHPD", [2048, 1500], 1, 4, False, torch.float16, None),
    # pages of 16 and 32 tokens: 4 or 2 pages a step, chunks that end inside a step
    "page16-odd-chunks": (32, 8, 128, 16, "NPHD", [3000, 17, 0, 130], 1, 7, True, torch.bfloat16, None),
    "page16-mtp4": (32, 8, 128, 16, "NHPD", [1000, 4], 4, 3, False, torch.bfloat16, None),
    "page32-d64": (16, 4, 64, 32, "NHPD", [2100, 33], 1, 4, False, torch.bfloat16, 2),  # 17-page chunks
    "page32-one-split": (32, 8, 128, 32, "NPHD", [700, 64], 2, 1, True, torch.float16, None),
    "d256-page16": (16, 2, 256, 16, "NHPD", [900, 40], 1, 3, True, torch.bfloat16, None),
    # more programs than SMs
    "page16-several-waves": (32, 8, 128, 16, "NPHD", TWENTY, 1, 1, False, torch.bfloat16, None),
}


def _pages(cache, layout, page_ids, kv_heads, dim):
    """A sequence's pages as ``[tokens, H_kv, D]``."""
    pages = cache[page_ids]
    return (pages.permute(0, 2, 1, 3) if layout == "NHPD" else pages).reshape(-1, kv_heads, dim)


def _reference(q, k_cache, v_cache, table, lengths, layout, scale, sink):
    """float64 attention of each query token over its visible keys (bottom-right causal)."""
    batch, heads, s_q, dim = q.shape
    kv_heads = k_cache.shape[1 if layout == "NHPD" else 2]
    out = torch.zeros(batch, heads, s_q, dim, dtype=torch.float64)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        k = _pages(k_cache, layout, table[b].long(), kv_heads, dim)[:n].double()
        v = _pages(v_cache, layout, table[b].long(), kv_heads, dim)[:n].double()
        for h in range(heads):
            s = q[b, h].double() @ k[:, h * kv_heads // heads].T * scale
            hidden = torch.arange(n)[None, :] >= n - s_q + 1 + torch.arange(s_q)[:, None]
            s = s.masked_fill(hidden, float("-inf"))
            if sink is not None:
                s = torch.cat([s, sink[h].double().expand(s_q, 1)], 1)
            out[b, h] = torch.softmax(s, -1)[:, :n] @ v[:, h * kv_heads // heads]
    return out


def _case(name, combined=False):
    heads, kv_heads, dim, page, layout, lengths, s_q, splits, with_sink, dtype, _ = CASES[name]
    gen = torch.Generator().manual_seed(len(name) + splits)
    pages = max(math.ceil(max(lengths) / page), splits)
    num_pages = len(lengths) * pages + 3
    shape = (num_pages, kv_heads, page, dim) if layout == "NHPD" else (num_pages, page, kv_heads, dim)
    kv = torch.randn(2, *shape, generator=gen).to(dtype)  # an engine's [K/V, pages, ...] tensor
    table = torch.randperm(num_pages, generator=gen)[: len(lengths) * pages].view(-1, pages).int()
    for cache in kv:  # every row past the end of a sequence: NaN
        for b, n in enumerate(lengths):
            rows = _pages(cache, layout, table[b].long(), kv_heads, dim)
            rows[n:] = float("nan")
            view = rows.view(pages, page, kv_heads, dim)
            cache[table[b].long()] = view.permute(0, 2, 1, 3) if layout == "NHPD" else view
    q = torch.randn(len(lengths), heads, s_q, dim, generator=gen).to(dtype)
    sink = torch.randn(heads, generator=gen) * 2 if with_sink else None
    scale = dim**-0.5
    want = _reference(q, kv[0], kv[1], table, lengths, layout, scale, sink)
    k_cache, v_cache = (kv.cuda()[0], kv.cuda()[1]) if combined else (kv[0].cuda(), kv[1].cuda())
    return q.cuda(), k_cache, v_cache, table.cuda(), lengths, scale, sink, want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("form", ["triton", "hopper", "hopper-64-rows"])
def test_paged_decode_matches_float64(case, form, monkeypatch):
    """Each form against float64: the Triton kernel, the Hopper form as chosen (its products
    turned over up to ``SWAPPED_MAX_ROWS`` query rows), and the Hopper form held to 64-row tiles."""
    if form == "hopper-64-rows":
        monkeypatch.setattr(hopper_form, "SWAPPED_MAX_ROWS", 0)
    q, k_cache, v_cache, table, lengths, scale, sink, want = _case(case)
    layout, splits, stages = CASES[case][4], CASES[case][7], CASES[case][10]
    if not supported(q.device, k_cache.shape[2 if layout == "NHPD" else 1], q.shape[-1]):
        pytest.skip("the decode kernel needs Triton")
    if form != "triton" and not usable(q, k_cache, v_cache, layout):
        pytest.skip("the Hopper form needs an sm_90 GPU and Gluon")
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
    chunk = math.ceil(table.shape[1] / splits)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    sink_gpu = None if sink is None else sink.cuda()
    options = dict(scale=scale, kv_layout=layout, splits=math.ceil(table.shape[1] / chunk), chunk_pages=chunk)
    if form != "triton":
        paged_decode_hopper(q, k_cache, v_cache, table, lens, out, sink=sink_gpu, stages=stages, **options)
    else:
        paged_decode(q, k_cache, v_cache, table, lens, out, sink=sink_gpu, **options)
    got = out.cpu().double()
    assert torch.isfinite(got).all(), f"{int((~torch.isfinite(got)).sum())} non-finite values"
    assert rel_err(got, want) < 1e-2
    assert got.abs().sum() > 0  # not the zeros of a launch that never ran


def _counted(monkeypatch):
    """Calls of the Hopper form from here on, counted (a fallback to the Triton form gives the
    same values: only the count tells them apart)."""
    calls = []
    launch = hopper_form.paged_decode_hopper

    def counted(*args, **kwargs):
        calls.append(1)
        return launch(*args, **kwargs)

    monkeypatch.setattr(hopper_form, "paged_decode_hopper", counted)
    return calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_engines_combined_kv_tensor_is_read_in_place(monkeypatch):
    q, k_cache, v_cache, table, lengths, scale, sink, want = _case("gqa4-nphd-sink", combined=True)
    if not usable(q, k_cache, v_cache, "NPHD"):
        pytest.skip("the Hopper form needs an sm_90 GPU and Gluon")
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    chunk = math.ceil(table.shape[1] / 3)
    options = dict(scale=scale, kv_layout="NPHD", splits=3, chunk_pages=chunk, sink=sink.cuda(), hopper=True)
    calls = _counted(monkeypatch)
    paged_decode(q, k_cache, v_cache, table, lens, out, **options)
    assert calls and rel_err(out.cpu().double(), want) < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("captured", [False, True], ids=["eager-forced", "captured"])
def test_a_serving_step_on_hopper_takes_the_hopper_form_and_matches_the_reference(captured, monkeypatch):
    """``PagedAttention`` over 16-bit caches on an sm_90 GPU: its schedule says the Hopper form,
    and the step equals the reference backend's."""
    q, k_cache, v_cache, table, lengths, scale, sink, want = _case("gqa4-splits-empty")
    if not usable(q, k_cache, v_cache, "NHPD"):
        pytest.skip("the Hopper form needs an sm_90 GPU and Gluon")
    fixed = {"max_batch": len(lengths), "max_pages_per_seq": table.shape[1]}
    options = {"cuda_graph": True, **fixed} if captured else {"decode_kernel": "triton"}
    attn = cudnn_attn.PagedAttention(32, 8, 128, 64, dtype=torch.bfloat16, device="cuda", **options)
    attn.plan(table, torch.tensor(lengths, dtype=torch.int32, device="cuda"))
    calls = _counted(monkeypatch)
    got = attn.run(q, k_cache, v_cache)
    assert attn.schedule.hopper and attn.schedule.kernel == "triton" and calls
    assert rel_err(got.cpu().double(), want) < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("form", ["triton", "hopper"])
def test_one_kv_heads_caches_that_differ_only_in_the_head_stride_are_read(form, monkeypatch):
    """One K/V head, NHPD: K from ``torch.empty`` (head stride P*D), V a token-major tensor's
    transpose (head stride D). torch calls both contiguous and the kernels never step along that
    dim, so both forms read them as they are (neither refused nor sent elsewhere)."""
    q, k_cache, v_cache, table, lengths, scale, sink, want = _case("mqa-many-splits")
    v_other = torch.empty_like(v_cache.transpose(1, 2), memory_format=torch.contiguous_format)
    v_other = v_other.copy_(v_cache.transpose(1, 2)).transpose(1, 2)  # [N, P, 1, D] memory
    assert v_other.stride(1) != k_cache.stride(1) and v_other.is_contiguous() and k_cache.is_contiguous()
    if not supported(q.device, k_cache.shape[2], q.shape[-1]):
        pytest.skip("the decode kernel needs Triton")
    if form == "hopper" and not usable(q, k_cache, v_other, "NHPD"):
        pytest.skip("the Hopper form needs an sm_90 GPU and Gluon")
    calls = _counted(monkeypatch)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    splits = CASES["mqa-many-splits"][7]
    chunk = math.ceil(table.shape[1] / splits)
    paged_decode(
        q,
        k_cache,
        v_other,
        table,
        lens,
        out,
        scale=scale,
        kv_layout="NHPD",
        splits=math.ceil(table.shape[1] / chunk),
        chunk_pages=chunk,
        sink=sink.cuda(),
        hopper=form == "hopper",
    )
    assert bool(calls) == (form == "hopper")
    assert rel_err(out.cpu().double(), want) < 1e-2


SPIN_NS = 200_000  # how long the writer holds its stores back after letting the decode start


@functools.cache
def _late_copy(spin_ns: int = SPIN_NS):
    """A Triton copy that lets the next kernel start at once (``launch_dependents`` at entry, as
    kernels of other libraries do), holds its stores back ``spin_ns``, then waits for the kernel
    before it and stores: a decode that read its inputs before its own wait would see the old
    values every time."""
    import triton
    import triton.language as tl

    from cudnn_attn.kernels.grid_dependency import triton_functions

    dependency = triton_functions()
    wait, release = dependency.wait, dependency.release

    @triton.jit
    def now():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)

    @triton.jit
    def late_copy(src, dst, n, SPIN: tl.constexpr, BLOCK: tl.constexpr):
        release()
        start = now()
        t = start
        while t - start < SPIN:
            t = now()
        wait()
        at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + at, tl.load(src + at, mask=at < n), mask=at < n)

    def copy(src: torch.Tensor, dst: torch.Tensor) -> None:
        flat_src, flat_dst = src.reshape(-1).view(torch.int16), dst.view(-1).view(torch.int16)
        n = flat_src.numel()
        late_copy[(triton.cdiv(n, 4096),)](flat_src, flat_dst, n, SPIN=spin_ns, BLOCK=4096, launch_pdl=True)

    return copy


def _splits_options(q, table, splits, scale, layout):
    chunk = math.ceil(table.shape[1] / splits)
    options = dict(scale=scale, kv_layout=layout, splits=math.ceil(table.shape[1] / chunk), chunk_pages=chunk)
    if options["splits"] > 1:  # one pair of partial buffers for every layer, as PagedAttention keeps
        rows = q.shape[1] * q.shape[2]
        options["partial_o"] = torch.empty(q.shape[0], options["splits"], rows, q.shape[-1], device="cuda")
        options["partial_lse"] = torch.empty(q.shape[0], options["splits"], rows, device="cuda")
    return options


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("launch", ["wait", "early"])
@pytest.mark.parametrize("case", ["gqa4-one-split", "gqa4-splits-empty", "page16-odd-chunks", "mtp4-causal"])
def test_a_dependent_launch_reads_what_the_kernel_before_it_wrote(case, launch):
    """Layers as a model runs them, every kernel a dependent launch: copies that let the decode
    start at once and store the layer's caches and query only 200 us later, then the decode and
    its merge (the partial buffers shared by every layer). Every layer's output is checked, in a
    graph replay and eagerly: a read before the copies completed would give another layer's
    values (or NaN: the live buffers are poisoned before each pass)."""
    q, k_cache, v_cache, table, lengths, scale, sink, want = _case(case)
    layout, splits = CASES[case][4], CASES[case][7]
    if not usable(q, k_cache, v_cache, layout):
        pytest.skip("the Hopper form needs an sm_90 GPU and Gluon")
    late_copy = _late_copy()
    layers = 3
    # Layer i's inputs: the case's K scaled by i + 1, its V negated every other layer.
    sources = [(k_cache * (i + 1), v_cache * (-1) ** i, q * (1 - 0.25 * i)) for i in range(layers)]
    live = [torch.empty_like(t) for t in sources[0]]
    outs = [torch.empty_like(q) for _ in range(layers)]
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    options = _splits_options(q, table, splits, scale, layout)
    if sink is not None:
        options["sink"] = sink.cuda()

    def step():
        for inputs, out in zip(sources, outs):
            for source, target in zip(inputs, live):
                late_copy(source, target)
            paged_decode_hopper(live[2], live[0], live[1], table, lens, out, dependent_launch=launch, **options)

    step()  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for replay in (graph.replay, step):  # captured, then eager
        for t in (*live, *outs):
            t.fill_(float("nan"))
        replay()
        torch.cuda.synchronize()
        for i, out in enumerate(outs):
            got = out.cpu().double()
            assert torch.isfinite(got).all(), f"layer {i}: {int((~torch.isfinite(got)).sum())} non-finite values"
            k, v, query = (t.cpu() for t in sources[i])
            expected = _reference(query, k, v, table.cpu(), lengths, layout, scale, sink)
            assert rel_err(got, expected) < 1e-2, f"layer {i}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_early_read_is_early_the_control_of_the_test_above():
    """The harness above can fail: a decode launched ``"early"`` right after a copy that writes
    new lengths 2 ms late reads the old ones (which is why only a decode after one that waited
    may read early), and a decode launched ``"wait"`` reads the new ones, every time. The early
    read is a race the copy's delay wins unless the GPU is shared and switches away for longer
    (other processes' work, as under a parallel test run): it must be seen in one of 5 tries."""
    q, k_cache, v_cache, table, lengths, scale, sink, _ = _case("gqa4-splits-empty")
    if not usable(q, k_cache, v_cache, "NHPD"):
        pytest.skip("the Hopper form needs an sm_90 GPU and Gluon")
    late_copy = _late_copy(2_000_000)
    old = [max(n - 700, 0) for n in lengths]
    live = torch.tensor(old, dtype=torch.int32, device="cuda")
    new = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    options = _splits_options(q, table, CASES["gqa4-splits-empty"][7], scale, "NHPD")
    reference = {
        name: _reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), table.cpu(), ls, "NHPD", scale, sink)
        for name, ls in (("old", old), ("new", lengths))
    }

    def decode(launch):
        out = torch.full_like(q, float("nan"))
        live.copy_(torch.tensor(old, dtype=torch.int32))
        paged_decode_hopper(q, k_cache, v_cache, table, live, out, dependent_launch="off", **options)  # compiled
        torch.cuda.synchronize()
        late_copy(new.view(torch.int16), live.view(torch.int16))
        paged_decode_hopper(q, k_cache, v_cache, table, live, out, dependent_launch=launch, **options)
        torch.cuda.synchronize()
        return out.cpu().double()

    early_reads = 0
    for _ in range(5):
        assert rel_err(decode("wait"), reference["new"]) < 1e-2
        early_reads += rel_err(decode("early"), reference["old"]) < 1e-2
    assert early_reads > 0, "the early decode read the new lengths in 5 tries: the harness cannot tell"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_captured_step_does_not_count_as_a_decode_that_waited(monkeypatch):
    """``PagedAttention``'s launches after each plan: the first decode waits, later layers read
    their tables early; a capture executes nothing, so its layers count apart: an eager layer
    right after a capture (no replay between) still waits."""
    q, k_cache, v_cache, table, lengths, *_ = _case("gqa4-splits-empty")
    if not usable(q, k_cache, v_cache, "NHPD"):
        pytest.skip("the Hopper form needs an sm_90 GPU and Gluon")
    fixed = {"max_batch": len(lengths), "max_pages_per_seq": table.shape[1], "cuda_graph": True}
    attn = cudnn_attn.PagedAttention(32, 8, 128, 64, dtype=torch.bfloat16, device="cuda", **fixed)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    modes = []
    launch = hopper_form.paged_decode_hopper

    def recorded(*args, **kwargs):
        modes.append(kwargs.get("dependent_launch", "off"))
        return launch(*args, **kwargs)

    monkeypatch.setattr(hopper_form, "paged_decode_hopper", recorded)
    attn.plan(table, lens)
    attn.run(q, k_cache, v_cache)  # compiled outside the capture
    attn.plan(table, lens)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(2):
            attn.run(q, k_cache, v_cache)
    eager = [attn.run(q, k_cache, v_cache) for _ in range(2)]
    graph.replay()
    torch.cuda.synchronize()
    assert modes == ["wait", "wait", "early", "wait", "early"]
    assert all(torch.isfinite(out).all() for out in eager)
