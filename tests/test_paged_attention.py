"""``PagedAttention`` (plan per step, run per layer) on the reference backend: every layout of a
step (splits, packing, the causal tail) against float64 attention of each sequence's gathered
cache, bad steps refused at plan time, and the layout choice."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import rel_err

import cudnn_attn
from cudnn_attn.errors import UnsupportedError, ValidationError
from cudnn_attn.ops import dispatch
from cudnn_attn.ops.decode_step import DecodeStep
from cudnn_attn.serving import schedule as paged_schedule
from cudnn_attn.serving.step import keyed_parts, launch_after_tables, launched

HQ, HKV, D, PAGE = 8, 2, 32, 16


def make_step(lengths, pages_per_seq, layout="NHPD", s_q=1, seed=0, dtype=torch.bfloat16, extra_pages=3):
    """A step's tensors: pages handed out in a random order, caches with spare pages."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    num_pages = batch * pages_per_seq + extra_pages
    table = torch.randperm(num_pages, generator=gen)[: batch * pages_per_seq].view(batch, pages_per_seq).int()
    shape = (num_pages, HKV, PAGE, D) if layout == "NHPD" else (num_pages, PAGE, HKV, D)
    k_cache, v_cache = (torch.randn(*shape, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(batch, HQ, s_q, D, generator=gen).to(dtype)
    return q, k_cache, v_cache, table, torch.tensor(lengths, dtype=torch.int32)


def expected(q, k_cache, v_cache, table, lengths, layout="NHPD", sinks=None):
    """float64 attention of each sequence against its gathered cache; the S_q query tokens are
    the sequence's last positions (bottom-right causal); ``sinks`` ``[HQ]``: one more score
    column per head that weighs no value."""
    outs = []
    for b, n in enumerate(lengths.tolist()):
        pages = table[b].long()
        k, v = (c[pages] if layout == "NPHD" else c[pages].transpose(1, 2) for c in (k_cache, v_cache))
        k, v = (x.reshape(-1, HKV, D)[:n].transpose(0, 1).double() for x in (k, v))  # [HKV, n, D]
        k, v = (x.repeat_interleave(HQ // HKV, 0) for x in (k, v))
        s_q = q.shape[2]
        scores = q[b].double() @ k.transpose(-1, -2) * D**-0.5
        visible = torch.arange(n)[None, :] <= (n - s_q + torch.arange(s_q))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            column = sinks.double().view(HQ, 1, 1).expand(HQ, s_q, 1)
            outs.append(torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1] @ v)
            continue
        outs.append(torch.softmax(scores, -1) @ v)
    return torch.stack(outs)


@pytest.mark.parametrize("layout", ["NHPD", "NPHD"])
@pytest.mark.parametrize("splits,pack", [(1, False), (1, True), (2, True), (4, False)], ids=str)
def test_decode_matches_each_sequence_alone(layout, splits, pack):
    q, k_cache, v_cache, table, lengths = make_step([37, 64, 1, 50], pages_per_seq=4, layout=layout, seed=splits)
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, kv_layout=layout, splits=splits, pack=pack)
    attn.plan(table, lengths)
    out = attn.run(q, k_cache, v_cache)
    assert attn.schedule is not None and attn.schedule.packed == pack and attn.schedule.splits == splits
    assert rel_err(out, expected(q, k_cache, v_cache, table, lengths, layout)) < 1e-2


@pytest.mark.parametrize("s_q", [2, 4, 16])
@pytest.mark.parametrize("splits", [1, 2])
def test_multi_token_decode_is_bottom_right_causal(s_q, splits):
    """Each sequence's S_q query tokens are its last positions: the tail (keys some query token
    cannot see) runs apart with the causal mask, the body packed and split."""
    q, k_cache, v_cache, table, lengths = make_step([40, 64, 17, 33], pages_per_seq=4, s_q=s_q, seed=s_q)
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, splits=splits)
    attn.plan(table, lengths)
    out = attn.run(q, k_cache, v_cache)
    assert attn.schedule.tail and attn.schedule.packed
    assert rel_err(out, expected(q, k_cache, v_cache, table, lengths)) < 1e-2


def test_one_plan_serves_every_layer_and_out_is_written_in_place():
    q, k_cache, v_cache, table, lengths = make_step([30, 9], pages_per_seq=2, seed=5)
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, splits=2)
    attn.plan(table, lengths)
    for layer in range(3):
        k_layer, v_layer = k_cache * (layer + 1), v_cache.roll(layer, 0)
        out = torch.full_like(q, float("nan"))
        assert attn.run(q, k_layer, v_layer, out=out) is out
        assert rel_err(out, expected(q, k_layer, v_layer, table, lengths)) < 1e-2
    assert attn.plans == 1


