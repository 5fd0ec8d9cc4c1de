"""How much code written for the cuDNN frontend runs unchanged through ``import cudnn_attn as cudnn``.

Measured on the frontend's own SDPA material, read from a copy of its repository (``--frontend-dir``
holds ``samples/python/5[0-3]_*.ipynb`` and ``test/python/``):

* Notebooks (``--parts notebooks``). Each SDPA sample's code cells run in order in one namespace, in a
  fresh subprocess per notebook. The one edit is ``import cudnn`` -> ``import cudnn_attn as cudnn``
  (``--through cudnn_attn``); IPython magic and shell lines (``%``, ``!``) are skipped. ``--device cpu``
  also edits the device spellings (``.cuda()``, ``device="cuda"``, ``torch.cuda.synchronize()``, streams)
  and answers the GPU preconditions as an H100 with cuDNN 9.19.0 does (``torch.cuda.is_available()``,
  ``get_device_capability()`` (9, 0), ``cudnn.backend_version()`` 91900: a CPU machine has no cuDNN
  library to report), so the same branches and skips are taken as on that GPU; each edit is listed
  (``DEVICE_EDITS`` in ``frontend_conformance_pytest.py``). Per notebook: cells run, the first
  failing cell and its exception.
* ``test_mhas.py`` (``--parts tests``): ``test_sdpa`` (``-k "test_sdpa and not backward"``) and
  ``test_sdpa_backward`` under pytest in a subprocess, on copies of the test files (conftest.py,
  test_utils.py) whose ``cudnn`` imports are rewritten the same way (the module cannot simply be
  shadowed: cudnn_attn lowers to the real ``cudnn``), with the device edits under ``--device cpu``.
  ``--tests-sample N`` picks N ids, half per test function, by a fixed seed from the ids collected
  through the real frontend, so both ways run the same cases; each case's own ``random`` draws (its
  shapes) are seeded from its id. A plugin logs every report as it happens, so a case that kills
  the process is recorded and the rest resume; ``--case-timeout S`` fails a case still running after
  S seconds. Per test function: selected, collected, run, passed, failed, skipped, errors, and
  failure and skip messages grouped by their first line.
* The other SDPA tests (``--parts sdpa_tests``): ``test_sdpa_thd.py``, ``test_sdpa_chunked_prefill.py``,
  ``test_sdpa_with_caching.py`` and ``test_mhas_v2.py`` (with its ``sdpa/`` package), staged and
  edited the same way. Per file, ``--sdpa-tests-sample N`` ids drawn by the seed from the real
  frontend's, split evenly over the file's test functions (an fp8/mxfp8 function of test_mhas_v2 takes
  one: those kernels need FP8 hardware), run in one pytest session per file within
  ``--sdpa-tests-timeout`` seconds; reported per function as above.

    python tests/frontend_conformance.py --frontend-dir .frontend [--through cudnn_attn|cudnn]
        [--device cuda|cpu] [--parts notebooks,tests,sdpa_tests] [--tests-sample N]
        [--sdpa-tests-sample N] [--sdpa-tests-files F,...] [--case-timeout S] [--out report.json]

Every subprocess sees ``PYTHONPATH`` first, then this checkout, so a snapshot of one commit can be
measured instead of the working tree (``git archive HEAD cudnn_attn | tar -x -C DIR``, DIR first on
``PYTHONPATH``); the report records which cudnn_attn, frontend and cuDNN ran. A standalone script, not
a pytest module; it needs torch and the frontend, and a GPU for ``--device cuda``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

from frontend_conformance_pytest import (  # this script's folder is first on sys.path
    SDPA_TEST_FILES,
    TEST_FILE,
    edit_for_cpu,
    rewrite_imports,
    run_child,
    run_sdpa_tests,
    run_tests,
)

NOTEBOOKS = "samples/python/5[0-3]_*.ipynb"


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


def edits_lines(device_edits: dict, indent: str) -> list[str]:
    """The device edits made, one line per staged file."""
    return [
        f"{indent}device edits in {name}: " + ", ".join(f"{k} x{n}" for k, n in made.items())
        for name, made in device_edits.items()
    ]


def function_lines(results: dict, indent: str) -> list[str]:
    """One line of counts per test function, then its most frequent failure messages."""
    lines = []
    for name, r in results.items():
        lines.append(
            f"{indent}{name}: selected {r['selected']}, collected {r['collected']}, run {r['run']}, passed {r['passed']},"
            f" failed {r['failed']}, skipped {r['skipped']}, errors {r['errors']}, blocked {r['blocked']}, not run {r['not_run']}"
        )
        for group in r["top_failures"][:6]:
            lines.append(f"{indent}  {group['count']:>4} x {group['message']}"[:300])
    return lines


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
        lines += edits_lines(tests.get("device_edits", {}), "  ")
        lines += function_lines(tests["results"], "  ")
    elif tests is not None:
        lines.append(f"{TEST_FILE}: {tests.get('skipped') or tests.get('error')}")
    sdpa = report.get("sdpa_tests")
    if sdpa is not None:
        timeout = f"case timeout {sdpa['case_timeout']} s" if sdpa["case_timeout"] else "no case timeout"
        lines.append(
            f"SDPA tests (sample {sdpa['sample'] or 'all'} per file, seed {sdpa['seed']}; {timeout};"
            f" shims: {sdpa['shims'] or 'none'})"
        )
        lines += edits_lines(sdpa["device_edits"], "  ")
        for name, record in sdpa["files"].items():
            if "error" in record:
                lines.append(f"  {name}: {record['error'].splitlines()[0]}")
                continue
            lines.append(f"  {name}: {sum(record['collected_frontend'].values())} ids through the real frontend")
            lines += function_lines(record["results"], "    ")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frontend-dir", type=Path, required=True, help="copy of NVIDIA/cudnn-frontend's files")
    parser.add_argument("--through", choices=["cudnn_attn", "cudnn"], default="cudnn_attn")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--parts", default="notebooks,tests", help="comma-separated: notebooks, tests, sdpa_tests")
    parser.add_argument("--tests-sample", type=int, default=200, help="test_mhas ids to draw (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--notebook-timeout", type=float, default=300)
    parser.add_argument("--tests-timeout", type=float, default=900, help="seconds for all test_mhas runs together")
    parser.add_argument("--case-timeout", type=int, default=0, help="seconds one test case may run (0: no limit)")
    parser.add_argument("--sdpa-tests-sample", type=int, default=40, help="ids to draw per SDPA test file (0: all)")
    parser.add_argument("--sdpa-tests-files", default=",".join(SDPA_TEST_FILES), help="comma-separated test files")
    parser.add_argument("--sdpa-tests-timeout", type=float, default=600, help="seconds for each SDPA test file")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    frontend, parts = args.frontend_dir.resolve(), set(args.parts.split(","))

    report: dict = {"through": args.through, "device": args.device, "environment": environment(frontend)}
    if "notebooks" in parts:
        paths = sorted(frontend.glob(NOTEBOOKS))
        report["notebooks"] = [run_notebook(p, args.through, args.device, args.notebook_timeout) for p in paths]
    if "tests" in parts:
        try:
            report["tests"] = run_tests(
                frontend, args.through, args.tests_sample, args.seed, args.tests_timeout, args.device, args.case_timeout
            )
        except RuntimeError as error:
            report["tests"] = {"error": str(error)}
    if "sdpa_tests" in parts:
        files = [name for name in args.sdpa_tests_files.split(",") if name]
        report["sdpa_tests"] = run_sdpa_tests(
            frontend,
            args.through,
            files,
            args.sdpa_tests_sample,
            args.seed,
            args.sdpa_tests_timeout,
            args.device,
            args.case_timeout,
        )
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
