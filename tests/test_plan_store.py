"""The persistent plan store: atomic, checksummed, private files that other platforms never use."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from cudnn_attn import plan_store
from cudnn_attn.cli import commands as cli
from cudnn_attn.core.problem import AttentionProblem, Causal, Op, TensorSpec
from cudnn_attn.plan_store import PlanStore, entry_key, signature

PLATFORM = {"gpu": "NVIDIA H200", "arch": [9, 0], "cudnn": 91900, "frontend": "1.32.0"}
CHOICE = {"index": 0, "name": "eng0", "engine_id": 8, "knobs": {}, "tuned": False, "timings_ms": {}}


def problem(**kw):
    q = TensorSpec.contiguous((2, 8, 128, 64), torch.bfloat16, "cuda:0")
    # replace() routes option fields (attn_scale, causal) into the problem's nested options
    return AttentionProblem(op=Op.FORWARD, q=q, k=q, v=q, o=q).replace(**{"attn_scale": 0.125, **kw})


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
    assert json.loads(json.dumps(signature(problem())))["options"]["attn_scale"] == 0.125  # nested, canonical


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
    """Several writers on one key: every read sees a complete, valid entry.

    Threads, not processes (a process would spend seconds importing torch): each save has its own
    temporary file and rename either way, which is what is under test.
    """
    key = "a" * 64

    def write(n):
        for _ in range(40):
            assert PlanStore(tmp_path).save(key, {"platform": {"p": 1}, "writer": n}, bytes([n]) * 50000)

    writers = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for w in writers:
        w.start()
    store = PlanStore(tmp_path)
    while any(w.is_alive() for w in writers):
        entry = store.load(key, {"p": 1})
        if entry is not None:
            assert len(set(entry.blob)) == 1 and len(entry.blob) == 50000
    for w in writers:
        w.join()
    assert store.load(key, {"p": 1}) is not None


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
        {
            "platform": PLATFORM,
            "describe": "sdpa-BHSD-bfloat16",
            "variant": "autotuned",
            "choice": {"index": 0, "name": "eng7"},
        },
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
    assert cli.main(["cache", "warm", "b=1,h=2,s=128,d=64"]) == 1  # an environment error
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert cli.main(["bench", "-b", "1"]) == 1
    assert cli.main(["cache", "warm", "b=1,frogs=2"]) == 2
    assert "frogs: unknown shape key" in capsys.readouterr().err


def test_autotune_setting_and_environment(monkeypatch):
    import cudnn_attn
    from cudnn_attn.ops.cudnn import autotune

    monkeypatch.setenv("CUDNN_ATTN_AUTOTUNE", "1")
    assert cudnn_attn.Graph().autotune
    cudnn_attn.set_autotune(False)
    try:
        assert not cudnn_attn.Graph().autotune and cudnn_attn.Graph(autotune=True).autotune
    finally:
        cudnn_attn.set_autotune(None)
    monkeypatch.delenv("CUDNN_ATTN_AUTOTUNE")
    assert not autotune.enabled_by_default()


# ---- hardening: every byte on disk is hostile ---------------------------------------------


@pytest.fixture
def cli_store(monkeypatch, tmp_path):
    """The store the ``cudnn-attn cache`` commands use, in a private directory of its own."""
    import cudnn_attn.cache as cache_module

    cache = cache_module.PlanCache(path=tmp_path / "cli")
    monkeypatch.setattr(cache_module, "_default", cache)
    return cache.store


def listing(capsys) -> list[dict]:
    assert cli.main(["cache", "ls", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["plans"]


def save_plan(store, variant="heuristic", blob=b"plan"):
    key = entry_key(problem(), PLATFORM, variant)
    assert store.save(key, {"platform": PLATFORM, "variant": variant, "choice": CHOICE}, blob)
    return key


def finishes_quickly(fn, fifo, seconds=2.0):
    """``fn()``'s result, failing (not hanging) if it is stuck opening ``fifo``."""
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():  # release the reader: a writer that opens and closes at once gives it EOF
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(seconds)
        pytest.fail(f"blocked on the FIFO {fifo.name}")
    return result[0]


