"""The samples and the command line run end to end."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cudnn_attn
from cudnn_attn.cli import commands as cli
from cudnn_attn.cli import features, info
from cudnn_attn.core import validation

SAMPLES = sorted((Path(__file__).parent.parent / "samples").glob("*.py"))
# The relative error each sample's results must stay under (what the samples check themselves).
SAMPLE_TOLERANCE = {
    "01_quickstart": 2e-2,
    "02_inference_server": 2e-2,
    "03_training": 3e-2,
    "04_fp8": 7e-2,
    "05_varlen_packing": 3e-2,
    "06_serving": 3e-2,
    "07_context_parallel": 3e-2,
    "08_frontend_dropin": 2e-2,
    "09_model_families": 3e-2,
    "10_continuous_batching": 1e-9,  # the share of greedy tokens that differ: none may
}
REL_ERR = re.compile(r"rel_err=(\S+)")


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.stem for s in SAMPLES])
def test_sample_runs_and_checks_its_results(sample, tmp_path):
    # A fresh process, as a user runs it, importing this cudnn_attn, with a private plan store.
    package_root = str(Path(cudnn_attn.__file__).parent.parent)
    python_path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": python_path, "CUDNN_ATTN_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, str(sample)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    errors = [float(text) for text in REL_ERR.findall(run.stdout)]
    assert len(errors) >= 3, run.stdout
    tol = SAMPLE_TOLERANCE[sample.stem]
    for err in errors:
        assert math.isfinite(err) and err < tol, run.stdout
    assert "all results match" in run.stdout


def test_info_reports_versions_and_features(capsys):
    assert cli.main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cudnn_attn"] == cudnn_attn.__version__ and report["torch"] == torch.__version__
    assert report["backend"] == ("cudnn" if torch.cuda.is_available() else "reference")
    assert set(report["features"]) >= {"causal", "paged KV cache", "backward"}
    assert all(status == "yes" or status.startswith("no: ") for status in report["features"].values())


def test_info_features_are_the_backends_answers_for_well_formed_problems(monkeypatch):
    # A "yes" means something only if the problem asked about is well formed ...
    for feature, problem in features.sample_problems("cpu").items():
        assert validation.problems(problem) == [], feature

    # ... and if the status is the backend's answer, not a fixed string.
    class NoPagedCaches:
        def not_supported_reasons(self, problem):
            return ["no paged caches here"] if problem.is_paged else []

    monkeypatch.setattr(info, "get_backend", lambda name: NoPagedCaches())
    found = info.collect()["features"]
    assert found.pop("paged KV cache") == "no: no paged caches here"
    assert set(found.values()) == {"yes"}


def test_bench_bare_h_prints_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "-h"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: cudnn-attn bench")
    for flag in ("--batch", "--heads", "--kv-heads", "--seq", "--head-dim", "--dtype", "--causal", "--plot"):
        assert flag in out


def test_bench_h_with_a_number_sets_the_heads(monkeypatch):
    args = cli._bench_parser().parse_args(["-h", "8", "-s", "1024"])
    assert (args.heads, args.seq, args.batch) == (8, 1024, 4)
    assert cli._bench_parser().parse_args([]).heads == 16
    seen = []  # the same through the subcommand that main mounts
    monkeypatch.setattr(cli, "_bench", lambda args: seen.append(args) or 0)
    assert cli.main(["bench", "-h", "8", "--causal"]) == 0
    assert seen[0].heads == 8 and seen[0].causal


def test_every_bench_flag_has_help():
    for action in cli._bench_parser()._actions:
        assert action.help, action.option_strings or action.dest


def test_bench_plot_without_matplotlib_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails, as when it is missing
    assert cli.main(["bench", "--plot", "bench.png"]) == 1  # an environment error: the extra is missing
    err = capsys.readouterr().err
    assert "matplotlib" in err and 'pip install "cudnn-attn[plot]"' in err


def test_one_shape_bench_prints_fmha_v2_style_lines():
    from cudnn_attn.bench.attention import fmha_lines

    row = {
        "shape": "b1-h8-s128-d64-bf16",
        "columns": {
            "cudnn_attn": {"ms": 1.1723, "tflops": 468.94, "gbps": 458.04, "spread_pct": 1.5, "rel_err": 2.5e-3},
            "torch flash": {"ms": 1.3, "tflops": 400.0, "gbps": 400.0, "spread_pct": 2.0, "rel_err": float("nan")},
            "torch efficient": {"error": "no kernel"},
        },
    }
    text = fmha_lines(row, "bf16")
    assert "Checks: SUCCESS" in text.split("torch flash")[0]
    assert "Elapsed: 1172.3 us, 468.9 TFLOP/s, 458.0 GB/s" in text
    assert "Checks: FAILED" in text.split("torch flash")[1]  # NaN never passes
    assert "not run: no kernel" in text


def test_choosing_a_backend_names_every_backend_and_prints_what_it_states(capsys):
    """The page spoke of "two backends", its table left out "torch", and a comment stated an
    error without the "torch" name that the error lists."""
    from cudnn_attn.ops import BACKEND_NAMES, BACKENDS

    text = (Path(__file__).parent.parent / "docs" / "choosing_a_backend.md").read_text()
    assert re.findall(r'^\| `"(\w+)"`', text, re.M) == [n for n in BACKEND_NAMES if n != "auto"] + ["auto"]
    assert f"one of {['no', 'one', 'two', 'three', 'four'][len(BACKENDS)]} backends" in text
    namespace: dict = {"__name__": "__main__"}
    stated_blocks = 0
    for mark, code in re.findall(r"(?:^(<!-- [^\n]* -->)\n)?^```python\n(.*?)^```", text, re.M | re.S):
        if mark:  # a GPU block
            continue
        exec(compile(code, "choosing_a_backend.md", "exec"), namespace)  # noqa: S102
        printed = capsys.readouterr().out
        for stated in re.findall(r"print\(error\)  # (.*)$", code, re.M):
            stated_blocks += 1
            assert printed.startswith(stated.removesuffix(" ...")), (stated, printed)
    assert stated_blocks == 2
