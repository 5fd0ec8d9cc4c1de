"""How much code written for the cuDNN frontend runs unchanged through ``import cudnn_attn as cudnn``.

Measured on the frontend's own SDPA material, read from a copy of its repository (``--frontend-dir``
holds ``samples/python/5[0-3]_*.ipynb`` and ``test/python/``):

* Notebooks. Each SDPA sample's code cells run in order in one namespace, in a fresh subprocess per
  notebook. The one edit is ``import cudnn`` -> ``import cudnn_attn as cudnn`` (``--through
  cudnn_attn``); IPython magic and shell lines (``%``, ``!``) are skipped. ``--device cpu`` also
  edits the device spellings (``.cuda()``, ``device="cuda"``, ``torch.cuda.synchronize()``) and
  answers the GPU preconditions (``torch.cuda.is_available()``, ``get_device_capability()``,
  ``cudnn.backend_version()``: a CPU machine has no cuDNN library to report); each
  edit is listed. Per notebook: cells run, the first failing cell and its exception.
* ``test_mhas.py``: ``test_sdpa`` (``-k "test_sdpa and not backward"``) and ``test_sdpa_backward``
  under pytest in a subprocess, on copies of the test files whose ``cudnn`` imports are rewritten
  the same way (the module cannot simply be shadowed: cudnn_attn lowers to the real ``cudnn``).
  ``--tests-sample N`` picks N ids, half per test function, by a fixed seed from the ids collected
  through the real frontend, so both ways run the same cases; each case's own ``random`` draws (its
  shapes) are seeded from its id. A plugin logs every report as it happens, so a case that kills
  the process is recorded and the rest resume. Per test function: selected, collected, run, passed,
  failed, skipped, errors, and failure and skip messages grouped by their first line.

    python tests/frontend_conformance.py --frontend-dir .frontend [--through cudnn_attn|cudnn]
        [--device cuda|cpu] [--tests-sample N] [--out report.json]

Every subprocess sees ``PYTHONPATH`` first, then this checkout, so a snapshot of one commit can be
measured instead of the working tree (``git archive HEAD cudnn_attn | tar -x -C DIR``, DIR first on
``PYTHONPATH``); the report records which cudnn_attn, frontend and cuDNN ran. A standalone script, not
a pytest module; it needs torch and the frontend, and a GPU for ``--device cuda``.
"""

from __future__ import annotations

import argparse
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
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = "samples/python/5[0-3]_*.ipynb"
TEST_DIR = "test/python"
TEST_FILE = "test_mhas.py"
SELECTIONS = {"test_sdpa": "test_sdpa and not backward", "test_sdpa_backward": "test_sdpa_backward"}

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
]

PLUGIN = '''"""Logs each pytest report as one JSON line; keeps only the selected ids; seeds each case's random."""
import json, os, random, zlib
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

@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    total = len(items)
    if os.environ.get("CONFORMANCE_SELECT"):
        with open(os.environ["CONFORMANCE_SELECT"]) as f:
            wanted = set(json.load(f))
        config.hook.pytest_deselected(items=[i for i in items if i.nodeid not in wanted])
        items[:] = [i for i in items if i.nodeid in wanted]
    _write(event="collected", total=total, kept=len(items))

def pytest_collectreport(report):
    if report.failed:
        _write(event="collect_error", nodeid=report.nodeid, message=_message(report))

def pytest_runtest_logstart(nodeid, location):
    _write(event="start", nodeid=nodeid)

@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    random.seed(zlib.crc32(item.nodeid.encode()))

def pytest_runtest_logreport(report):
    _write(event="report", nodeid=report.nodeid, when=report.when, outcome=report.outcome, message=_message(report))
'''

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


# ---------------------------------------------------------------- edits


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


# ---------------------------------------------------------------- notebooks