def test_every_byte_after_the_magic_is_checksummed(store):
    """The header length too: a changed length must not move a byte from the plan to the header unnoticed."""
    key = save_plan(store, blob=b"\n plan")  # whitespace first: JSON that takes one more byte still parses
    file = store.file_for(key)
    data = file.read_bytes()
    for at in range(len(plan_store.MAGIC), len(data)):
        file.write_bytes(data[:at] + bytes([(data[at] + 1) % 256]) + data[at + 1 :])
        assert store.load(key, PLATFORM) is None, f"byte {at} changed by one was accepted"
    file.write_bytes(data)
    assert store.load(key, PLATFORM).blob == b"\n plan"


def test_files_of_format_v1_are_ignored_as_foreign(store, caplog):
    key = entry_key(problem(), PLATFORM, "heuristic")
    head = json.dumps({"platform": PLATFORM, "key": key}).encode()
    digest = hashlib.sha256(head + b"plan").hexdigest().encode()
    store.usable()
    store.file_for(key).write_bytes(b"CUDNN_ATTN_PLAN v1\n" + len(head).to_bytes(8, "little") + digest + head + b"plan")
    with caplog.at_level(logging.WARNING, logger="cudnn_attn.plan_store"):
        assert store.load(key, PLATFORM) is None
    assert "not a plan file" in caplog.text


def test_a_fifo_neither_blocks_load_nor_cache_ls(cli_store, capsys, caplog):
    key = entry_key(problem(), PLATFORM, "heuristic")
    cli_store.usable()
    fifo = cli_store.file_for(key)
    os.mkfifo(fifo, 0o600)
    with caplog.at_level(logging.WARNING, logger="cudnn_attn.plan_store"):
        assert finishes_quickly(lambda: cli_store.load(key, PLATFORM), fifo) is None
    assert "not a regular file" in caplog.text
    (row,) = finishes_quickly(lambda: listing(capsys), fifo)
    assert not row["ok"] and "not a regular file" in row["problem"]


def test_links_are_never_followed(cli_store, tmp_path, capsys):
    """A dangling link, a link to a valid plan elsewhere and a link to /dev/zero: all refused, unread."""
    elsewhere = PlanStore(tmp_path / "elsewhere")
    key = save_plan(elsewhere)
    cli_store.usable()
    # Named so that the dangling link comes first: the old code crashed there, before reading /dev/zero forever.
    os.symlink(tmp_path / "nowhere", cli_store.path / ("0" * 64 + ".plan"))
    os.symlink(elsewhere.file_for(key), cli_store.file_for(key))
    os.symlink("/dev/zero", cli_store.path / ("f" * 64 + ".plan"))
    rows = listing(capsys)
    assert len(rows) == 3 and all(not r["ok"] and "symbolic link" in r["problem"] for r in rows)
    assert cli_store.load(key, PLATFORM) is None and cli_store.load("f" * 64, PLATFORM) is None
    assert elsewhere.load(key, PLATFORM) is not None


def test_files_over_the_size_limit_are_refused_unread(store, monkeypatch, caplog):
    key = save_plan(store, blob=b"p" * 8000)
    file = store.file_for(key)
    data = file.read_bytes()
    os.truncate(file, plan_store.MAX_FILE_BYTES + 1)  # sparse: nothing is written, and nothing must be read
    with caplog.at_level(logging.WARNING, logger="cudnn_attn.plan_store"):
        assert store.load(key, PLATFORM) is None
    assert "byte limit" in caplog.text
    file.write_bytes(data)
    monkeypatch.setattr(plan_store, "MAX_FILE_BYTES", 4096)
    assert store.load(key, PLATFORM) is None
    assert not store.save(key, {"platform": PLATFORM}, b"p" * 8000)  # load would refuse it