@pytest.mark.parametrize("s_q,splits", [(1, 1), (1, 2), (2, 2)], ids=["plain", "split", "split-and-tail"])
def test_eager_steps_read_each_plans_tables_afresh(s_q, splits):
    """Eager steps of one instance, each a new plan of the same shapes with other pages and
    lengths (an empty sequence among them), layer after layer into poisoned outputs. Here the
    reference reads the step's buffers as they are; that cuDNN's bound runs (which hold clamped
    copies) are bound again after each plan is ``test_gpu_paged_attention``'s to show."""
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, splits=splits)
    for seed, lengths in enumerate(([37, 64, 5], [0, 50, 64], [64, 2, 0]), start=11):
        q, k_cache, v_cache, table, seq_lens = make_step(lengths, pages_per_seq=4, s_q=s_q, seed=seed)
        attn.plan(table, seq_lens)
        for layer in range(2):
            k_layer, v_layer = k_cache.roll(layer, 0), v_cache * (layer + 1)
            out = attn.run(q, k_layer, v_layer, out=torch.full_like(q, float("nan")))
            live = seq_lens > 0
            want = expected(q[live], k_layer, v_layer, table[live], seq_lens[live])
            assert rel_err(out[live], want) < 1e-2, (seed, layer)
            assert (out[~live] == 0).all()


def test_cuda_graph_mode_pads_the_batch_and_follows_new_plans():
    """Fixed buffers of max_batch rows: smaller batches run as empty sequences; each plan
    rewrites the buffers in place (what a captured step reads)."""
    attn = cudnn_attn.PagedAttention(
        HQ, HKV, D, PAGE, dtype=torch.bfloat16, max_batch=4, max_pages_per_seq=4, cuda_graph=True, splits=2
    )
    buffers = None
    for step, lengths in enumerate(([20, 64], [5, 33, 60])):
        q, k_cache, v_cache, table, lens = make_step(lengths, pages_per_seq=4, seed=10 + step)
        attn.plan(table, lens)
        out = attn.run(q, k_cache, v_cache)
        assert out.shape == q.shape
        assert rel_err(out, expected(q, k_cache, v_cache, table, lens)) < 1e-2
        current = {name: t.data_ptr() for name, t in attn._buffers.items() if name in ("table", "lengths")}
        assert buffers is None or current == buffers  # the same memory, rewritten
        buffers = current


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "cuda-graph"])
def test_the_first_decode_after_each_plan_waits_for_the_tables_it_wrote(cuda_graph):
    """A decode kernel may read its length and page indices before the kernel ahead of it has
    completed (``kernels/grid_dependency``) only where that kernel cannot be their writer. On the
    CPU no decode kernel launches, so this checks the rule's two halves here: the helpers' count
    (first "wait", then "early"; asking does not count) and that each ``plan`` derives every
    geometry's tables anew, as does a geometry first run mid-step. The launches themselves are
    test_gpu_paged_decode_hopper's (a capture counted apart among them)."""
    fixed = {"max_batch": 2, "max_pages_per_seq": 4, "cuda_graph": True} if cuda_graph else {}
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, **fixed)
    cpu = torch.device("cpu")

    def launches(derived, count):
        found = []
        for _ in range(count):
            mode, mark = launch_after_tables(derived, cpu)
            found.append(mode)
            launched(derived, mark)
        return found

    for seed in (1, 2):
        q, k_cache, v_cache, table, lengths = make_step([30, 9], pages_per_seq=4, seed=seed)
        attn.plan(table, lengths)
        attn.run(q, k_cache, v_cache)
        derived = attn._tables.get(("decode", 1, k_cache.shape[0]), attn._tables.step)
        assert launch_after_tables(derived, cpu)[0] == "wait"  # asked, not launched: still the first
        assert launches(derived, 3) == ["wait", "early", "early"]
        larger = torch.cat([k_cache, k_cache])  # a new geometry: its tables derived now
        attn.run(q, larger, larger)
        assert launches(attn._tables.get(("decode", 1, larger.shape[0]), attn._tables.step), 1) == ["wait"]


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_pages_past_the_cache_are_refused_at_run_naming_the_sequence_and_the_page(prefill):
    """A host page table is checked against each cache run() is given: the plan cannot know
    the cache, and the reference backend would clamp the page to the cache's last one."""
    q, k_cache, v_cache, table, lengths, q_lens = packed_step([5, 7], [40, 60], pages_per_seq=4, seed=6)
    num_pages = k_cache.shape[0]  # 2 * 4 + 3
    table[1, 3] = num_pages + 1
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16)
    if prefill:
        attn.plan(table, lengths, q_lens=q_lens)
    else:
        attn.plan(table, lengths)
        q = torch.zeros(2, HQ, 1, D, dtype=torch.bfloat16)
    message = f"page_table: sequence 1, entry 3 is page {num_pages + 1}; the cache has {num_pages} pages"
    with pytest.raises(ValidationError, match=message):
        attn.run(q, k_cache, v_cache)
    larger = [torch.cat([c, c[:2]]) for c in (k_cache, v_cache)]  # the same plan over a cache holding that page
    assert torch.isfinite(attn.run(q, *larger)).all()


@pytest.mark.parametrize("s_q", [None, 1, 4], ids=["prefill", "decode", "multi-token"])
def test_a_step_over_a_larger_cache_reads_its_own_pages(s_q):
    """A step over 8 pages, then one over 16 whose sequences live in pages 8-15: the second
    step's graphs are those of a 16-page cache (a graph kept for 8 pages refused pages 8-15
    on the CPU and read page 7 instead on cuDNN)."""
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(40)
    for num_pages, first_page in ((8, 0), (16, 8)):
        table = torch.arange(first_page, first_page + 8, dtype=torch.int32).view(2, 4)
        k_cache, v_cache = (torch.randn(num_pages, HKV, PAGE, D, generator=gen).to(torch.bfloat16) for _ in range(2))
        lengths = torch.tensor([50, 64], dtype=torch.int32)
        if s_q is None:
            q_lens = torch.tensor([5, 7], dtype=torch.int32)
            q = torch.randn(12, HQ, D, generator=gen).to(torch.bfloat16)
            attn.plan(table, lengths, q_lens=q_lens)
            want = expected_packed(q, k_cache, v_cache, table, lengths, q_lens)
        else:
            q = torch.randn(2, HQ, s_q, D, generator=gen).to(torch.bfloat16)
            attn.plan(table, lengths)
            want = expected(q, k_cache, v_cache, table, lengths)
        assert rel_err(attn.run(q, k_cache, v_cache), want) < 1e-2, num_pages


def test_a_prepared_run_serves_only_its_own_problem():
    """A paged call's prepared run is reused only for the same problem: any tensor's geometry
    (the caches' page count, V's strides apart from K's), the dtype, the scale or the plan's
    longest chunk prepares another; a packed q's token count does not (the plan reads it at run
    time: ``AttentionProblem.for_plan``)."""
    from cudnn_attn.runtime import prepared

    _, k_cache, v_cache, table, lengths = make_step([40, 60], pages_per_seq=4, seed=7)
    q = torch.zeros(40, HQ, D, dtype=torch.bfloat16)
    prepared.clear()  # every problem below is prepared anew

    def new_runs(attn, q, k, v, q_lens=(5, 7)):
        """How many runs one planned step's run() prepares."""
        before = prepared.held()
        attn.plan(table, lengths, q_lens=torch.tensor(q_lens, dtype=torch.int32))
        attn.run(q, k, v)
        return sum(all(run is not old for old in before) for run in prepared.held())

    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16)
    assert new_runs(attn, q[:12], k_cache, v_cache) == 1
    assert new_runs(attn, q, k_cache, v_cache) == 0  # 40 tokens: the same problem
    larger = [torch.cat([c, c[:5]]) for c in (k_cache, v_cache)]
    assert new_runs(attn, q, *larger) == 1
    strided_v = torch.zeros(*v_cache.shape[:-1], 2 * D, dtype=torch.bfloat16)[..., :D]
    assert new_runs(attn, q, k_cache, strided_v) == 1
    assert new_runs(attn, q, k_cache, v_cache, q_lens=(5, 30)) == 1  # longest chunk 30: planned for 32, not 16
    half = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.float16)
    assert new_runs(half, q.half(), k_cache.half(), v_cache.half()) == 1
    scaled = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, scale=0.5)
    assert new_runs(scaled, q, k_cache, v_cache) == 1


BAD_PLANS = {
    "negative page": (lambda t, n: (t.clone().fill_(-1), n), "page_table: page -1 at \\[0, 0\\] is negative"),
    "too long": (lambda t, n: (t, n + 100), "seq_lens_kv: sequence 0 has length 137; allowed 0..64"),
    "negative length": (lambda t, n: (t, n * 0 - 1), "seq_lens_kv: sequence 0 has length -1; allowed 0..64"),
    "dtype": (lambda t, n: (t.long(), n), "page_table: torch.int64"),
    "batch": (lambda t, n: (t, n[:1]), "seq_lens_kv: 1 lengths for 2 page-table rows"),
}


@pytest.mark.parametrize("bad", BAD_PLANS, ids=list(BAD_PLANS))
def test_bad_steps_are_refused_at_plan_time_naming_the_argument(bad):
    _, _, _, table, lengths = make_step([37, 64], pages_per_seq=4)
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16)
    make, message = BAD_PLANS[bad]
    with pytest.raises(ValidationError, match=message):
        attn.plan(*make(table, lengths))


def test_bad_runs_and_constructions_are_refused():
    q, k_cache, v_cache, table, lengths = make_step([37, 64], pages_per_seq=4)
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16)
    with pytest.raises(ValidationError, match="run\\(\\) before any plan"):
        attn.run(q, k_cache, v_cache)
    attn.plan(table, lengths)
    with pytest.raises(ValidationError, match="q: 17 query tokens"):
        attn.run(torch.zeros(2, HQ, 17, D, dtype=torch.bfloat16), k_cache, v_cache)
    with pytest.raises(ValidationError, match="q: batch 1"):
        attn.run(q[:1], k_cache, v_cache)
    with pytest.raises(ValidationError, match="k_cache: shape"):
        attn.run(q, k_cache.transpose(1, 2), v_cache)
    strided = torch.zeros(*k_cache.shape[:-1], 2 * D, dtype=k_cache.dtype)[..., ::2]
    with pytest.raises(ValidationError, match="PagedAttention.run: v_cache: strides .*head dim must be contiguous"):
        attn.run(q, k_cache, strided)
    with pytest.raises(ValidationError, match="q: expected a packed \\[T, H_q, D\\] tensor"):
        attn.plan(table, lengths, q_lens=torch.ones(2, dtype=torch.int32))
        attn.run(q, k_cache, v_cache)
    with pytest.raises(ValidationError, match="num_kv_heads: 3 does not divide"):
        cudnn_attn.PagedAttention(8, 3, D, PAGE, dtype=torch.bfloat16)
    with pytest.raises(ValidationError, match="cuda_graph: True needs max_batch"):
        cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, cuda_graph=True)
    with pytest.raises(ValidationError, match="device: 'nonsense': "):
        cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device="nonsense")


