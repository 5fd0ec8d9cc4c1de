"""The edits and the pytest side of ``tests/frontend_conformance.py`` (see its docstring).

The edits: ``import cudnn`` spelled for cudnn_attn, and under ``--device cpu`` the device spellings
and GPU preconditions, answered as an H100 with cuDNN 9.19.0 answers them (sm90, ``91900``), so a
test's skips on architecture or version take the branches they take on that GPU. The pytest side:
copies of the frontend's test files (and the files and packages they import) with those edits, ids
collected through the real frontend, a seeded sample per test function, pytest in subprocesses with
a plugin that logs every report as it happens, and per-function counts and grouped messages.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TEST_DIR = "test/python"
TEST_FILE = "test_mhas.py"
SELECTIONS = {"test_sdpa": "test_sdpa and not backward", "test_sdpa_backward": "test_sdpa_backward"}
SDPA_TEST_FILES = (
    "test_sdpa_thd.py",
    "test_sdpa_chunked_prefill.py",
    "test_sdpa_with_caching.py",
    "test_mhas_v2.py",
    "test_flexible_sdpa.py",
    "test_flexible_sdpa_bprop.py",
)
H100 = "name='NVIDIA H100 80GB HBM3', major=9, minor=0, multi_processor_count=132"
TIMEOUT_MARK = "(--case-timeout)"

IMPORT_EDITS: list[tuple[re.Pattern[str], Any]] = [  # the only edit the promise allows
    (
        re.compile(r"^(\s*)import cudnn(\s+as\s+\w+)?[ \t]*(?=#|$)", re.M),
        lambda m: f"{m[1]}import cudnn_attn{m[2] or ' as cudnn'}",
    ),
    (re.compile(r"^(\s*)from cudnn import ", re.M), r"\1from cudnn_attn import "),
]
DEVICE_EDITS = [  # --device cpu only: (what the edit does, pattern, replacement)
    ("torch.cuda.synchronize() -> no-op", re.compile(r"torch\.cuda\.synchronize\(\)"), "None"),
    ("torch.cuda.is_available() -> True", re.compile(r"torch\.cuda\.is_available\(\)"), "True"),
    ("torch.cuda.get_device_capability() -> (9, 0)", re.compile(r"torch\.cuda\.get_device_capability\(\)"), "(9, 0)"),
    # The notebooks assert a cuDNN version before anything else; a CPU machine has no cuDNN library.
    ("cudnn.backend_version() -> 91900", re.compile(r"cudnn\.backend_version\(\)"), "91900"),
    (".cuda() -> .cpu()", re.compile(r"\.cuda\(\)"), ".cpu()"),
    ('device="cuda" -> device="cpu"', re.compile(r"""device\s*=\s*(["'])cuda(:\d+)?\1"""), 'device="cpu"'),
    # The tests' further spellings (conftest.py, sdpa/*.py); in single quotes, as they may sit in f"..." (3.11).
    ('cudnn.backend_version_string() -> "9.19.0"', re.compile(r"cudnn\.backend_version_string\(\)"), "'9.19.0'"),
    ("torch.backends.cudnn.version() -> 91900", re.compile(r"torch\.backends\.cudnn\.version\(\)"), "91900"),
    (
        "torch.cuda.get_device_name() -> an H100's",
        re.compile(r"torch\.cuda\.get_device_name\(\)"),
        "'NVIDIA H100 80GB HBM3'",
    ),
    (
        "torch.cuda.get_device_properties(d) -> an H100's (major 9, minor 0, 132 SMs)",
        re.compile(r"torch\.cuda\.get_device_properties\([^()]*\)"),
        f"__import__('types').SimpleNamespace({H100})",
    ),
    (
        'torch.device("cuda:N") -> torch.device("cpu")',
        re.compile(r"""torch\.device\((["'])cuda(:\d+)?\1\)"""),
        "torch.device('cpu')",
    ),
    # A stream's raw pointer is only passed on to cudnn.set_stream; CPU work runs on no CUDA stream.
    ("<stream>.cuda_stream -> 0", re.compile(r"[\w.]+(?:\(\))?\.cuda_stream\b"), "0"),
    ("torch.cuda.Stream() -> torch.cpu.Stream()", re.compile(r"torch\.cuda\.Stream\(\)"), "torch.cpu.Stream()"),
    (
        "torch.cuda.nvtx.range_push/pop(...) -> no-op",
        re.compile(r"torch\.cuda\.nvtx\.range_(?:push|pop)\([^()\n]*\)"),
        "None",
    ),
]

PLUGIN = '''"""Logs each pytest report as one JSON line; keeps only the selected ids; seeds each case's random;
with CONFORMANCE_CASE_TIMEOUT, a case still running after that many seconds raises TimeoutError."""
import json, os, random, signal, zlib
from collections import Counter
import pytest

def _write(**record):
    with open(os.environ["CONFORMANCE_LOG"], "a") as f:
        f.write(json.dumps(record) + "\\n")

def _message(report):
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):
        return str(longrepr[2])
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message
    text = str(longrepr or "")
    errors = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    return "\\n".join(errors) or text

def _said(report):
    """test_mhas_v2 prints its cause ("@@@@ Overall result: FAILED, unexpected 'E' exception ... {e}") and
    then fails or skips with a fixed text: the cause (12 lines at most) goes first."""
    lines = (report.capstdout or "").splitlines()
    at = [n for n, line in enumerate(lines) if line.startswith("@@@@ Overall result:")]
    return "\\n".join(lines[at[-1]:at[-1] + 12])[len("@@@@ Overall result: "):] if at else ""

@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    total = len(items)
    by_function = Counter(i.nodeid.split("::")[-1].split("[")[0] for i in items)
    if os.environ.get("CONFORMANCE_SELECT"):
        with open(os.environ["CONFORMANCE_SELECT"]) as f:
            wanted = set(json.load(f))
        config.hook.pytest_deselected(items=[i for i in items if i.nodeid not in wanted])
        items[:] = [i for i in items if i.nodeid in wanted]
    _write(event="collected", total=total, kept=len(items), by_function=by_function)

def pytest_collectreport(report):
    if report.failed:
        _write(event="collect_error", nodeid=report.nodeid, message=_message(report))

def pytest_runtest_logstart(nodeid, location):
    _write(event="start", nodeid=nodeid)

def _expire(signum, frame):
    raise TimeoutError(f"case ran past {os.environ['CONFORMANCE_CASE_TIMEOUT']} s MARK")

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    random.seed(zlib.crc32(item.nodeid.encode()))
    limit = int(os.environ.get("CONFORMANCE_CASE_TIMEOUT") or 0)
    if limit:
        signal.signal(signal.SIGALRM, _expire)
        signal.alarm(limit)
    try:
        yield
    finally:
        if limit:
            signal.alarm(0)

def pytest_runtest_logreport(report):
    message = _message(report)
    said = _said(report) if report.outcome != "passed" else ""
    message = f"{said}\\n{message}" if said else message
    _write(event="report", nodeid=report.nodeid, when=report.when, outcome=report.outcome, message=message)
'''.replace("MARK", TIMEOUT_MARK)

LOOSEVERSION = '''"""Stand-in for the absent looseversion package: distutils' LooseVersion ordering."""
import functools, re

@functools.total_ordering
class LooseVersion:
    def __init__(self, vstring):
        self.vstring = str(vstring)
        parts = re.split(r"(\\d+|[a-z]+|\\.)", self.vstring)
        self.version = [int(p) if p.isdigit() else p for p in parts if p and p != "."]
    def _other(self, other):
        return other if isinstance(other, LooseVersion) else LooseVersion(other)
    def __eq__(self, other):
        return self.version == self._other(other).version
    def __lt__(self, other):
        return self.version < self._other(other).version
    def __str__(self):
        return self.vstring
'''


# ---------------------------------------------------------------- edits and subprocesses


def rewrite_imports(source: str) -> tuple[str, int]:
    """``import cudnn`` / ``from cudnn import`` spelled for cudnn_attn; returns the count of edits."""
    total = 0
    for pattern, replacement in IMPORT_EDITS:
        source, n = pattern.subn(replacement, source)
        total += n
    return source, total


def edit_for_cpu(source: str) -> tuple[str, Counter]:
    """The device edits of ``--device cpu``, with how often each applied."""
    applied: Counter = Counter()
    for label, pattern, replacement in DEVICE_EDITS:
        source, n = pattern.subn(replacement, source)
        if n:
            applied[label] += n
    return source, applied


def child_env() -> dict[str, str]:
    """The environment of every subprocess: this checkout's cudnn_attn ahead of an installed one, but after
    ``PYTHONPATH``, so that another copy (a snapshot of a commit) can be measured by putting it there."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(REPO)) if p)
    return env


def run_child(cmd: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None) -> tuple[int | str, str]:
    """Runs ``cmd`` in its own process group; returns (exit code or "timeout", stdout+stderr)."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env or child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=max(timeout, 1))
        return proc.returncode, out.decode(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return "timeout", out.decode(errors="replace")


# ---------------------------------------------------------------- staging and collection


def local_imports(source: str, folder: Path) -> set[str]:
    """Files and packages in ``folder`` that ``source`` imports (``test_utils.py``, ``sdpa``)."""
    found = set()
    for name in re.findall(r"^\s*(?:from|import)\s+(\w+)", source, re.M):
        if (folder / f"{name}.py").exists():
            found.add(f"{name}.py")
        elif (folder / name).is_dir():
            found.add(name)
    return found


def stage_tests(test_dir: Path, dest: Path, through: str, device: str = "cuda", roots=(TEST_FILE,)) -> dict:
    """Copies ``roots``, conftest.py, pytest.ini and the files and packages they import to ``dest``,
    imports rewritten for ``through`` and, for ``device`` cpu, the device edits made (listed per file)."""
    wanted, seen, edits, device_edits = [*roots, "conftest.py"], set(), 0, {}
    while wanted:
        name = wanted.pop()
        if name in seen or not (test_dir / name).exists():
            continue
        seen.add(name)
        if (test_dir / name).is_dir():
            wanted += [p.relative_to(test_dir).as_posix() for p in sorted((test_dir / name).rglob("*.py"))]
            continue
        source = (test_dir / name).read_text(encoding="utf-8")
        wanted += sorted(local_imports(source, test_dir))
        if through == "cudnn_attn":
            source, n = rewrite_imports(source)
            edits += n
        if device == "cpu":
            source, applied = edit_for_cpu(source)
            if applied:
                device_edits[name] = dict(applied)
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_text(source, encoding="utf-8")
    if (test_dir / "pytest.ini").exists():
        shutil.copy(test_dir / "pytest.ini", dest / "pytest.ini")
    (dest / "_conformance_plugin.py").write_text(PLUGIN)
    shims = []
    if importlib.util.find_spec("looseversion") is None:
        (dest / "looseversion.py").write_text(LOOSEVERSION)
        shims.append("looseversion (package absent: a stand-in with distutils' LooseVersion ordering)")
    files = sorted(n for n in seen if not (test_dir / n).is_dir())
    return {"files": files, "import_edits": edits, "device_edits": device_edits, "shims": shims}


def pytest_cmd(test_file: str, expr: str | None, *extra: str) -> list[str]:
    plugins = ["-p", "_conformance_plugin", "-p", "no:cacheprovider"]
    return [sys.executable, "-m", "pytest", test_file, *(["-k", expr] if expr else []), *plugins, *extra]


def collect_ids(stage: Path, expr: str | None, test_file: str = TEST_FILE) -> list[str]:
    """The parametrized ids ``expr`` selects, as collected here (no conftest: collecting needs no GPU)."""
    env = dict(child_env(), CONFORMANCE_LOG=str(stage / "collect.jsonl"))
    code, output = run_child(pytest_cmd(test_file, expr, "--collect-only", "-q", "--noconftest"), stage, 600, env)
    ids = [line.strip() for line in output.splitlines() if line.startswith(f"{test_file}::")]
    if not ids:
        what = f"{test_file} -k {expr!r}" if expr else test_file
        raise RuntimeError(f"collecting {what} through the real frontend failed (exit {code}):\n{output[-2000:]}")
    return ids


def function_of(nodeid: str) -> str:
    return nodeid.split("::")[-1].split("[")[0]


def sample_ids(ids_by_group: dict[str, list[str]], n: int, seed: int, light=lambda name: False) -> dict[str, list[str]]:
    """``n`` ids split evenly over the groups (all when n is 0), drawn by ``seed``, in collection order;
    a ``light`` group takes one id and leaves its share to the others."""
    if n <= 0:
        return ids_by_group
    rng, picked = random.Random(seed), {}
    heavy = [g for g in ids_by_group if not light(g)]
    rest = max(n - (len(ids_by_group) - len(heavy)), 0)
    share = {g: rest // len(heavy) + (i < rest % len(heavy)) for i, g in enumerate(heavy)}
    for name, ids in ids_by_group.items():
        picked[name] = [ids[i] for i in sorted(rng.sample(range(len(ids)), min(share.get(name, 1), len(ids))))]
    return picked


# ---------------------------------------------------------------- runs and summaries


def read_log(path: Path) -> list[dict]:
    """The plugin's records; a line cut short by a killed process is dropped."""
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def case_outcome(reports: dict[str, tuple[str, str]]) -> tuple[str, str]:
    """(outcome, message) of one case from its setup/call/teardown reports."""
    setup, call, teardown = (reports.get(w) for w in ("setup", "call", "teardown"))
    if setup and setup[0] != "passed":
        return ("error" if setup[0] == "failed" else "skipped"), setup[1]
    if call is None:
        return "crashed", ""
    if call[0] == "failed" and TIMEOUT_MARK in call[1]:
        return "timeout", call[1]
    if call[0] == "passed" and teardown and teardown[0] == "failed":
        return "error", teardown[1]
    return call


def run_ids(
    stage: Path, test_file: str, expr: str | None, label: str, ids: list[str], deadline: float, case_timeout: int = 0
) -> dict:
    """Runs ``ids`` under pytest until each has an outcome, resuming after a case that kills the process."""
    cases: dict[str, tuple[str, str]] = {}
    collected, session_error, runs, tail = None, None, 0, ""
    remaining = list(ids)
    while remaining and time.monotonic() < deadline:
        runs += 1
        log, select = stage / f"{label}-{runs}.jsonl", stage / f"{label}-{runs}-select.json"
        select.write_text(json.dumps(remaining))
        env = dict(child_env(), CONFORMANCE_LOG=str(log), CONFORMANCE_SELECT=str(select))
        if case_timeout:
            env["CONFORMANCE_CASE_TIMEOUT"] = str(case_timeout)
        code, output = run_child(pytest_cmd(test_file, expr, "-q"), stage, deadline - time.monotonic(), env)
        tail = output[-3000:]
        reports: dict[str, dict[str, tuple[str, str]]] = {}
        started = []
        for record in read_log(log):
            if record["event"] == "collected" and collected is None:
                collected = record
            elif record["event"] == "collect_error":
                session_error = record["message"] or f"collection failed (exit {code})"
            elif record["event"] == "start":
                started.append(record["nodeid"])
            elif record["event"] == "report":
                reports.setdefault(record["nodeid"], {})[record["when"]] = (record["outcome"], record["message"])
        for nodeid in started:
            outcome = case_outcome(reports.get(nodeid, {}))
            if outcome[0] == "crashed":
                outcome = ("timeout" if code == "timeout" else "crashed", f"process ended (exit {code}) in this case")
            cases[nodeid] = outcome
        remaining = [i for i in remaining if i not in cases]
        if not started and not session_error:
            last = [line for line in output.splitlines() if line.strip()][-1:] or [""]
            session_error = f"pytest exited ({code}) before running a case: {last[0].strip()}"
        if session_error or not started:
            break
    for nodeid in remaining:
        reason = session_error or ("time budget spent" if time.monotonic() >= deadline else "not run")
        cases[nodeid] = ("blocked" if session_error else "not_run", reason)
    collected = collected or {"total": 0, "by_function": {}}
    return {"cases": cases, "collected": collected, "session_error": session_error, "runs": runs, "tail": tail}


def run_selection(stage: Path, name: str, ids: list[str], deadline: float, case_timeout: int = 0) -> dict:
    """One test_mhas selection (``SELECTIONS[name]``) run and summarized."""
    raw = run_ids(stage, TEST_FILE, SELECTIONS[name], name, ids, deadline, case_timeout)
    return summarize(ids, raw["cases"], raw["collected"]["total"], raw["session_error"], raw["runs"], raw["tail"])


def grouped(cases: dict[str, tuple[str, str]], outcomes: set[str], top: int = 12) -> list[dict]:
    """Messages of the cases with these outcomes, grouped by first line, most frequent first."""
    groups: Counter = Counter()
    example: dict[str, str] = {}
    for nodeid, (outcome, message) in cases.items():
        if outcome in outcomes:
            lines = message.strip().splitlines() or [""]
            first = lines[0] + (" " + " ".join(x.strip() for x in lines[1:4]) if lines[0].endswith(":") else "")
            first = first[:300]
            groups[first] += 1
            example.setdefault(first, nodeid)
    return [{"count": n, "message": m, "example": example[m]} for m, n in groups.most_common(top)]


def summarize(ids, cases, collected, session_error, runs, tail) -> dict:
    """Counts: ``run`` cases started; ``errors`` failed outside the test body, crashed or timed out;
    ``blocked`` never started because the pytest session failed (``session_error``, e.g. a collection error)."""
    counts = Counter(outcome for outcome, _ in cases.values())
    return {
        "selected": len(ids),
        "collected": collected,
        "session_error": session_error,
        "run": len(ids) - counts["not_run"] - counts["blocked"],
        "passed": counts["passed"],
        "failed": counts["failed"],
        "skipped": counts["skipped"],
        "errors": counts["error"] + counts["crashed"] + counts["timeout"],
        "timeouts": counts["timeout"],
        "blocked": counts["blocked"],
        "not_run": counts["not_run"],
        "pytest_processes": runs,
        "top_failures": grouped(cases, {"failed", "error", "crashed", "timeout", "blocked"}),
        "top_skips": grouped(cases, {"skipped"}),
        "cases": {nodeid: {"outcome": o, "message": m[:1500]} for nodeid, (o, m) in cases.items()},
        "output_tail": tail,
    }


def run_tests(
    frontend: Path, through: str, sample: int, seed: int, budget: float, device: str = "cuda", case_timeout: int = 0
) -> dict:
    """test_sdpa and test_sdpa_backward: the sample drawn from the real frontend's ids, run through ``through``."""
    test_dir = frontend / TEST_DIR
    deadline = time.monotonic() + budget
    with tempfile.TemporaryDirectory(prefix="conformance-tests-") as tmp:
        frame, stage = Path(tmp) / "frame", Path(tmp) / "stage"
        frame.mkdir()
        stage.mkdir()
        stage_tests(test_dir, frame, "cudnn", device)
        staged = stage_tests(test_dir, stage, through, device)
        ids = sample_ids({name: collect_ids(frame, expr) for name, expr in SELECTIONS.items()}, sample, seed)
        results = {}
        for name, expr in SELECTIONS.items():
            results[name] = run_selection(stage, name, ids[name], deadline, case_timeout)
            results[name]["selection"] = f"-k {expr!r}"
    return {
        "sample": sample,
        "seed": seed,
        "sampled_from": "ids collected through the real frontend",
        **staged,
        "results": results,
    }


def run_sdpa_tests(
    frontend: Path,
    through: str,
    files: list[str],
    sample: int,
    seed: int,
    budget: float,
    device: str = "cuda",
    case_timeout: int = 0,
) -> dict:
    """The frontend's other SDPA test files: per file, ``sample`` ids drawn from the real frontend's, split
    evenly over its test functions (an fp8/mxfp8 function and test_repro take one), run in one session (resumed
    after a crash) within ``budget`` seconds, reported per function."""
    test_dir = frontend / TEST_DIR
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="conformance-sdpa-") as tmp:
        frame, stage = Path(tmp) / "frame", Path(tmp) / "stage"
        frame.mkdir()
        stage.mkdir()
        stage_tests(test_dir, frame, "cudnn", device, files)
        staged = stage_tests(test_dir, stage, through, device, files)
        for test_file in files:
            deadline = time.monotonic() + budget
            try:
                collected = collect_ids(frame, None, test_file)
            except RuntimeError as error:
                out[test_file] = {"error": str(error)}
                continue
            by_function: dict[str, list[str]] = {}
            for nodeid in collected:
                by_function.setdefault(function_of(nodeid), []).append(nodeid)
            picked = sample_ids(by_function, sample, seed, light=lambda name: "fp8" in name or name == "test_repro")
            flat = [nodeid for ids in picked.values() for nodeid in ids]
            raw = run_ids(stage, test_file, None, Path(test_file).stem, flat, deadline, case_timeout)
            here = raw["collected"]["by_function"]
            out[test_file] = {
                "collected_frontend": {name: len(ids) for name, ids in by_function.items()},
                "session_error": raw["session_error"],
                "pytest_processes": raw["runs"],
                "output_tail": raw["tail"],
                "results": {
                    name: summarize(
                        ids, {i: raw["cases"][i] for i in ids}, here.get(name, 0), raw["session_error"], raw["runs"], ""
                    )
                    for name, ids in picked.items()
                },
            }
    return {
        "sample": sample,
        "seed": seed,
        "case_timeout": case_timeout,
        "sampled_from": "ids collected through the real frontend",
        **staged,
        "files": out,
    }