def test_cache_ls_skips_temporary_files_and_files_that_vanish(cli_store, monkeypatch, capsys):
    keys = sorted(save_plan(cli_store, variant) for variant in ("a", "b", "c"))
    (cli_store.path / ".tmp-abc123.plan").write_bytes(b"half written")  # a save in progress
    assert [r["file"] for r in listing(capsys)] == [f"{k}.plan" for k in keys]

    decode = plan_store._decode

    def decode_then_clear_the_rest(data):  # another process clears while we list
        for key in keys[1:]:
            cli_store.file_for(key).unlink(missing_ok=True)
        return decode(data)

    monkeypatch.setattr(plan_store, "_decode", decode_then_clear_the_rest)
    assert [r["file"] for r in listing(capsys)] == [f"{keys[0]}.plan"]


def test_cache_ls_and_clear_beside_concurrent_writers(cli_store, capsys):
    """Listing and clearing while 4 writers save: no crash, and no save loses its temporary file."""
    failures = []

    def write(n):
        for i in range(30):
            key = hashlib.sha256(f"{n}-{i}".encode()).hexdigest()
            if not PlanStore(cli_store.path).save(key, {"platform": PLATFORM, "choice": CHOICE}, b"x" * 20000):
                failures.append(key)

    cli_store.usable()
    writers = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for w in writers:
        w.start()
    start = time.monotonic()
    while any(w.is_alive() for w in writers) and time.monotonic() - start < 1.5:
        assert all(r["ok"] for r in listing(capsys))
        cli_store.clear()
    for w in writers:
        w.join()
    assert not failures


def test_clear_removes_only_plan_files_and_abandoned_temporary_files(store, tmp_path):
    key = save_plan(store)
    directory = store.path / ("d" * 64 + ".plan")
    directory.mkdir()
    target = tmp_path / "not-a-plan"
    target.write_bytes(b"keep me")
    link = store.path / ("e" * 64 + ".plan")
    os.symlink(target, link)
    live, stale = store.path / ".tmp-live.plan", store.path / ".tmp-stale.plan"
    live.write_bytes(b"a save in progress")
    stale.write_bytes(b"left by a crashed writer")
    an_hour_ago = time.time() - 3600
    os.utime(stale, (an_hour_ago, an_hour_ago))
    assert store.clear() == 1
    assert not store.file_for(key).exists() and not stale.exists()
    assert directory.is_dir() and link.is_symlink() and live.exists() and target.read_bytes() == b"keep me"


def test_directory_is_checked_on_every_call(cli_store, capsys, caplog):
    key = save_plan(cli_store)
    cli_store.path.chmod(0o777)  # made unsafe after the first use
    with caplog.at_level(logging.WARNING, logger="cudnn_attn.plan_store"):
        assert cli_store.load(key, PLATFORM) is None
        assert not cli_store.save(key, {"platform": PLATFORM}, b"evil")
    assert "writable by group or others" in caplog.text
    for action in ("ls", "clear"):
        assert cli.main(["cache", action]) == 1  # a refused store: an environment error
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "writable by group or others" in err and "Traceback" not in err
    assert cli_store.file_for(key).exists()  # clear refused
    cli_store.path.chmod(0o700)
    assert cli_store.load(key, PLATFORM).blob == b"plan"
    if os.getuid() == 0:  # as root we can hand the directory to someone else
        os.chown(cli_store.path, 12345, -1)
        assert cli_store.load(key, PLATFORM) is None and cli.main(["cache", "ls"]) == 1
        assert "owned by uid 12345" in capsys.readouterr().err


def test_cache_ls_and_clear_refuse_a_path_that_is_not_a_directory(cli_store, capsys):
    cli_store.path.write_bytes(b"a file")
    for action in ("ls", "clear"):
        assert cli.main(["cache", action]) == 1
        assert "not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["../x", "/tmp/x", "A" * 64, "a" * 63, "a" * 65, "a" * 64 + "\n", "g" * 64, ""])