def notebook_cells(path: Path) -> list[dict]:
    """Code cells as ``{"index", "source"}``, magic and shell lines dropped."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    found = []
    for index, cell in enumerate(cells):
        if cell.get("cell_type") != "code":
            continue
        source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]
        found.append({"index": index, "source": "\n".join(lines) + "\n"})
    return found


def type_name(kind: type) -> str:
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def exec_cells(cells_file: Path, result_file: Path) -> None:
    """Child side: runs the cells in one namespace, writing progress after every cell."""
    cells = json.loads(cells_file.read_text())
    result: dict = {"cells_ok": 0, "current": None, "failure": None}
    namespace: dict = {"__name__": "__main__"}
    for number, cell in enumerate(cells, 1):
        result["current"] = cell["index"]
        result_file.write_text(json.dumps(result))
        name = f"<cell {cell['index']}>"
        try:
            exec(compile(cell["source"], name, "exec"), namespace)
        except BaseException as error:  # a notebook's failure is the measurement
            frames = traceback.extract_tb(error.__traceback__)
            in_cell = [f for f in frames if f.filename == name]
            result["failure"] = {
                "cell": cell["index"],
                "code_cell": number,
                "type": type_name(type(error)),
                "message": str(error)[:800],
                "line": cell["source"].splitlines()[(in_cell[-1].lineno or 1) - 1].strip() if in_cell else None,
                "raised_at": f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None,
            }
            break
        result["cells_ok"] += 1
    result["current"] = None
    result_file.write_text(json.dumps(result))


def run_notebook(path: Path, through: str, device: str, timeout: float) -> dict:
    """One notebook in a fresh subprocess; its record for the report."""
    cells, edits, imports = notebook_cells(path), Counter[str](), 0
    for cell in cells:
        if through == "cudnn_attn":
            cell["source"], n = rewrite_imports(cell["source"])
            imports += n
        if device == "cpu":
            cell["source"], applied = edit_for_cpu(cell["source"])
            edits.update(applied)
    with tempfile.TemporaryDirectory(prefix="conformance-nb-") as tmp:
        cells_file, result_file = Path(tmp) / "cells.json", Path(tmp) / "result.json"
        cells_file.write_text(json.dumps(cells))
        start = time.monotonic()
        code, output = run_child(
            [sys.executable, str(Path(__file__).resolve()), "--exec-cells", str(cells_file), str(result_file)],
            Path(tmp),
            timeout,
        )
        seconds = round(time.monotonic() - start, 1)
        result = json.loads(result_file.read_text()) if result_file.exists() else {"cells_ok": 0, "current": None}
    failure = result.get("failure")
    if failure is None and (code != 0 or result.get("current") is not None):
        died = "timeout" if code == "timeout" else f"process died (exit {code})"
        failure = {"cell": result.get("current"), "type": died, "message": output.strip()[-800:]}
    return {
        "notebook": path.name,
        "code_cells": len(cells),
        "cells_ok": result["cells_ok"],
        "passed": failure is None,
        "first_failure": failure,
        "import_edits": imports,
        "device_edits": dict(edits),
        "seconds": seconds,
        "output_tail": output[-600:] if failure else "",
    }


# ---------------------------------------------------------------- test_mhas


def local_imports(source: str, folder: Path) -> set[str]:
    """Modules ``source`` imports that are files in ``folder`` (test_utils.py and the like)."""
    names = re.findall(r"^\s*(?:from|import)\s+(\w+)", source, re.M)
    return {name for name in names if (folder / f"{name}.py").exists()}


def stage_tests(test_dir: Path, dest: Path, through: str) -> dict:
    """Copies test_mhas.py, conftest.py, pytest.ini and their local imports to ``dest``, imports rewritten."""
    wanted, seen, edits = [TEST_FILE, "conftest.py"], set(), 0
    while wanted:
        name = wanted.pop()
        if name in seen or not (test_dir / name).exists():
            continue
        seen.add(name)
        source = (test_dir / name).read_text(encoding="utf-8")
        wanted += [f"{m}.py" for m in local_imports(source, test_dir)]
        if through == "cudnn_attn":
            source, n = rewrite_imports(source)
            edits += n
        (dest / name).write_text(source, encoding="utf-8")
    if (test_dir / "pytest.ini").exists():
        shutil.copy(test_dir / "pytest.ini", dest / "pytest.ini")
    (dest / "_conformance_plugin.py").write_text(PLUGIN)
    shims = []
    if importlib.util.find_spec("looseversion") is None:
        (dest / "looseversion.py").write_text(LOOSEVERSION)
        shims.append("looseversion (package absent: a stand-in with distutils' LooseVersion ordering)")
    return {"files": sorted(seen), "import_edits": edits, "shims": shims}


def pytest_cmd(expr: str, *extra: str) -> list[str]:
    plugins = ["-p", "_conformance_plugin", "-p", "no:cacheprovider"]
    return [sys.executable, "-m", "pytest", TEST_FILE, "-k", expr, *plugins, *extra]


def collect_ids(stage: Path, expr: str) -> list[str]:
    """The parametrized ids ``expr`` selects, as collected here (no conftest: collecting needs no GPU)."""
    env = dict(child_env(), CONFORMANCE_LOG=str(stage / "collect.jsonl"))
    code, output = run_child(pytest_cmd(expr, "--collect-only", "-q", "--noconftest"), stage, 600, env)
    ids = [line.strip() for line in output.splitlines() if line.startswith(f"{TEST_FILE}::")]
    if not ids:
        raise RuntimeError(f"collecting {expr!r} through the real frontend failed (exit {code}):\n{output[-2000:]}")
    return ids


def sample_ids(ids_by_selection: dict[str, list[str]], n: int, seed: int) -> dict[str, list[str]]:
    """``n`` ids split evenly over the selections (all when n is 0), drawn by ``seed``, in collection order."""
    if n <= 0:
        return ids_by_selection
    rng, picked = random.Random(seed), {}
    for position, (name, ids) in enumerate(ids_by_selection.items()):
        share = n // len(ids_by_selection) + (position < n % len(ids_by_selection))
        picked[name] = [ids[i] for i in sorted(rng.sample(range(len(ids)), min(share, len(ids))))]
    return picked


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
    if call[0] == "passed" and teardown and teardown[0] == "failed":
        return "error", teardown[1]
    return call


def run_selection(stage: Path, name: str, ids: list[str], deadline: float) -> dict:
    """Runs ``ids`` under pytest until each has an outcome, resuming after a case that kills the process."""
    cases: dict[str, tuple[str, str]] = {}
    collected, session_error, runs, tail = None, None, 0, ""
    remaining = list(ids)
    while remaining and time.monotonic() < deadline:
        runs += 1
        log, select = stage / f"{name}-{runs}.jsonl", stage / f"{name}-{runs}-select.json"
        select.write_text(json.dumps(remaining))
        env = dict(child_env(), CONFORMANCE_LOG=str(log), CONFORMANCE_SELECT=str(select))
        code, output = run_child(pytest_cmd(SELECTIONS[name], "-q"), stage, deadline - time.monotonic(), env)
        tail = output[-3000:]
        reports: dict[str, dict[str, tuple[str, str]]] = {}
        started = []
        for record in read_log(log):
            if record["event"] == "collected" and collected is None:
                collected = record["total"]
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
    return summarize(ids, cases, collected or 0, session_error, runs, tail)


def grouped(cases: dict[str, tuple[str, str]], outcomes: set[str], top: int = 12) -> list[dict]:
    """Messages of the cases with these outcomes, grouped by first line, most frequent first."""
    groups: Counter = Counter()
    example: dict[str, str] = {}
    for nodeid, (outcome, message) in cases.items():
        if outcome in outcomes:
            first = (message.strip().splitlines() or [""])[0][:300]
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
        "blocked": counts["blocked"],
        "not_run": counts["not_run"],
        "pytest_processes": runs,
        "top_failures": grouped(cases, {"failed", "error", "crashed", "timeout", "blocked"}),
        "top_skips": grouped(cases, {"skipped"}),
        "cases": {nodeid: {"outcome": o, "message": m[:400]} for nodeid, (o, m) in cases.items()},
        "output_tail": tail,
    }


def run_tests(frontend: Path, through: str, sample: int, seed: int, budget: float) -> dict:
    """test_sdpa and test_sdpa_backward: the sample drawn from the real frontend's ids, run through ``through``."""
    test_dir = frontend / TEST_DIR
    deadline = time.monotonic() + budget
    with tempfile.TemporaryDirectory(prefix="conformance-tests-") as tmp:
        frame, stage = Path(tmp) / "frame", Path(tmp) / "stage"
        frame.mkdir()
        stage.mkdir()
        stage_tests(test_dir, frame, "cudnn")
        staged = stage_tests(test_dir, stage, through)
        ids = sample_ids({name: collect_ids(frame, expr) for name, expr in SELECTIONS.items()}, sample, seed)
        results = {}
        for name, expr in SELECTIONS.items():
            results[name] = run_selection(stage, name, ids[name], deadline)
            results[name]["selection"] = f"-k {expr!r}"
    return {
        "sample": sample,
        "seed": seed,
        "sampled_from": "ids collected through the real frontend",
        **staged,
        "results": results,
    }