BAD_CONSTRUCTIONS = {
    "scale text": (dict(scale="x"), "scale: 'x'; must be None"),
    "scale list": (dict(scale=[1.0]), "scale: \\[1.0\\]; must be None"),
    "scale past float": (dict(scale=10**400), "scale: 1000.*; must be None"),
    "scale nan": (dict(scale=float("nan")), "scale: nan; must be None"),
    "decode_kernel list": (dict(decode_kernel=["cudnn"]), "decode_kernel: \\['cudnn'\\]; allowed None"),
    "kv_layout list": (dict(kv_layout=["NHPD"]), "kv_layout: \\['NHPD'\\]; allowed"),
    "pack text": (dict(pack="no"), "pack: 'no'; must be None, True or False"),
    "autotune text": (dict(autotune="x"), "autotune: 'x'; must be True or False"),
    "cuda_graph None": (dict(cuda_graph=None), "cuda_graph: None; must be True or False"),
}


@pytest.mark.parametrize("bad", BAD_CONSTRUCTIONS, ids=list(BAD_CONSTRUCTIONS))
def test_bad_constructor_options_are_refused_naming_them(bad):
    """Each option of the wrong type or value is a ValidationError naming it (before: ValueError,
    TypeError or OverflowError from float(), a list's 'unhashable type', or silently accepted)."""
    options, message = BAD_CONSTRUCTIONS[bad]
    with pytest.raises(ValidationError, match=f"PagedAttention: {message}"):
        cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, **options)


def test_a_cpu_device_of_any_spelling_runs():
    """``device="cpu:0"`` (torch places every CPU tensor on plain "cpu"): every run was refused."""
    q, k_cache, v_cache, table, lengths = make_step([37, 64], pages_per_seq=4)
    want = expected(q, k_cache, v_cache, table, lengths)
    for device in ("cpu:0", torch.device("cpu", 0), "cpu"):
        attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device=device)
        attn.plan(table, lengths)
        assert rel_err(attn.run(q, k_cache, v_cache), want) < 1e-2


def test_plans_lengths_on_a_device_other_than_cpu_or_cuda_are_refused_by_name():
    _, _, _, table, lengths = make_step([37, 64], pages_per_seq=4)
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device="cpu")
    with pytest.raises(ValidationError, match="seq_lens_kv: on meta; PagedAttention plans from CPU or CUDA"):
        attn.plan(table, lengths.to("meta"))
    with pytest.raises(ValidationError, match="q_lens: on meta"):
        attn.plan(table, lengths, q_lens=torch.ones(2, dtype=torch.int32, device="meta"))
    with pytest.raises(ValidationError, match="page_table: on meta"):
        attn.plan(table.to("meta"), lengths)


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "cuda_graph"])
def test_an_out_that_overlaps_itself_or_requires_grad_is_refused_by_name(prefill, cuda_graph):
    """torch's in-place write refused these with a RuntimeError; after a good out passed, a bad one
    of the same shape must still be refused (the checks skip geometries already seen)."""
    q, k_cache, v_cache, table, lengths = make_step([37, 64], pages_per_seq=4)
    options = dict(max_batch=2, max_pages_per_seq=4, cuda_graph=True) if cuda_graph else {}
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, **options)
    attn.plan(table, lengths, q_lens=torch.tensor([3, 5], dtype=torch.int32) if prefill else None)
    q = q[0, :, 0].expand(8, HQ, D).contiguous() if prefill else q
    attn.run(q, k_cache, v_cache, out=torch.empty_like(q))
    expanded = torch.zeros(1, *q.shape[1:], dtype=q.dtype).expand(q.shape)
    with pytest.raises(ValidationError, match="out: strides .* make elements overlap"):
        attn.run(q, k_cache, v_cache, out=expanded)
    with pytest.raises(ValidationError, match="out: a leaf tensor that requires grad"):
        attn.run(q, k_cache, v_cache, out=torch.zeros_like(q, requires_grad=True))
    with torch.no_grad():  # as torch's out= takes it there
        attn.run(q, k_cache, v_cache, out=torch.zeros_like(q, requires_grad=True))


