"""The persistent plan store: atomic, checksummed, private files that other platforms never use."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from cudnn_attn import cli, plan_store
from cudnn_attn.plan_store import PlanStore, entry_key, signature
from cudnn_attn.problem import AttentionProblem, Causal, Op, TensorSpec

PLATFORM = {"gpu": "NVIDIA H200", "arch": [9, 0], "cudnn": 91900, "frontend": "1.32.0"}


def problem(**kw):
    q = TensorSpec.contiguous((2, 8, 128, 64), torch.bfloat16, "cuda:0")
    return AttentionProblem(op=Op.FORWARD, q=q, k=q, v=q, o=q, **{"attn_scale": 0.125, **kw})


@pytest.fixture
def store(tmp_path):
    return PlanStore(tmp_path / "plans")


def test_round_trip_and_directory_is_private(store):
    key = entry_key(problem(), PLATFORM, "autotuned")
    assert store.save(key, {"platform": PLATFORM, "choice": {"name": "eng0"}}, b"\x00plan bytes\xff")
    entry = store.load(key, PLATFORM)
    assert entry.blob == b"\x00plan bytes\xff" and entry.header["choice"] == {"name": "eng0"}
    assert oct(store.path.stat().st_mode & 0o777) == "0o700"
    assert not list(store.path.glob(".tmp-*"))  # the temporary file was renamed into place


def test_keys_differ_for_every_built_value_and_platform():
    base = entry_key(problem(), PLATFORM, "autotuned")
    assert entry_key(problem(), PLATFORM, "autotuned") == base
    others = [
        entry_key(problem(attn_scale=0.2), PLATFORM, "autotuned"),
        entry_key(problem(causal=Causal.TOP_LEFT), PLATFORM, "autotuned"),
        entry_key(problem(), {**PLATFORM, "cudnn": 92000}, "autotuned"),
        entry_key(problem(), {**PLATFORM, "gpu": "NVIDIA H100"}, "autotuned"),
        entry_key(problem(), PLATFORM, "heuristic"),
    ]
    assert len({base, *others}) == 6
    assert json.loads(json.dumps(signature(problem())))["attn_scale"] == 0.125


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign", "empty"])
def test_damaged_files_are_ignored_with_a_warning(store, damage, caplog):
    key = entry_key(problem(), PLATFORM, "heuristic")
    store.save(key, {"platform": PLATFORM}, b"x" * 1000)
    file = store.file_for(key)
    data = file.read_bytes()
    file.write_bytes(
        {"truncate": data[:-10], "flip": data[:-1] + b"y", "foreign": b"PK\x03\x04zipfile", "empty": b""}[damage]
    )
    with caplog.at_level(logging.WARNING, logger="cudnn_attn.plan_store"):
        assert store.load(key, PLATFORM) is None
    assert "truncated, corrupted" in caplog.text
    assert store.save(key, {"platform": PLATFORM}, b"fresh")  # rewritten by the next build
    assert store.load(key, PLATFORM).blob == b"fresh"


def test_entries_of_another_platform_are_never_used(store, caplog):
    key = entry_key(problem(), PLATFORM, "heuristic")
    store.save(key, {"platform": {**PLATFORM, "cudnn": 90500}}, b"old")
    with caplog.at_level(logging.WARNING):
        assert store.load(key, PLATFORM) is None
    assert "another key or platform" in caplog.text


def test_group_writable_directory_and_foreign_files_are_refused(tmp_path, caplog):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with caplog.at_level(logging.WARNING):
        assert not PlanStore(shared).usable()
    assert "writable by group or others" in caplog.text
    store = PlanStore(tmp_path / "mine")
    key = entry_key(problem(), PLATFORM, "heuristic")
    store.save(key, {"platform": PLATFORM}, b"plan")
    store.file_for(key).chmod(0o666)
    assert store.load(key, PLATFORM) is None
    if os.getuid() == 0:  # as root we can hand the file to someone else
        store.file_for(key).chmod(0o600)
        os.chown(store.file_for(key), 12345, -1)
        assert store.load(key, PLATFORM) is None


def test_concurrent_writers_leave_a_whole_file(tmp_path):
    """Several processes writing one key: every read sees a complete, valid entry."""
    script = (
        "import sys; from cudnn_attn.plan_store import PlanStore\n"
        "s = PlanStore(sys.argv[1])\n"
        "for i in range(40): s.save('k' * 64, {'platform': {'p': 1}, 'writer': sys.argv[2]}, bytes([int(sys.argv[2])]) * 50000)\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path), str(n)]) for n in range(4)]
    store = PlanStore(tmp_path)
    seen = set()
    while any(p.poll() is None for p in procs):
        entry = store.load("k" * 64, {"p": 1})
        if entry is not None:
            assert len(set(entry.blob)) == 1 and len(entry.blob) == 50000
            seen.add(entry.blob[0])
    assert all(p.returncode == 0 for p in procs)
    assert store.load("k" * 64, {"p": 1}) is not None


def test_default_path_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDNN_ATTN_CACHE_DIR", "")
    assert plan_store.default_path() is None
    monkeypatch.setenv("CUDNN_ATTN_CACHE_DIR", str(tmp_path))
    assert plan_store.default_path() == tmp_path
    monkeypatch.delenv("CUDNN_ATTN_CACHE_DIR")
    assert str(plan_store.default_path()).endswith(".cache/cudnn_attn")


def test_cache_ls_and_clear_commands(monkeypatch, tmp_path, capsys):
    import cudnn_attn.cache as cache_module

    store = PlanStore(tmp_path)
    key = entry_key(problem(), PLATFORM, "autotuned")
    store.save(
        key,
        {"platform": PLATFORM, "describe": "sdpa-BHSD-bfloat16", "variant": "autotuned", "choice": {"name": "eng7"}},
        b"p",
    )
    (tmp_path / ("0" * 64 + ".plan")).write_bytes(b"garbage")
    monkeypatch.setattr(cache_module, "_default", cache_module.PlanCache(path=tmp_path))
    assert cli.main(["cache", "ls", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert {row["ok"] for row in listing["plans"]} == {True, False}
    assert any(row["engine"] == "eng7" and row["gpu"] == "NVIDIA H200" for row in listing["plans"])
    assert cli.main(["cache", "ls"]) == 0 and "DAMAGED" in capsys.readouterr().out
    assert cli.main(["cache", "clear"]) == 0
    assert "removed 2 plan(s)" in capsys.readouterr().out and not list(tmp_path.glob("*.plan"))


def test_cache_warm_and_bench_need_a_gpu_and_say_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("this checks the message shown without a GPU")
    assert cli.main(["cache", "warm", "b=1,h=2,s=128,d=64"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert cli.main(["bench", "-b", "1"]) == 2
    assert cli.main(["cache", "warm", "b=1,frogs=2"]) == 2
    assert "frogs: unknown shape key" in capsys.readouterr().err


def test_autotune_setting_and_environment(monkeypatch):
    import cudnn_attn
    from cudnn_attn.ops import autotune

    monkeypatch.setenv("CUDNN_ATTN_AUTOTUNE", "1")
    assert cudnn_attn.Graph().autotune
    cudnn_attn.set_autotune(False)
    try:
        assert not cudnn_attn.Graph().autotune and cudnn_attn.Graph(autotune=True).autotune
    finally:
        cudnn_attn.set_autotune(None)
    monkeypatch.delenv("CUDNN_ATTN_AUTOTUNE")
    assert not autotune.enabled_by_default()
