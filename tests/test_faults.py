"""Faults survived on CPU: out of memory while building or running a plan, plan-store writes
that are killed or hit a full disk, two processes writing one store, and threads sharing one
``Graph``, one ``PagedAttention`` and the default plan cache.

The GPU out of memory is injected by making a real function of the build or the run raise
``torch.OutOfMemoryError`` (the real thing is in ``test_gpu_faults.py``); the store's failures are
real: a writer process killed with SIGKILL, a write the kernel refuses past a file-size limit.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import randn, rel_err
from test_paged_attention import HKV, HQ, PAGE, D, expected, make_step

import cudnn_attn
import cudnn_attn.cache as cache_module
from cudnn_attn import plan_store
from cudnn_attn.core.problem import AttentionProblem, Op, TensorSpec
from cudnn_attn.ops.reference import backend as reference
from cudnn_attn.ops.reference import math as reference_math
from cudnn_attn.plan_store import PlanStore, entry_key

PLATFORM = {"gpu": "NVIDIA H200", "arch": [9, 0], "cudnn": 91900, "frontend": "1.32.0"}
# Writer processes load the store's module alone: importing torch would cost them seconds each.
LOAD_STORE = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("plan_store", {plan_store.__file__!r})
plan_store = sys.modules["plan_store"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plan_store)
"""


def qkv(s=16, seed=0, dtype=torch.float16):
    gen = torch.Generator().manual_seed(seed)
    return tuple(randn(2, 4, s, 32, dtype=dtype, generator=gen) for _ in range(3))


def torch_sdpa(q, k, v, **kw):
    return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw)


def out_of_memory_once(monkeypatch, owner, name, calls=None, delay=0.0):
    """Make ``owner.name`` raise torch.OutOfMemoryError on its first call (after ``delay``
    seconds), then behave as before; returns the error raised."""
    real = getattr(owner, name)
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
    state = {"raised": False}

    def failing(*args, **kwargs):
        if calls is not None:
            calls.append(name)
        if not state["raised"]:
            state["raised"] = True
            time.sleep(delay)
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)
    return error


# ---- out of memory ---------------------------------------------------------------------------