# ---------------------------------------------------------------- report


ENV_PROBE = """
import json, platform
info = {"python": platform.python_version()}
try:
    import torch
    info.update(torch=torch.__version__, cuda=torch.cuda.is_available())
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()))
except Exception as e:
    info["torch"] = f"unavailable: {e!r}"
for name in ("cudnn", "cudnn_attn"):
    try:
        module = __import__(name)
        info[name] = {"version": module.__version__, "path": module.__file__}
    except Exception as e:
        info[name] = f"unavailable: {e!r}"
try:
    info["cudnn_backend"] = __import__("cudnn").backend_version_string()
except Exception as e:
    info["cudnn_backend"] = f"unavailable: {e!r}"
print(json.dumps(info))
"""


def source_commit(folder: Path) -> str | None:
    """The commit files in ``folder`` come from: a ``COMMIT`` file there, or HEAD where ``folder`` is a
    checkout (with " + uncommitted edits" when its tree differs)."""
    if (folder / "COMMIT").exists():
        return (folder / "COMMIT").read_text().strip()
    git = ["git", "-C", str(folder), "rev-parse", "--show-toplevel", "HEAD"]
    found = subprocess.run(git, capture_output=True, text=True).stdout.split()
    if len(found) != 2 or Path(found[0]).resolve() != folder.resolve():
        return None
    status = subprocess.run(
        ["git", "-C", str(folder), "status", "--porcelain", "--untracked-files=no"], capture_output=True
    )
    return found[1] + (" + uncommitted edits" if status.stdout.strip() else "")