def test_keys_not_made_by_entry_key_are_refused(store, tmp_path, key):
    with pytest.raises(ValueError, match="not a key made by entry_key"):
        store.file_for(key)
    with pytest.raises(ValueError):
        store.save(key, {"platform": PLATFORM}, b"plan")
    with pytest.raises(ValueError):
        store.load(key, PLATFORM)
    assert not list(tmp_path.rglob("x*"))  # nothing written anywhere


def test_nested_frozen_dataclasses_are_canonicalised():
    """A problem whose fields are grouped into nested frozen dataclasses keys and serialises like a flat one."""

    @dataclasses.dataclass(frozen=True)
    class Options:
        causal: Causal
        window: tuple[int, int]
        accumulate: torch.dtype

    @dataclasses.dataclass(frozen=True)
    class Grouped:
        op: Op
        q: TensorSpec
        options: Options

    q = problem().q
    grouped = Grouped(Op.FORWARD, q, Options(Causal.TOP_LEFT, (64, 0), torch.float32))
    sig = signature(grouped)
    assert json.loads(json.dumps(sig)) == sig
    assert sig["options"] == {"causal": "top_left", "window": [64, 0], "accumulate": "torch.float32"}
    assert sig["q"] == {
        "shape": [2, 8, 128, 64],
        "stride": [65536, 8192, 64, 1],
        "dtype": "torch.bfloat16",
        "device": "cuda:0",
    }
    other = dataclasses.replace(grouped, options=Options(Causal.BOTTOM_RIGHT, (64, 0), torch.float32))
    assert entry_key(grouped, PLATFORM, "v") != entry_key(other, PLATFORM, "v")
    assert entry_key(grouped, PLATFORM, "v") == entry_key(
        Grouped(Op.FORWARD, q, Options(Causal.TOP_LEFT, (64, 0), torch.float32)), PLATFORM, "v"
    )


def test_cache_warm_with_an_unreadable_file_says_so(cli_store, tmp_path, capsys):
    assert cli.main(["cache", "warm", "--file", str(tmp_path / "missing.txt")]) == 2
    err = capsys.readouterr().err
    assert "cannot read --file" in err and "No such file" in err
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00")
    assert cli.main(["cache", "warm", "--file", str(tmp_path / "binary.txt")]) == 2
    assert "cannot read --file" in capsys.readouterr().err


def test_a_directory_named_like_a_plan_is_named_by_its_path(cli_store, capsys, caplog):
    """It was listed as "DAMAGED ([Errno 21] Is a directory: 3...)": 3 was fdopen's file descriptor."""
    key = entry_key(problem(), PLATFORM, "heuristic")
    cli_store.usable()
    cli_store.file_for(key).mkdir()
    (row,) = listing(capsys)
    assert not row["ok"] and row["problem"] == f"{cli_store.file_for(key)}: a directory, not a regular file"
    with caplog.at_level(logging.WARNING, logger="cudnn_attn.plan_store"):
        assert cli_store.load(key, PLATFORM) is None
    assert "a directory, not a regular file" in caplog.text and "Errno" not in caplog.text


# ---- the cuDNN backend's reading of a stored entry --------------------------------------------

# Headers another version (or no version) of the library may have laid out: each is ignored and rebuilt.
OTHER_CHOICES = {
    "absent": (None, "choice is absent"),
    "other keys": ({"engine": 3}, "choice.index is absent, choice.name is absent"),
    "a list": (["x"], "choice is a list"),
    "a string index": ({"index": "0", "name": "eng0"}, "choice.index is a string"),
    "a boolean index": ({"index": True, "name": "eng0"}, "choice.index is a boolean"),
    "null knobs": ({**CHOICE, "knobs": None}, "choice.knobs is null"),
}


def stored_header(choice, platform=PLATFORM):
    header = {"platform": platform, "variant": "heuristic", "describe": problem().describe()}
    return header if choice is None else {**header, "choice": choice}