def test_out_of_memory_while_building_leaves_nothing_behind_and_the_next_build_works(monkeypatch):
    """torch's OutOfMemoryError reaches the caller unchanged (what torch users catch to retry with
    less), and every thread that waited for the failed build gets it too; no plan, no in-flight
    marker and no recorded build stay, and the next request builds and runs."""
    cache = cudnn_attn.PlanCache()
    builds: list[str] = []
    injected = out_of_memory_once(monkeypatch, reference.ReferenceBackend, "build", builds, delay=0.3)
    q, k, v = qkv()
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def first_request():
        start.wait()
        try:
            with cudnn_attn.Graph(cache=cache) as g:
                g.sdpa(q, k, v)
        except BaseException as error:  # noqa: BLE001 - collected and checked below
            errors.append(error)

    threads = [threading.Thread(target=first_request) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 4 and all(e is injected for e in errors)  # the build's own error, for everyone
    assert len(builds) == 1  # the waiters did not build again
    stats = cache.stats()
    assert (stats["size"], stats["in_flight"], stats["builds"], stats["build_errors"]) == (0, 0, 0, 1)
    assert len(cache.recorded) == 0
    with cudnn_attn.Graph(cache=cache) as g:
        g.sdpa(q, k, v)
    assert rel_err(g(q, k, v), torch_sdpa(q, k, v)) < 2e-3
    assert cache.stats()["builds"] == 1 and len(builds) == 2


def test_out_of_memory_on_the_first_functional_call_is_torchs_error_and_the_next_call_works(monkeypatch):
    injected = out_of_memory_once(monkeypatch, reference.ReferenceBackend, "build")
    q, k, v = qkv(s=24, seed=1)  # a signature no other test uses: its first call builds
    with cudnn_attn.backend("reference"):  # the graphs' path (plain CPU calls run on torch's kernel)
        with pytest.raises(torch.OutOfMemoryError) as raised:
            cudnn_attn.sdpa(q, k, v, is_causal=True)
        assert raised.value is injected
        out = cudnn_attn.sdpa(q, k, v, is_causal=True)
    assert rel_err(out, torch_sdpa(q, k, v, is_causal=True)) < 2e-3


def test_out_of_memory_while_running_keeps_the_plan_and_the_next_run_is_exact(monkeypatch, cache):
    q, k, v = qkv(seed=2)
    with cudnn_attn.Graph(cache=cache) as g:
        g.sdpa(q, k, v, use_causal_mask=True)
    before = g(q, k, v).clone()
    plan = g.nodes[0].plan
    injected = out_of_memory_once(monkeypatch, reference_math, "forward")
    with pytest.raises(torch.OutOfMemoryError) as raised:
        g(q, k, v)
    assert raised.value is injected
    assert g.nodes[0].plan is plan and cache.stats()["builds"] == 1 and len(cache) == 1
    assert torch.equal(g(q, k, v), before)
    assert rel_err(before, torch_sdpa(q, k, v, is_causal=True)) < 2e-3


# ---- plan-store writes interrupted -----------------------------------------------------------


def _problem(scale=0.125):
    q = TensorSpec.contiguous((2, 8, 128, 64), torch.bfloat16, "cuda:0")
    return AttentionProblem(op=Op.FORWARD, q=q, k=q, v=q, o=q).replace(attn_scale=scale)


def _files(path):
    names = sorted(os.listdir(path))
    return [n for n in names if not n.startswith(plan_store.TMP_PREFIX)], [
        n for n in names if n.startswith(plan_store.TMP_PREFIX)
    ]


def test_a_full_disk_at_write_keeps_the_earlier_file_and_leaves_no_temporary_one(tmp_path, monkeypatch, caplog):
    store = PlanStore(tmp_path)
    key = entry_key(_problem(), PLATFORM, "heuristic")
    assert store.save(key, {"platform": PLATFORM}, b"old plan")

    def disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(plan_store.os, "fsync", disk_full)
    with caplog.at_level(logging.WARNING, logger="cudnn_attn.plan_store"):
        assert store.save(key, {"platform": PLATFORM}, b"new plan" * 1000) is False
        other = entry_key(_problem(0.2), PLATFORM, "heuristic")
        assert store.save(other, {"platform": PLATFORM}, b"another") is False
    assert "No space left on device" in caplog.text
    assert _files(tmp_path) == ([f"{key}.plan"], [])  # the earlier file alone; no temporary file left
    assert store.load(key, PLATFORM).blob == b"old plan" and store.load(other, PLATFORM) is None


_WRITER = """
import os, resource, signal, sys, time
store, key, mode = plan_store.PlanStore(sys.argv[1]), sys.argv[2], sys.argv[3]
header = {"platform": {"p": 1}}
if mode == "file-size-limit":  # the kernel refuses the write past 4 KiB, as a full disk would
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    print(store.save(key, header, b"x" * 100_000), flush=True)
elif mode == "hold-before-rename":  # written, not yet renamed into place: killed here
    real = os.fsync
    def announce(fd):
        real(fd)
        print("written", flush=True)
        time.sleep(60)
    plan_store.os.fsync = announce
    store.save(key, header, b"y" * 100_000)
elif mode == "loop":  # save continuously until killed, at whatever point the kill lands
    print("started", flush=True)
    n = 0
    while True:
        store.save(f"{n % 8:064x}", header, bytes([n % 251]) * 200_000)
        n += 1
"""


def _writer(tmp_path, key, mode):
    script = LOAD_STORE + _WRITER
    return subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path), key, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_write_refused_by_the_kernel_leaves_no_file(tmp_path):
    key = entry_key(_problem(), PLATFORM, "heuristic")
    writer = _writer(tmp_path, key, "file-size-limit")
    out, err = writer.communicate(timeout=120)
    assert out.strip() == "False", err
    assert "File too large" in err  # the store's warning names the failure
    assert _files(tmp_path) == ([], [])