def test_a_prefill_step_without_new_tokens_gives_an_empty_output_every_time():
    """q_lens all 0 and q of 0 tokens: the first run refused the empty q, a later one (its
    checks skipped) ran; now every run gives [0, H, D]."""
    q, k_cache, v_cache, table, lengths = make_step([37, 64], pages_per_seq=4)
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16)
    attn.plan(table, lengths, q_lens=torch.zeros(2, dtype=torch.int32))
    for _ in range(2):
        assert attn.run(q[0, :, :0].transpose(0, 1), k_cache, v_cache).shape == (0, HQ, D)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host without a CUDA GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 0)])
def test_a_cuda_device_on_a_host_without_one_is_refused_naming_it(device):
    """Not torch's bare ``AssertionError`` ("Torch not compiled with CUDA enabled") from the
    constructor, as the class docstring's own ``device="cuda"`` example gave on a CPU host."""
    with pytest.raises(UnsupportedError, match="device: .*cuda.*no CUDA GPU") as refused:
        cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device=device)
    assert "device='cpu'" in str(refused.value)


@pytest.mark.parametrize(
    "batch,pages,expected_splits",
    [(1, 512, 32), (1, 32, 8), (4, 128, 8), (32, 64, 1), (64, 512, 1), (8, 512, 4)],
)
def test_the_split_fills_the_gpu_for_small_batches_only(batch, pages, expected_splits):
    """Multi-token decode, page size 64, 32 query / 8 K/V heads (packed): B * H_kv * splits
    blocks reach about two per SM, chunks no shorter than 256 tokens."""
    schedule = paged_schedule.choose(batch, pages, 64, 32, 8, 4)
    assert schedule.packed and schedule.tail
    assert schedule.splits == expected_splits
    assert schedule.chunk_pages * schedule.splits >= pages


def test_single_token_decode_runs_plain_unless_forced():
    """cuDNN's own paged decode measured fastest with one query token: no split, no packing."""
    assert paged_schedule.choose(1, 512, 64, 32, 8, 1) == paged_schedule.Schedule(1, 1, 1, 512, False, False)
    forced = paged_schedule.choose(1, 512, 64, 32, 8, 1, splits=8, pack=True)
    assert forced.splits == 8 and forced.packed


def test_empty_slots_give_zeros_and_a_captured_step_may_keep_max_batch_rows():
    """A server pads a step to max_batch: empty slots (length 0) give zeros, and run() takes q
    with max_batch rows after a plan of fewer sequences (what a captured step replays)."""
    attn = cudnn_attn.PagedAttention(
        HQ, HKV, D, PAGE, dtype=torch.bfloat16, max_batch=4, max_pages_per_seq=4, cuda_graph=True
    )
    q, k_cache, v_cache, table, lengths = make_step([20, 0, 33, 9], pages_per_seq=4, seed=13)
    attn.plan(table, lengths)
    out = attn.run(q, k_cache, v_cache)
    assert out[1].abs().sum() == 0
    keep = torch.tensor([0, 2, 3])
    assert rel_err(out[keep], expected(q[keep], k_cache, v_cache, table[keep], lengths[keep])) < 1e-2
    attn.plan(table[:3], lengths[:3])
    out = attn.run(q, k_cache, v_cache)  # max_batch rows: the fourth is an empty slot now
    assert out.shape == q.shape and out[3].abs().sum() == 0


def packed_step(q_lens, kv_lens, pages_per_seq, seed=0, spare_tokens=0):
    """A chunked-prefill step: packed queries ``[T, H, D]`` (T = sum(q_lens) + spare_tokens)."""
    _, k_cache, v_cache, table, lengths = make_step(kv_lens, pages_per_seq, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(q_lens) + spare_tokens, HQ, D, generator=gen).to(torch.bfloat16)
    return q, k_cache, v_cache, table, lengths, torch.tensor(q_lens, dtype=torch.int32)


def expected_packed(q, k_cache, v_cache, table, lengths, q_lens, sinks=None):
    """Each sequence's chunk on its own (its last positions, bottom-right causal), packed."""
    outs, start = [], 0
    for b, n in enumerate(q_lens.tolist()):
        chunk = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        alone = expected(chunk, k_cache, v_cache, table[b : b + 1], lengths[b : b + 1], sinks=sinks)
        outs.append(alone[0].transpose(0, 1))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "cuda_graph"])
def test_chunked_prefill_mixes_prefill_chunks_and_decode_tokens(cuda_graph):
    """One step: a whole prompt (q = kv), a chunk of a longer prompt, a decode token, an empty
    slot, against each sequence alone; rows past sum(q_lens) are zero."""
    q_lens, kv_lens = [40, 17, 1, 0], [40, 60, 33, 0]
    q, k_cache, v_cache, table, lengths, q_lens_t = packed_step(
        q_lens, kv_lens, pages_per_seq=4, seed=21, spare_tokens=5
    )
    limits = dict(max_batch=6, max_pages_per_seq=5, cuda_graph=True) if cuda_graph else {}
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, **limits)
    attn.plan(table, lengths, q_lens=q_lens_t)
    out = torch.full_like(q, float("nan"))
    assert attn.run(q, k_cache, v_cache, out=out) is out
    total = sum(q_lens)
    assert rel_err(out[:total], expected_packed(q, k_cache, v_cache, table, lengths, q_lens_t)) < 1e-2
    assert out[total:].abs().sum() == 0
    assert attn.schedule is not None and attn.schedule.s_q == 64  # the longest chunk's bucket