@pytest.fixture
def backend(monkeypatch):
    """The cuDNN backend with what needs a GPU replaced: deserializing a plan (``from_blob``, which
    records what it was given) and building one (``_build``, whose plan ``to_blob`` serializes)."""
    from cudnn_attn.ops.cudnn import autotune
    from cudnn_attn.ops.cudnn import backend as cudnn_backend

    backend = cudnn_backend.CudnnBackend()
    backend.loaded = []
    backend.built = []

    def from_blob(problem, blob, device_index=None):
        backend.loaded.append(blob)
        return SimpleNamespace(problem=problem, source="disk", choice=None)

    def build(problem, lowered, autotune_, device_index):
        backend.built.append(problem)
        return SimpleNamespace(problem=problem, source="built", choice=autotune.Choice(index=2, name="eng2"))

    monkeypatch.setattr(backend, "from_blob", from_blob)
    monkeypatch.setattr(backend, "_build", build)
    monkeypatch.setattr(backend, "to_blob", lambda plan: b"rebuilt")
    here = SimpleNamespace(gpu=PLATFORM["gpu"], arch=(9, 0), cudnn=91900, frontend="1.32.0", describe=lambda: "H200")
    monkeypatch.setattr(cudnn_backend.cudnn_platform, "device_index", lambda device: 0)
    monkeypatch.setattr(cudnn_backend, "platform", lambda index: here)
    monkeypatch.setattr(cudnn_backend, "cudnn_handle", lambda index: None)
    monkeypatch.setattr(cudnn_backend.lowering, "lower", lambda *args, **kwargs: None)
    backend.record = {**PLATFORM, "graph": cudnn_backend.lowering.GRAPH_REVISION}
    return backend


def test_a_stored_choice_as_the_library_writes_it_loads(store, backend):
    key = entry_key(problem(), backend.record, "heuristic")
    assert store.save(key, stored_header({**CHOICE, "from a later version": 1}, backend.record), b"plan")
    plan = backend._load(problem(), store, key, backend.record, 0)
    assert backend.loaded == [b"plan"] and plan.source == "disk"
    assert (plan.choice.index, plan.choice.name, plan.choice.engine_id) == (0, "eng0", 8)
    assert backend.build(problem(), store=store) is not None and backend.built == []  # from the store


@pytest.mark.parametrize("name", list(OTHER_CHOICES))
def test_a_stored_choice_of_another_layout_is_ignored_warned_and_rebuilt(name, store, backend, caplog):
    """It raised TypeError or AttributeError outside the load's guard: every build of the problem
    failed with UnsupportedError, and the file was never rewritten."""
    choice, said = OTHER_CHOICES[name]
    key = entry_key(problem(), backend.record, "heuristic")
    assert store.save(key, stored_header(choice, backend.record), b"plan")
    with caplog.at_level(logging.WARNING, logger="cudnn_attn.cudnn"):
        assert backend._load(problem(), store, key, backend.record, 0) is None
        plan = backend.build(problem(), store=store)
    assert backend.loaded == []  # a header of another layout is not deserialized
    assert f"plan store: cannot load {key[:12]} (header of another layout: {said}); rebuilding" in caplog.text
    assert plan.source == "built" and backend.built == [problem()]
    rewritten = store.load(key, backend.record)
    assert rewritten.blob == b"rebuilt" and rewritten.header["choice"]["name"] == "eng2"
    assert plan_store.choice_problems(rewritten.header) == []


@pytest.mark.parametrize("name", list(OTHER_CHOICES))
def test_cache_ls_flags_a_stored_choice_of_another_layout(name, cli_store, capsys):
    """Listed as OK, though every load ignored it."""
    choice, said = OTHER_CHOICES[name]
    assert cli_store.save(entry_key(problem(), PLATFORM, "a"), stored_header(CHOICE), b"plan")
    assert cli_store.save(entry_key(problem(), PLATFORM, "b"), stored_header(choice), b"plan")
    rows = {row["ok"]: row for row in listing(capsys)}
    assert rows[True]["engine"] == "eng0" and rows[False]["problem"] == f"header of another format: {said}"
    assert cli.main(["cache", "ls"]) == 0
    assert f"FOREIGN (header of another format: {said}; ignored" in capsys.readouterr().out