def test_a_writer_killed_mid_save_leaves_no_file_that_loads(tmp_path):
    key = entry_key(_problem(), PLATFORM, "heuristic")
    writer = _writer(tmp_path, key, "hold-before-rename")
    assert writer.stdout.readline().strip() == "written", writer.stderr.read()
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait(timeout=60)
    plans, temporary = _files(tmp_path)
    assert plans == [] and len(temporary) == 1  # killed between the write and the rename
    assert os.path.getsize(tmp_path / temporary[0]) > 100_000  # the whole plan was in it, never renamed
    store = PlanStore(tmp_path)
    assert store.load(key, {"p": 1}) is None and list(store.entries()) == []
    assert store.clear() == 0 and _files(tmp_path)[1] == temporary  # a fresh temporary file may be a live save
    stale = time.time() - plan_store.STALE_TMP_SECONDS - 60
    os.utime(tmp_path / temporary[0], (stale, stale))
    assert store.save(key, {"platform": {"p": 1}}, b"rebuilt") and store.load(key, {"p": 1}).blob == b"rebuilt"
    store.clear()
    assert _files(tmp_path) == ([], [])  # the abandoned temporary file went too


def test_writers_killed_at_any_moment_leave_only_whole_files(tmp_path):
    for attempt in range(3):
        writer = _writer(tmp_path, "0" * 64, "loop")
        assert writer.stdout.readline().strip() == "started", writer.stderr.read()
        time.sleep(0.2 + 0.15 * attempt)
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(timeout=60)
    listed = list(PlanStore(tmp_path).entries())
    assert listed, "the writer saved nothing before it was killed"
    for item in listed:  # temporary files are skipped; every plan file is whole
        assert item.entry is not None, item.problem
        assert len(item.entry.blob) == 200_000 and len(set(item.entry.blob)) == 1


def test_every_truncation_of_a_plan_file_is_refused_without_raising(tmp_path, caplog):
    store = PlanStore(tmp_path)
    key = entry_key(_problem(), PLATFORM, "heuristic")
    assert store.save(key, {"platform": PLATFORM, "choice": {"name": "eng0"}}, bytes(range(32)))
    whole = store.file_for(key).read_bytes()
    with caplog.at_level(logging.ERROR, logger="cudnn_attn.plan_store"):  # the warnings are expected
        for length in range(len(whole)):
            store.file_for(key).write_bytes(whole[:length])
            assert store.load(key, PLATFORM) is None, length
    store.file_for(key).write_bytes(whole)
    assert store.load(key, PLATFORM).blob == bytes(range(32))


_SAME_KEYS = """
import sys, time
PlanStore = plan_store.PlanStore
path, writer, go = sys.argv[1], int(sys.argv[2]), sys.argv[3]
store = PlanStore(path)
print("ready", flush=True)
while not __import__("os").path.exists(go):
    time.sleep(0.001)
for round_ in range(15):
    for key in range(6):
        assert store.save(f"{key:064x}", {"platform": {"p": 1}, "writer": writer}, bytes([writer]) * 300_000)
print("done", flush=True)
"""


def test_two_processes_writing_the_same_keys_at_once_leave_whole_files(tmp_path):
    """The reference backend stores nothing, so on CPU two processes race through the store
    itself; ``test_gpu_faults.py`` warms one store from two processes through the library."""
    go = tmp_path / "go"
    store_path = tmp_path / "plans"
    script = LOAD_STORE + _SAME_KEYS
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(store_path), str(n), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (1, 2)
    ]
    for w in writers:
        assert w.stdout.readline().strip() == "ready", w.stderr.read()
    go.touch()  # both start together
    for w in writers:
        out, err = w.communicate(timeout=120)
        assert w.returncode == 0 and out.strip() == "done", err
    store = PlanStore(store_path)
    listed = list(store.entries())
    assert len(listed) == 6 and _files(store_path)[1] == []
    for item in listed:
        writer = item.entry.header["writer"]
        assert writer in (1, 2) and item.entry.blob == bytes([writer]) * 300_000


