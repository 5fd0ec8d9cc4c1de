"""Faults survived on a real GPU: the GPU out of memory while building or running a plan, two
processes warming one plan store at once, and threads on their own CUDA streams sharing one
``Graph``, one ``PagedAttention`` and the default plan cache."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch
from conftest import rel_err
from test_faults import _in_threads
from test_paged_attention import HKV, HQ, PAGE, D, expected, make_step

import cudnn_attn
import cudnn_attn.cache as cache_module
from cudnn_attn.plan_store import TMP_PREFIX, PlanStore

pytestmark = pytest.mark.gpu


def qkv(b=2, h=8, s=512, d=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(3)]


def torch_ref(q, k, v, **kw):
    return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw)


class FullGpu:
    """Holds nearly every free byte of the GPU (torch's blocks, largest first), then gives them back."""

    def __enter__(self) -> FullGpu:
        # Garbage first, and none collected while full: an earlier failure's traceback holding
        # tensors, freed mid-test, would hand its memory to the allocation meant to fail.
        gc.collect()
        gc.disable()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # what torch holds unused goes back first, then is taken again below
        self.blocks = []
        # Down to 2 MiB, the smallest of torch's large blocks (free room beside live tensors in
        # its segments included), then its small blocks down to 512 bytes, its smallest.
        for size in (1 << 30, 1 << 26, 1 << 22, 1 << 21, 1 << 20, 1 << 16, 1 << 12, 512):
            while True:
                try:
                    self.blocks.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
                except torch.OutOfMemoryError:
                    break
        return self

    def __exit__(self, *exc) -> None:
        gc.enable()
        self.blocks.clear()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _store_files(path):
    return sorted(p.name for p in path.iterdir()) if path.exists() else []


@pytest.mark.parametrize("autotune", [True, False], ids=["tuned", "heuristic"])
def test_out_of_memory_while_building_is_torchs_error_and_leaves_cache_and_store_unchanged(tmp_path, autotune):
    """A build on a full GPU raises torch.OutOfMemoryError (tuning allocates its inputs and
    workspaces; a heuristic build may get through, its run may not); nothing is cached or stored,
    and once memory is free the same request builds, stores and runs."""
    with cudnn_attn.Graph(cache=cudnn_attn.PlanCache()) as warm:  # cuDNN and its handle loaded first
        warm.sdpa(*qkv(s=128, seed=9))
    q, k, v = qkv(b=4, h=16, s=2048, seed=1)
    cache = cudnn_attn.PlanCache(path=tmp_path)
    failure = None
    with FullGpu():
        try:
            with cudnn_attn.Graph(cache=cache, autotune=autotune) as g:
                g.sdpa(q, k, v, use_causal_mask=True)
            g(q, k, v)
        except torch.OutOfMemoryError as error:  # anything else fails the test
            failure = str(error).splitlines()[0]  # the text alone: the error's frames hold tensors
    print(f"autotune={autotune}: {failure}")
    assert failure is not None, "nothing ran out of memory on a full GPU"
    built = len(cache)
    if built == 0:  # the build itself failed: nothing cached or stored, no in-flight marker
        assert cache.stats()["in_flight"] == 0 and _store_files(tmp_path) == []
    else:  # the build got through and the run failed: the stored plan is whole
        assert [listed.entry is not None for listed in PlanStore(tmp_path).entries()] == [True]
    assert not [name for name in _store_files(tmp_path) if name.startswith(TMP_PREFIX)]
    with cudnn_attn.Graph(cache=cache, autotune=autotune) as g:
        g.sdpa(q, k, v, use_causal_mask=True)
    assert rel_err(g(q, k, v), torch_ref(q, k, v, is_causal=True)) < 1.6e-2
    assert len(cache) == 1 and len(list(tmp_path.glob("*.plan"))) == 1
    assert cache.stats()["builds"] == 1


def test_out_of_memory_while_running_keeps_the_plan_and_the_next_run_is_exact():
    cache = cudnn_attn.PlanCache()
    q, k, v = qkv(seed=2)
    with cudnn_attn.Graph(cache=cache) as g:
        g.sdpa(q, k, v, use_causal_mask=True)
    before = g(q, k, v).clone()
    plan = g.nodes[0].plan
    side = torch.cuda.Stream()  # a stream the plan has no workspace for yet
    out = torch.empty_like(q)
    with FullGpu():
        with pytest.raises(torch.OutOfMemoryError):
            g(q, k, v)  # the output cannot be allocated
        if plan.workspace_size:  # given the output, the new stream's workspace cannot be
            with torch.cuda.stream(side), pytest.raises(torch.OutOfMemoryError):
                g(q, k, v, out=out)
    assert g.nodes[0].plan is plan and cache.stats()["builds"] == 1
    assert torch.equal(g(q, k, v), before)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        again = g(q, k, v)
    side.synchronize()
    assert torch.equal(again, before)
    assert rel_err(before, torch_ref(q, k, v, is_causal=True)) < 1.6e-2


_WARM = ["b=1,h=8,hkv=2,s=512,d=64,causal,bwd", "b=2,h=8,s=256,d=128"]  # three plans: forward, backward, forward


def _warm(store, *extra):
    env = {**os.environ, "CUDNN_ATTN_CACHE_DIR": str(store)}
    command = [sys.executable, "-m", "cudnn_attn.cli", "cache", "warm", *_WARM, "--no-autotune", *extra]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_processes_warming_one_store_at_once(tmp_path):
    store = tmp_path / "plans"
    warmers = [_warm(store), _warm(store)]
    outputs = [w.communicate(timeout=300) for w in warmers]
    for w, (out, err) in zip(warmers, outputs):
        assert w.returncode == 0, err
        assert "Traceback" not in err and "plan store" not in err, err
        assert len(out.splitlines()) == len(_WARM), out  # a line per shape
    names = _store_files(store)
    assert len(names) == 3 and not [n for n in names if n.startswith(TMP_PREFIX)], names
    assert all(listed.entry is not None for listed in PlanStore(store).entries())
    third = _warm(store)  # a restarted server: every plan from disk
    out, err = third.communicate(timeout=300)
    assert third.returncode == 0, err
    assert out.count("(disk") == 2 and "built" not in out, out


@pytest.fixture
def default_cache(monkeypatch):
    fresh = cudnn_attn.PlanCache()
    monkeypatch.setattr(cache_module, "_default", fresh)
    return fresh


def _on_streams(work, count):
    """``work(i, stream)`` in ``count`` threads started together (``_in_threads``), each on a stream
    of its own that first waits for the work already queued; re-raises the first failure."""
    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in range(count)]
    for stream in streams:
        stream.wait_stream(main)

    def on_stream(i):
        with torch.cuda.stream(streams[i]):
            work(i, streams[i])
        streams[i].synchronize()

    _in_threads(on_stream, count)


