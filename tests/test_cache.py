"""The plan cache: one build per signature, hits for equal requests, misses for any difference."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import randn

import cudnn_attn
from cudnn_attn import PlanCache


def _build(cache, q, k, v, **kwargs):
    with cudnn_attn.Graph(cache=cache) as g:
        g.sdpa(q, k, v, **kwargs)
    return g


def _qkv(s=16, dtype=torch.float16):
    return tuple(randn(2, 4, s, 32, dtype=dtype) for _ in range(3))


def test_equal_requests_hit_and_build_once(cache):
    q, k, v = _qkv()
    g1 = _build(cache, q, k, v, use_causal_mask=True)
    g2 = _build(cache, *_qkv(), use_causal_mask=True)  # other data, same geometry
    stats = cache.stats()
    assert (stats["builds"], stats["misses"], stats["hits"]) == (1, 1, 1)
    assert g1.nodes[0].plan is g2.nodes[0].plan and len(cache) == 1
    assert stats["build_seconds"] > 0  # the one build was timed


def test_build_seconds_adds_up_the_time_spent_building():
    cache = PlanCache()

    def slow(seconds):
        time.sleep(seconds)
        return object()

    cache.get_or_build("a", lambda: slow(0.05))
    cache.get_or_build("a", lambda: slow(0.05))  # a hit: nothing built
    cache.get_or_build("b", lambda: slow(0.03))
    assert 0.08 <= cache.stats()["build_seconds"] < 5  # the sum of both builds, in seconds


@pytest.mark.parametrize(
    "change",
    [
        {"attn_scale": 0.1},  # FlashInfer once keyed its cuDNN graphs without the scale
        {"use_causal_mask": True},
        {"use_causal_mask_bottom_right": True},
        {"use_causal_mask": True, "sliding_window_length": 4},
        {"dropout": 0.1},
        {"generate_stats": True},
    ],
    ids=["scale", "causal", "causal-br", "window", "dropout", "stats"],
)
def test_any_change_in_a_built_value_is_a_miss(cache, change):
    q, k, v = _qkv()
    _build(cache, q, k, v)
    _build(cache, q, k, v, **change)
    assert cache.stats()["builds"] == 2


def test_geometry_changes_are_misses(cache):
    q, k, v = _qkv()
    _build(cache, q, k, v)
    _build(cache, *_qkv(s=24))  # sequence length
    _build(cache, *_qkv(dtype=torch.bfloat16))  # dtype
    bshd = tuple(randn(2, 16, 4, 32, dtype=torch.float16).transpose(1, 2) for _ in range(3))
    _build(cache, *bshd)  # strides
    assert cache.stats()["builds"] == 4


def test_lru_evicts_the_least_recently_used():
    cache = PlanCache(maxsize=2)
    a, b, c = _qkv(8), _qkv(16), _qkv(24)
    _build(cache, *a)
    _build(cache, *b)
    _build(cache, *a)  # a is now the most recent
    _build(cache, *c)  # evicts b
    assert cache.stats()["evictions"] == 1
    _build(cache, *a)
    assert cache.stats()["hits"] == 2
    _build(cache, *b)
    assert cache.stats()["builds"] == 4


def test_concurrent_first_requests_build_once():
    cache = PlanCache()
    calls = []

    def slow_build():
        calls.append(1)
        time.sleep(0.3)  # every thread arrives while the first build runs, even on a loaded machine
        return object()

    results = []
    start = threading.Barrier(8)

    def request():
        start.wait()
        results.append(cache.get_or_build("key", slow_build))

    threads = [threading.Thread(target=request) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len({id(r) for r in results}) == 1
    assert cache.stats()["builds"] == 1 and cache.stats()["misses"] == 8


def test_a_failed_build_is_not_cached_and_reaches_every_waiter():
    cache = PlanCache()

    def broken():
        raise RuntimeError("no plan")

    with pytest.raises(RuntimeError):
        cache.get_or_build("k", broken)
    assert len(cache) == 0 and cache.stats()["build_errors"] == 1
    assert cache.get_or_build("k", lambda: "plan") == "plan"


def test_clear_and_default_cache():
    cache = cudnn_attn.default_cache()
    assert cache is cudnn_attn.default_cache()
    _build(None, *_qkv(40))
    assert len(cache) >= 1
    cache.clear()
    assert len(cache) == 0 and cache.stats()["hits"] == 0
    with pytest.raises(ValueError):
        PlanCache(maxsize=0)


def test_an_empty_path_stores_nothing_as_the_variable_does(tmp_path, monkeypatch):
    """``path=""`` made the working directory the store: its clear() removed the *.plan files there."""
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "mine.plan"
    mine.write_text("user data")
    cache = PlanCache(path="")
    assert cache.store is None and cache.path is None
    assert cache.store_unused_reason() == 'this PlanCache was made with path="" (no store)'
    _build(cache, *_qkv())
    cache.clear()
    assert mine.read_text() == "user data" and sorted(p.name for p in tmp_path.iterdir()) == ["mine.plan"]
    assert PlanCache(path=".").store.path == Path(".")  # the working directory, asked for by name


def test_a_cache_alive_at_exit_clears_without_an_import_during_shutdown(tmp_path):
    """Its clear at exit imported the workspace module: "Exception ignored in atexit callback ...
    can't register atexit after shutdown" on stderr."""
    code = "import sys, cudnn_attn\ncache = cudnn_attn.PlanCache()\nassert 'cudnn_attn.ops.cudnn.workspace' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr
