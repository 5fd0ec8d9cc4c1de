"""The notebooks run top to bottom on the CPU, and the outputs saved in them are what they print.

Each notebook is executed afresh (the reference backend, no GPU) and compared cell by cell with
its saved outputs: the text with every number taken out must be the same, integers must be
equal and other numbers close (round-off may differ between CPUs; a result that changed does
not). A notebook saved without outputs, with an error, or with outputs of older code fails.

To save a notebook's outputs after editing it (``ruff format notebooks/`` first):

    python tests/test_notebooks.py [notebooks/NAME.ipynb ...]
"""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path
from unittest import mock

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 120
# The kernel runs on the CPU (the saved outputs are a CPU run) and without the debug log.
KERNEL_ENV = {"CUDA_VISIBLE_DEVICES": "", "CUDNN_ATTN_LOG_LEVEL": None}

NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
ROUND_OFF = 1e-5  # numbers this small are round-off (a float32 error): any two of them agree
FLOAT_RTOL = 0.1  # other floats agree within 10% (the same seeds on another CPU)


def execute(path: Path):
    """A fresh run of the notebook at ``path``, in its own folder; raises on any cell's error."""
    notebook = nbformat.read(path, as_version=4)
    with mock.patch.dict(os.environ):  # the kernel inherits these; the old values come back after
        for key, value in KERNEL_ENV.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        client = nbclient.NotebookClient(
            notebook,
            timeout=CELL_TIMEOUT_S,
            kernel_name="python3",
            record_timing=False,
            resources={"metadata": {"path": str(path.parent)}},
        )
        client.execute()
    notebook.metadata = {"kernelspec": notebook.metadata["kernelspec"], "language_info": {"name": "python"}}
    for cell in code_cells(notebook):  # one message per run of a stream: saved files do not churn
        merged: list = []
        for output in cell.outputs:
            last = merged[-1] if merged else None
            if output.output_type == "stream" and last and last.output_type == "stream" and last.name == output.name:
                last.text += output.text
            else:
                merged.append(output)
        cell.outputs = merged
    return notebook


def code_cells(notebook) -> list:
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def printed(cell) -> dict[str, str]:
    """A cell's outputs as text by kind: stdout and stderr each joined (how a stream is split
    into messages depends on timing), results and displays by their plain text, errors by name."""
    texts: dict[str, str] = {}
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            kind, text = output.name, output.text
        elif output.output_type in ("execute_result", "display_data"):
            kind, text = output.output_type, output.get("data", {}).get("text/plain", "") + "\n"
        else:
            kind, text = "error", f"{output.get('ename')}: {output.get('evalue')}\n"
        texts[kind] = texts.get(kind, "") + text
    return texts


def numbers_agree(saved: str, fresh: str) -> bool:
    if not any(c in saved + fresh for c in ".eE"):
        return int(saved) == int(fresh)
    a, b = float(saved), float(fresh)
    if abs(a) <= ROUND_OFF and abs(b) <= ROUND_OFF:
        return True
    return math.isclose(a, b, rel_tol=FLOAT_RTOL)


def differences(saved_text: str, fresh_text: str) -> list[str]:
    """What differs between a saved and a fresh output, beyond round-off."""
    if NUMBER.sub("#", saved_text) != NUMBER.sub("#", fresh_text):
        return [f"text differs:\n--- saved\n{saved_text}--- fresh\n{fresh_text}"]
    return [
        f"{a} saved, {b} now (in: {fresh_text.strip()[:200]!r})"
        for a, b in zip(NUMBER.findall(saved_text), NUMBER.findall(fresh_text))
        if not numbers_agree(a, b)
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_saved_outputs_are_complete(path):
    """Saved from one top-to-bottom run: every code cell numbered in order (clearing outputs
    clears the numbers too), outputs saved, no errors, no timing metadata, nothing that names
    this machine. (Which cells print is checked against a fresh run below.)"""
    cells = code_cells(nbformat.read(path, as_version=4))
    assert cells, f"{path.name} has no code cells"
    problems = []
    for number, cell in enumerate(cells, 1):
        where = f"{path.name}, code cell {number}"
        if cell.get("execution_count") != number:
            problems.append(f"{where}: execution_count {cell.get('execution_count')}, expected {number}")
        texts = printed(cell)
        if "error" in texts:
            problems.append(f"{where}: saved an error: {texts['error'].strip()}")
        if "execution" in cell.metadata:
            problems.append(f"{where}: timing metadata saved")
        everything = "".join(texts.values())
        if re.search(r"0x[0-9a-fA-F]{6,}", everything) or str(NOTEBOOK_DIR.parent) in everything:
            problems.append(f"{where}: a memory address or an absolute path in the output")
    if not any(printed(cell) for cell in cells):
        problems.append(f"{path.name}: no outputs saved")
    assert not problems, "\n".join(problems) + "\n(re-save with: python tests/test_notebooks.py)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_fresh_run_matches_saved_outputs(path):
    saved = code_cells(nbformat.read(path, as_version=4))
    fresh = code_cells(execute(path))  # raises CellExecutionError on any failed cell (or check)
    problems = []
    for number, (before, now) in enumerate(zip(saved, fresh), 1):
        before_texts, now_texts = printed(before), printed(now)
        if sorted(before_texts) != sorted(now_texts):
            problems.append(f"code cell {number}: saved {sorted(before_texts)} outputs, now {sorted(now_texts)}")
            continue
        for kind in before_texts:
            problems += [f"code cell {number} ({kind}): {d}" for d in differences(before_texts[kind], now_texts[kind])]
    assert not problems, f"{path.name}: saved outputs are stale\n" + "\n".join(problems)


def test_numbers_compare_as_documented():
    assert differences("rel_err=2.29e-07 ok\n", "rel_err=3.1e-07 ok\n") == []  # round-off
    assert differences("loss 6.472 -> 0.856\n", "loss 6.48 -> 0.86\n") == []
    assert differences("loss 6.472 -> 0.856\n", "loss 6.472 -> 0.5\n")  # a result that changed
    assert differences("44 tokens\n", "45 tokens\n")  # integers are exact
    assert differences("rel_err=1.0e-03 ok\n", "rel_err=nan ok\n")  # the text around changed
    assert differences("rel_err=5.4e-02 ok\n", "rel_err=5.4e-02 MISMATCH\n")


if __name__ == "__main__":
    for name in sys.argv[1:] or [str(p) for p in NOTEBOOKS]:
        target = Path(name).resolve()
        nbformat.write(execute(target), target)
        print(f"saved {target.relative_to(NOTEBOOK_DIR.parent)}")