def test_prefill_and_decode_steps_alternate_on_one_instance():
    """A serving loop: a prefill step, decode steps, another prefill of new length; each plan
    serves every layer (here two), and each step's results match."""
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16)
    for step, (q_lens, kv_lens) in enumerate([([20, 9], [20, 9]), (None, [21, 10]), ([3, 30], [24, 40])]):
        if q_lens is None:
            q, k_cache, v_cache, table, lengths = make_step(kv_lens, pages_per_seq=3, seed=30 + step)
            attn.plan(table, lengths)
            want = expected(q, k_cache, v_cache, table, lengths)
        else:
            q, k_cache, v_cache, table, lengths, q_lens_t = packed_step(q_lens, kv_lens, 3, seed=30 + step)
            attn.plan(table, lengths, q_lens=q_lens_t)
            want = expected_packed(q, k_cache, v_cache, table, lengths, q_lens_t)
        for _layer in range(2):
            assert rel_err(attn.run(q, k_cache, v_cache), want) < 1e-2
    assert attn.plans == 3


BAD_PREFILLS = {
    "longer than the cache": ([5, 50], "q_lens: sequence 1 has 50 new tokens; allowed 0..seq_lens_kv\\[1\\]=40"),
    "negative": ([-1, 3], "q_lens: sequence 0 has -1 new tokens"),
    "count": ([5], "q_lens: 1 lengths for 2 page-table rows"),
}


@pytest.mark.parametrize("bad", BAD_PREFILLS, ids=list(BAD_PREFILLS))
def test_bad_prefill_steps_are_refused_naming_q_lens(bad):
    _, _, _, table, lengths, _ = packed_step([5, 5], [20, 40], pages_per_seq=3)
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16)
    q_lens, message = BAD_PREFILLS[bad]
    with pytest.raises(ValidationError, match=message):
        attn.plan(table, lengths, q_lens=torch.tensor(q_lens, dtype=torch.int32))


def test_a_prefill_run_needs_the_planned_tokens():
    q, k_cache, v_cache, table, lengths, q_lens = packed_step([5, 7], [20, 40], pages_per_seq=3)
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16)
    attn.plan(table, lengths, q_lens=q_lens)
    with pytest.raises(ValidationError, match="q: 11 tokens; the step's q_lens sum to 12"):
        attn.run(q[:11], k_cache, v_cache)
    with pytest.raises(ValidationError, match="q: expected a packed"):
        attn.run(q.view(1, 12, HQ, D), k_cache, v_cache)


def decode_schedule(batch, pages, heads, kv_heads, s_q, *, runs=True, requested="auto", mla=False, hopper=False):
    """The layout of a captured step, page 64, on the kernel ``ops/dispatch`` chooses: ``runs``
    whether the Triton kernel runs here, ``hopper`` whether MLA's Hopper kernel serves."""
    dims = (576, 512) if mla else (64, 64)
    step = DecodeStep("cuda:0", batch, heads, kv_heads, s_q, 64, *dims, True, False, runs, hopper, 64, pages)
    kernel = dispatch.select_decode(step, requested)
    return paged_schedule.choose(batch, pages, 64, heads, kv_heads, s_q, kernel=kernel, mla=mla)


@pytest.mark.parametrize("batch,pages", [(1, 32), (1, 512), (4, 128), (8, 512), (64, 64)])
@pytest.mark.parametrize("s_q", [1, 4, 16])
def test_decode_takes_the_triton_kernel_where_it_serves(batch, pages, s_q):
    """Page 64, 32 query / 8 K/V heads: the Triton kernel (group and tokens packed, split, the
    causal mask inside: no tail), measured faster than cuDNN's calls at every batch, cache length
    and token count; cuDNN's calls where Triton is missing or the tile would pass 64 rows."""
    schedule = decode_schedule(batch, pages, 32, 8, s_q)
    assert (schedule.kernel, schedule.packed, schedule.tail) == ("triton", True, False)
    assert 1 <= schedule.splits <= pages and schedule.splits * schedule.chunk_pages >= pages
    assert schedule.splits == 1 or (schedule.splits - 1) * schedule.chunk_pages < pages  # no empty chunk
    plain = decode_schedule(batch, pages, 32, 8, s_q, runs=False)  # no Triton here
    assert plain.kernel == "cudnn" and plain.tail == (s_q > 1)
    assert plain == paged_schedule.choose(batch, pages, 64, 32, 8, s_q)
    wide = decode_schedule(batch, pages, 64, 2, s_q)  # 32 heads a group
    assert wide.kernel == ("triton" if 32 * s_q <= 64 else "cudnn")
    forced = decode_schedule(batch, pages, 64, 2, s_q, requested="triton")
    assert forced == wide  # forced, but the tile cannot hold the rows: cuDNN's calls