# ---- threads sharing a graph, a PagedAttention and the default cache ---------------------------


@pytest.fixture
def default_cache(monkeypatch):
    """A fresh process-wide cache, so its counts are this test's own (graphs use it by default)."""
    fresh = cudnn_attn.PlanCache()
    monkeypatch.setattr(cache_module, "_default", fresh)
    assert cudnn_attn.default_cache() is fresh
    return fresh


def _in_threads(work, count):
    """Run ``work(i)`` in ``count`` threads started together; re-raise the first failure."""
    start = threading.Barrier(count)
    failures: list[BaseException] = []

    def body(i):
        start.wait()
        try:
            work(i)
        except BaseException as error:  # noqa: BLE001 - re-raised in the main thread
            failures.append(error)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]


def test_threads_share_one_graph_with_exact_results(default_cache):
    inputs = [qkv(s=32, seed=10 + i) for i in range(4)]
    with cudnn_attn.Graph() as g:
        g.sdpa(*inputs[0], use_causal_mask=True)
    alone = [g(*x).clone() for x in inputs]  # one thread, one run each
    for x, o in zip(inputs, alone):
        assert rel_err(o, torch_sdpa(*x, is_causal=True)) < 2e-3

    def work(i):
        for _ in range(20):
            assert torch.equal(g(*inputs[i]), alone[i])

    _in_threads(work, 4)
    assert default_cache.stats()["builds"] == 1


def test_threads_building_the_same_graphs_build_each_plan_once(default_cache, monkeypatch):
    """Every thread records the same three graphs at once into the default cache; a build is
    slowed so that the others arrive while it runs: each plan is built once."""
    real = reference.ReferenceBackend.build
    built: list[object] = []

    def slow_build(self, problem, **kwargs):
        built.append(problem)
        time.sleep(0.1)
        return real(self, problem, **kwargs)

    monkeypatch.setattr(reference.ReferenceBackend, "build", slow_build)
    shapes = [qkv(s=s, seed=s) for s in (8, 16, 24)]
    results: dict[tuple[int, int], torch.Tensor] = {}

    def work(i):
        for n, x in enumerate(shapes):
            with cudnn_attn.Graph() as g:
                g.sdpa(*x)
            results[i, n] = g(*x)

    _in_threads(work, 4)
    assert len(built) == 3 and len(set(built)) == 3
    assert default_cache.stats()["builds"] == 3 and default_cache.stats()["in_flight"] == 0
    for (_, n), out in results.items():
        assert torch.equal(out, results[0, n]) and rel_err(out, torch_sdpa(*shapes[n])) < 2e-3


@pytest.mark.parametrize("splits", [1, 2])  # 2: the split layout's working copy of q
def test_threads_share_one_paged_attention_with_exact_results(default_cache, splits):
    """One step planned, then each thread runs its own layer (its own q and caches) on the
    shared PagedAttention, as a server running layers from several threads would."""
    layers = [make_step([37, 64, 1, 50], pages_per_seq=4, seed=20 + i) for i in range(4)]
    table, lengths = layers[0][3], layers[0][4]
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, splits=splits)
    attn.plan(table, lengths)
    alone = []
    for q, k_cache, v_cache, *_ in layers:
        out = attn.run(q, k_cache, v_cache).clone()
        assert rel_err(out, expected(q, k_cache, v_cache, table, lengths)) < 1e-2
        alone.append(out)
    builds = default_cache.stats()["builds"]

    def work(i):
        q, k_cache, v_cache, *_ = layers[i]
        for _ in range(100):
            assert torch.equal(attn.run(q, k_cache, v_cache), alone[i])

    _in_threads(work, 4)
    assert default_cache.stats()["builds"] == builds  # nothing built again