def environment(frontend: Path) -> dict:
    code, output = run_child([sys.executable, "-c", ENV_PROBE], Path(tempfile.gettempdir()), 300)  # cwd off sys.path
    lines = output.strip().splitlines()
    info: dict[str, Any] = json.loads(lines[-1]) if code == 0 and lines else {"probe_failed": output[-1000:]}
    info["frontend_files"] = {"dir": str(frontend), "commit": source_commit(frontend)}
    if isinstance(info.get("cudnn_attn"), dict):
        info["cudnn_attn"]["commit"] = source_commit(Path(info["cudnn_attn"]["path"]).parent.parent)
    return info


def summary_text(report: dict) -> str:
    lines = [f"frontend conformance through {report['through']} on {report['device']}"]
    notebooks = report.get("notebooks")
    if notebooks is not None:
        lines.append(f"notebooks: {sum(nb['passed'] for nb in notebooks)}/{len(notebooks)} pass")
        for nb in notebooks:
            status = "pass" if nb["passed"] else "FAIL"
            lines.append(f"  {nb['notebook']:<42} {status} {nb['cells_ok']}/{nb['code_cells']} code cells")
            if nb["device_edits"]:
                lines.append("    device edits: " + ", ".join(f"{k} x{n}" for k, n in nb["device_edits"].items()))
            failure = nb["first_failure"]
            if failure:
                first = (failure.get("message") or "").strip().splitlines()[:1]
                lines.append(f"    cell {failure.get('cell')}: {failure['type']}: {first[0] if first else ''}"[:300])
    tests = report.get("tests")
    if tests is not None and "results" in tests:
        lines.append(
            f"{TEST_FILE} (sample {tests['sample'] or 'all'}, seed {tests['seed']}; shims: {tests['shims'] or 'none'})"
        )
        for name, r in tests["results"].items():
            lines.append(
                f"  {name}: selected {r['selected']}, collected {r['collected']}, run {r['run']}, passed {r['passed']},"
                f" failed {r['failed']}, skipped {r['skipped']}, errors {r['errors']}, blocked {r['blocked']}, not run {r['not_run']}"
            )
            for group in r["top_failures"][:6]:
                lines.append(f"    {group['count']:>4} x {group['message']}"[:300])
    elif tests is not None:
        lines.append(f"{TEST_FILE}: {tests.get('skipped') or tests.get('error')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frontend-dir", type=Path, required=True, help="copy of NVIDIA/cudnn-frontend's files")
    parser.add_argument("--through", choices=["cudnn_attn", "cudnn"], default="cudnn_attn")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--parts", default="notebooks,tests", help="comma-separated: notebooks, tests")
    parser.add_argument("--tests-sample", type=int, default=200, help="test ids to draw (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--notebook-timeout", type=float, default=300)
    parser.add_argument("--tests-timeout", type=float, default=900, help="seconds for all test_mhas runs together")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    frontend, parts = args.frontend_dir.resolve(), set(args.parts.split(","))

    report: dict = {"through": args.through, "device": args.device, "environment": environment(frontend)}
    if "notebooks" in parts:
        paths = sorted(frontend.glob(NOTEBOOKS))
        report["notebooks"] = [run_notebook(p, args.through, args.device, args.notebook_timeout) for p in paths]
    if "tests" in parts and args.device == "cpu":
        report["tests"] = {"skipped": "test_mhas needs a GPU (its conftest asserts torch.cuda.is_available())"}
    elif "tests" in parts:
        try:
            report["tests"] = run_tests(frontend, args.through, args.tests_sample, args.seed, args.tests_timeout)
        except RuntimeError as error:
            report["tests"] = {"error": str(error)}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    print(summary_text(report))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--exec-cells"]:
        exec_cells(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        sys.exit(main())