@pytest.mark.parametrize(
    "batch,heads,hopper,kernel",
    [
        (1, 16, False, "cudnn"),
        (1, 16, True, "triton"),
        (1, 128, False, "triton"),
        (4, 16, False, "triton"),
    ],
)
def test_mla_decode_of_one_sequence_with_few_heads_stays_with_cudnn_unless_the_hopper_kernel_serves(
    batch, heads, hopper, kernel
):
    """MLA (one latent head, 576/512, page 64) over 32k tokens: the Triton kernel measured 15% behind
    cuDNN for one sequence of 16 heads, the Hopper kernel 2.8x ahead; one wave of 64-head blocks."""
    schedule = decode_schedule(batch, 512, heads, 1, 1, mla=True, hopper=hopper)
    assert schedule.kernel == kernel
    if kernel == "triton":
        assert schedule.splits * schedule.chunk_pages >= 512
        assert 66 < batch * -(-heads // 64) * schedule.splits <= 132  # about one wave of programs
    several = decode_schedule(batch, 512, heads, 1, 2, mla=True, hopper=hopper, requested="triton")
    assert (several.kernel, several.splits, several.packed, several.tail) == ("cudnn", 1, False, True)


def test_forcing_the_triton_kernel_where_it_cannot_run_is_refused():
    q, k_cache, v_cache, table, lengths = make_step([37, 64], pages_per_seq=4)
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, decode_kernel="triton")
    attn.plan(table, lengths)
    with pytest.raises(cudnn_attn.UnsupportedError, match="decode_kernel: 'triton' needs a CUDA device"):
        attn.run(q, k_cache, v_cache)
    with pytest.raises(ValidationError, match="decode_kernel: 'fast'"):
        cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, decode_kernel="fast")


@pytest.mark.parametrize(
    "s_q,splits,pack", [(1, 1, False), (1, 1, True), (1, 2, True), (4, 1, True), (4, 2, True)], ids=str
)
def test_sinks_in_decode_whatever_the_layout(s_q, splits, pack):
    """gpt-oss's sinks at run: folded in from the log-sum-exp after the body (packed or not) or
    after the split-KV merge, exactly once; an empty slot stays zero."""
    q, k_cache, v_cache, table, lengths = make_step([37, 64, 0, 50], pages_per_seq=4, s_q=s_q, seed=30 + splits)
    sinks = torch.randn(HQ, generator=torch.Generator().manual_seed(3)) * 2
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, splits=splits, pack=pack)
    attn.plan(table, lengths)
    out = attn.run(q, k_cache, v_cache, sinks=sinks)
    want = expected(q, k_cache, v_cache, table, lengths, sinks=sinks).nan_to_num(0.0)
    assert rel_err(out, want) < 1e-2 and out[2].abs().sum() == 0
    assert rel_err(attn.run(q, k_cache, v_cache), want) > 1e-2  # without them: another result


def test_sinks_in_chunked_prefill():
    q_lens, kv_lens = [40, 17, 1, 0], [40, 60, 33, 0]
    q, k_cache, v_cache, table, lengths, q_lens_t = packed_step(
        q_lens, kv_lens, pages_per_seq=4, seed=41, spare_tokens=3
    )
    sinks = torch.randn(HQ, generator=torch.Generator().manual_seed(4)) * 2
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16)
    attn.plan(table, lengths, q_lens=q_lens_t)
    out = attn.run(q, k_cache, v_cache, sinks=sinks)
    total = sum(q_lens)
    want = expected_packed(q, k_cache, v_cache, table, lengths, q_lens_t, sinks=sinks)
    assert rel_err(out[:total], want) < 1e-2 and out[total:].abs().sum() == 0


def test_sinks_are_checked_by_name():
    q, k_cache, v_cache, table, lengths = make_step([20, 30], pages_per_seq=2)
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16)
    attn.plan(table, lengths)
    with pytest.raises(ValidationError, match="PagedAttention.run: sinks: shape"):
        attn.run(q, k_cache, v_cache, sinks=torch.zeros(HQ + 1))


@pytest.mark.parametrize("s_q,splits", [(1, 1), (1, 4), (2, 2)], ids=str)
def test_mla_decode_reads_v_from_the_latent_cache(s_q, splits):
    """MLA (DeepSeek-V2/V3, Kimi) at small scale: one latent K/V head for every query head, K of
    the latent plus its rope part (d 80 here, 576 there), V the latent's first 64 dims (512
    there): ``v_cache`` is a view of ``k_cache``, no copy."""
    hq, d, dv, page = 16, 80, 64, 16
    gen = torch.Generator().manual_seed(50 + splits)
    lengths = torch.tensor([37, 64, 0, 50], dtype=torch.int32)
    table = torch.randperm(4 * 4 + 2, generator=gen)[:16].view(4, 4).int()
    latent = torch.randn(18, 1, page, d, generator=gen).bfloat16()
    q = torch.randn(4, hq, s_q, d, generator=gen).bfloat16()
    scale = 192**-0.5  # DeepSeek-V3 scales by its qk head dim, not the latent's
    attn = cudnn_attn.PagedAttention(hq, 1, d, page, dtype=torch.bfloat16, head_dim_v=dv, scale=scale, splits=splits)
    attn.plan(table, lengths)
    out = attn.run(q, latent, latent[..., :dv])
    assert out.shape == (4, hq, s_q, dv)
    for b, n in enumerate(lengths.tolist()):
        k = latent[table[b].long()].reshape(-1, d)[:n].double()  # [n, d]: one head
        scores = q[b].double() @ k.T * scale  # [hq, s_q, n]
        visible = torch.arange(n)[None, :] <= (n - s_q + torch.arange(s_q))[:, None]
        want = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0) @ k[:, :dv]
        assert rel_err(out[b], want) < 1e-2, b