def test_threads_on_streams_share_one_graph_with_exact_results(default_cache):
    inputs = [qkv(s=1024, seed=10 + i) for i in range(4)]
    with cudnn_attn.Graph() as g:
        g.sdpa(*inputs[0], use_causal_mask=True)
    alone = [g(*x).clone() for x in inputs]
    for x, o in zip(inputs, alone):
        assert rel_err(o, torch_ref(*x, is_causal=True)) < 1.6e-2

    def work(i, stream):
        for _ in range(30):
            out = g(*inputs[i])
            assert torch.equal(out, alone[i])  # compared on this thread's stream, after its run

    _on_streams(work, 4)
    assert default_cache.stats()["builds"] == 1


def test_threads_on_streams_building_the_same_graphs_build_each_plan_once(default_cache):
    shapes = [qkv(s=s, seed=s) for s in (256, 512, 768)]
    results: dict[tuple[int, int], torch.Tensor] = {}

    def work(i, stream):
        for n, x in enumerate(shapes):
            with cudnn_attn.Graph() as g:
                g.sdpa(*x, use_causal_mask=True)
            results[i, n] = g(*x)

    _on_streams(work, 4)
    assert default_cache.stats()["builds"] == 3 and default_cache.stats()["in_flight"] == 0
    for (_, n), out in results.items():
        assert torch.equal(out, results[0, n]) and rel_err(out, torch_ref(*shapes[n], is_causal=True)) < 1.6e-2


@pytest.mark.parametrize("splits", [1, 2])  # 2: the split layout's working copy of q
def test_threads_on_streams_share_one_paged_attention_with_exact_results(default_cache, splits):
    layers = [[t.cuda() for t in make_step([37, 64, 1, 50], pages_per_seq=4, seed=20 + i)] for i in range(4)]
    table, lengths = layers[0][3], layers[0][4]
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, splits=splits, device="cuda")
    attn.plan(table, lengths)
    alone = []
    for q, k_cache, v_cache, *_ in layers:
        out = attn.run(q, k_cache, v_cache).clone()
        assert rel_err(out, expected(q.cpu(), k_cache.cpu(), v_cache.cpu(), table.cpu(), lengths.cpu())) < 1.6e-2
        alone.append(out)
    builds = default_cache.stats()["builds"]

    def work(i, stream):
        q, k_cache, v_cache, *_ = layers[i]
        for _ in range(100):
            assert torch.equal(attn.run(q, k_cache, v_cache), alone[i])

    _on_streams(work, 4)
    assert default_cache.stats()["builds"] == builds