def test_mla_caches_are_checked_by_their_own_head_dims():
    attn = cudnn_attn.PagedAttention(4, 1, 80, 16, dtype=torch.bfloat16, head_dim_v=64)
    attn.plan(torch.zeros(1, 1, dtype=torch.int32), torch.tensor([5], dtype=torch.int32))
    latent = torch.zeros(2, 1, 16, 80, dtype=torch.bfloat16)
    q = torch.zeros(1, 4, 1, 80, dtype=torch.bfloat16)
    with pytest.raises(ValidationError, match="v_cache: shape"):
        attn.run(q, latent, latent)
    with pytest.raises(ValidationError, match=r"out: expected a torch.bfloat16 tensor of shape \[1, 4, 1, 64\]"):
        attn.run(q, latent, latent[..., :64], out=torch.zeros_like(q))


@pytest.mark.parametrize(
    "shortest, s_q, splits, chunk_pages, parts",
    [
        (5, 1, 1, 32, {"body"}),
        (0, 1, 1, 32, set()),
        (5, 1, 4, 8, set()),  # the shortest sequence's last three chunks have no keys
        (1537, 1, 4, 8, {"body"}),  # 1537 keys reach the fourth chunk of 512
        (1536, 1, 4, 8, set()),
        (1700, 4, 2, 16, {"body", "tail"}),  # the body ends at 1664, past one chunk of 1024
        (1089, 4, 2, 16, {"tail"}),  # the body ends at 1024: its second chunk is empty
        (5, 4, 1, 32, {"tail"}),  # every key of the shortest in its tail
        (None, 1, 1, 32, set()),  # not known now
    ],
)
def test_the_decode_parts_with_keys_in_every_row_follow_from_the_shortest_length(
    shortest, s_q, splits, chunk_pages, parts
):
    """``keyed_parts``: which parts of an eager cuDNN decode layer skip the fill of empty rows."""
    schedule = paged_schedule.Schedule(2, s_q, splits, chunk_pages, packed=True, tail=s_q > 1)
    assert keyed_parts(shortest, schedule, 64) == parts


def test_keyed_parts_agree_with_the_lengths_each_part_runs_on():
    """For random decode steps (page 16 or 64, 1-4 sequences, 1-16 query tokens, splits chosen
    or forced, GQA and MLA, lengths at the edges), a part is keyed exactly where every length
    the step derives for it (each chunk's, the tail's) is positive; ``plan`` from host lengths
    knows the shortest, and a batch padded to ``max_batch`` for capture does not record it."""
    rng = random.Random(0)
    checked = 0
    for _ in range(300):
        page, pages, batch = rng.choice([16, 64]), rng.randint(1, 12), rng.randint(1, 4)
        s_q, splits = rng.choice([1, 2, 4, 8, 16]), rng.choice([None, 1, 2, 3, 4, 8])
        heads = (4, 1, 32, 16) if rng.random() < 0.3 else (8, 2, 32, 32)  # MLA's latent, or GQA
        num_q_heads, num_kv_heads, head_dim, head_dim_v = heads
        attn = cudnn_attn.PagedAttention(
            num_q_heads,
            num_kv_heads,
            head_dim,
            page,
            head_dim_v=head_dim_v,
            dtype=torch.bfloat16,
            device="cpu",
            splits=splits,
            decode_kernel="cudnn",
        )
        edges = [0, 1, s_q - 1, s_q, page, 2 * page, page + s_q - 1, pages * page]
        lengths = [min(rng.choice(edges + [rng.randint(0, pages * page)]), pages * page) for _ in range(batch)]
        lengths = [max(0, n) for n in lengths]
        attn.plan(torch.arange(batch * pages, dtype=torch.int32).view(batch, pages), torch.tensor(lengths).int())
        step = attn._tables.step
        assert step.shortest() == min(lengths)
        derived = attn._tables.get(("decode", s_q, batch * pages), step)
        schedule = derived["schedule"]
        keyed = keyed_parts(step.shortest(), schedule, page)
        for part in ["body"] + (["tail"] if schedule.tail else []):
            assert (part in keyed) == bool((derived[f"{part}_lengths"] > 0).all()), (lengths, s_q, page, schedule)
            checked += 1
    assert checked > 300
    padded = cudnn_attn.PagedAttention(
        8, 2, 64, 64, dtype=torch.bfloat16, device="cpu", max_batch=4, max_pages_per_seq=4, cuda_graph=True
    )
    padded.plan(torch.zeros(2, 4, dtype=torch.int32), torch.tensor([100, 200], dtype=torch.int32))
    assert padded._tables.step.shortest() is None
