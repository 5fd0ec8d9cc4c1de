"""The command line's conventions: --version, python -m, --json FILE or -, exit codes 1 and 2,
info's features, store path and environment variables, progress bars, and a chart for every bench
section (on this CPU the sections' measurements are replaced by the committed GPU reports, so what
is checked is the wiring: every section's figures reach --json and --plot)."""

from __future__ import annotations

import ast
import importlib.metadata
import io
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cudnn_attn
from cudnn_attn.bench import attention, chart_kit, charts, host, progress, targets
from cudnn_attn.cli import bench_command, commands, store, versions
from cudnn_attn.core.environment import VARIABLES

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parent.parent
DOCS_BENCH = sorted((ROOT / "docs" / "bench").glob("*.json"))


def committed(name: str) -> dict:
    return json.loads((ROOT / "docs" / "bench" / name).read_text())


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (the first chunk, at byte 16)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def assert_sane_png(path: Path) -> None:
    width, height = png_size(path)
    assert 600 <= width <= 2000 and 300 <= height <= 2000, (width, height)
    assert 5_000 < path.stat().st_size < 400_000, path.stat().st_size


# ---- --version and python -m --------------------------------------------------------------------


def test_version_names_the_installed_distribution_and_its_stack(capsys):
    with pytest.raises(SystemExit) as done:
        commands.main(["--version"])
    assert done.value.code == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"cudnn-attn {importlib.metadata.version('cudnn-attn')} (")
    assert f"torch {torch.__version__}" in line and "cuDNN " in line and "frontend " in line


@pytest.mark.parametrize("module", ["cudnn_attn", "cudnn_attn.cli"])
def test_python_dash_m_runs_the_command(module):
    done = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"cudnn-attn {versions.package_version()} (torch {torch.__version__}")


# ---- info -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def report():
    return cudnn_attn.cli.info.collect()


def test_info_json_to_a_file_to_stdout_and_bare(tmp_path, capsys):
    path = tmp_path / "info.json"
    assert commands.main(["info", "--json", str(path)]) == 0
    assert capsys.readouterr().out == ""  # the file only
    written = json.loads(path.read_text())
    assert written["cudnn_attn"] == versions.package_version() and written["torch"] == torch.__version__
    for spelling in (["--json", "-"], ["--json"]):  # a bare --json means stdout, as it always did
        assert commands.main(["info", *spelling]) == 0
        assert json.loads(capsys.readouterr().out)["features"] == written["features"]


def test_info_lists_the_features_the_store_and_every_environment_variable(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("CUDNN_ATTN_CACHE_DIR", str(tmp_path / "plans"))
    monkeypatch.setenv("CUDNN_ATTN_AUTOTUNE", "1")
    assert commands.main(["info"]) == 0
    text = capsys.readouterr().out
    assert f"plan_store           {tmp_path / 'plans'}" in text.splitlines()
    status = {line[2:36].strip(): line[36:].strip() for line in text.splitlines() if line.startswith("  ")}
    for feature in (
        "FP8 forward",
        "FP8 backward",
        "THD (ragged, varlen)",
        "paged KV cache",
        "attention sinks",
        "softcap (score modifier)",
        "context parallel",
    ):
        assert status[feature] == "yes" or status[feature].startswith("no: "), feature
    for variable in VARIABLES:
        assert variable.name in text and variable.meaning in text
    assert "CUDNN_ATTN_AUTOTUNE        '1' (default 0)" in text
    assert "CUDNN_ATTN_LOG_LEVEL       unset" in text


def test_info_features_on_cpu_are_the_reference_backends(report):
    assert report["backend"] == ("cudnn" if torch.cuda.is_available() else "reference")
    if not torch.cuda.is_available():  # the reference backend runs every feature
        assert set(report["features"].values()) == {"yes"}, report["features"]
    assert [v["name"] for v in report["environment"]] == [v.name for v in VARIABLES]


def _variables_read(source: str) -> set[str]:
    """The names passed to ``os.environ.get``, ``os.getenv`` or ``os.environ[...]`` in ``source``:
    a string literal, or a module-level constant assigned one."""
    tree = ast.parse(source)
    constants = {
        t.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        for t in node.targets
        if isinstance(t, ast.Name)
    }

    def name(arg: ast.expr) -> str:
        if isinstance(arg, ast.Constant):
            return arg.value
        return constants.get(arg.id, f"<{arg.id}>") if isinstance(arg, ast.Name) else "<expression>"

    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            text = ast.unparse(node.func)
            if text in ("os.environ.get", "os.getenv", "environ.get", "getenv"):
                found.add(name(node.args[0]))
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("os.environ", "environ"):
            if isinstance(node.ctx, ast.Load):
                found.add(name(node.slice))
    return found


def test_the_environment_table_lists_exactly_the_variables_the_package_reads():
    read = set()
    for path in (ROOT / "cudnn_attn").rglob("*.py"):
        if path.name != "environment.py":  # the table itself reads each name, as its current()
            read |= _variables_read(path.read_text(encoding="utf-8"))
    assert read == {v.name for v in VARIABLES}
    assert _variables_read("import os\nX = 'A'\nos.environ.get(X)\nos.getenv('B')\nos.environ['C']") == {"A", "B", "C"}


# ---- cache --------------------------------------------------------------------------------------------


@pytest.fixture
def private_store(monkeypatch, tmp_path):
    import cudnn_attn.cache as cache_module

    cache = cache_module.PlanCache(path=tmp_path / "plans")
    monkeypatch.setattr(cache_module, "_default", cache)
    return cache.store


def test_cache_ls_json_to_a_file_and_to_stdout(private_store, tmp_path, capsys):
    path = tmp_path / "ls.json"
    assert commands.main(["cache", "ls", "--json", str(path)]) == 0
    assert json.loads(path.read_text()) == {"path": str(private_store.path), "plans": []}
    assert "0 plan(s)" in capsys.readouterr().out  # the table too: the JSON went to its file
    for spelling in (["--json", "-"], ["--json"]):
        assert commands.main(["cache", "ls", *spelling]) == 0
        assert json.loads(capsys.readouterr().out)["path"] == str(private_store.path)


def test_cache_ls_lists_headers_of_another_format(private_store, capsys):
    """Checksum-valid plan files whose header fields have other types (another version's store)
    are listed and flagged, what can be read shown, the rest unknown (it was a traceback)."""
    headers = {
        "a": {"platform": "H100/9.19", "describe": "sdpa b1 h2 s64", "variant": "fwd"},
        "b": {"platform": {"gpu": "H100", "cudnn": [9, 19]}, "describe": None, "choice": "engine 3"},
        "c": {"platform": {"gpu": "H100", "cudnn": 91900}, "describe": "sdpa b2", "variant": {"x": 1}},
        "d": {
            "platform": {"gpu": "H100", "cudnn": 91900},
            "describe": "sdpa b4",
            "variant": "fwd",
            "choice": {"index": 3, "name": "eng3"},
        },
        # no platform at all: a load never matches it (it was listed as OK)
        "e": {"describe": "sdpa b8", "variant": "fwd", "choice": {"index": 1, "name": "eng1"}},
    }
    for name, header in headers.items():
        assert private_store.save(name * 64, header, b"blob")
    assert commands.main(["cache", "ls", "--json", "-"]) == 0
    rows = {row["file"][0]: row for row in json.loads(capsys.readouterr().out)["plans"]}
    assert rows["a"]["plan"] == "sdpa b1 h2 s64" and rows["a"]["gpu"] == rows["a"]["cudnn"] == "?"
    assert rows["b"]["gpu"] == "H100" and rows["b"]["plan"] == rows["b"]["cudnn"] == rows["b"]["engine"] == "?"
    assert rows["c"]["cudnn"] == 91900 and rows["c"]["variant"] == "?"
    odd = {
        "a": ["platform"],
        "b": ["platform.cudnn", "describe", "choice"],
        "c": ["variant"],
        "e": ["platform is missing"],
    }
    for name, fields in odd.items():
        assert not rows[name]["ok"] and all(field in rows[name]["problem"] for field in fields), rows[name]
    assert rows["d"]["ok"] and rows["d"]["problem"] is None and rows["d"]["engine"] == "eng3"
    assert commands.main(["cache", "ls"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("5 plan(s)") and len(lines) == 6
    assert sum("FOREIGN (header of another format" in line for line in lines) == 4
    assert any(line.strip().startswith("d" * 12) and "H100 cuDNN 91900" in line for line in lines)


@pytest.fixture
def gpu_machine(monkeypatch):
    """A machine that claims a GPU and a loadable cuDNN (nothing here may then touch the device)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "test GPU")
    monkeypatch.setattr(versions, "cudnn_missing", lambda: None)


def test_cache_warm_json_goes_to_stdout_and_its_lines_to_stderr(private_store, gpu_machine, monkeypatch, capsys):
    def build(servers, shapes, autotune):
        print("a line per shape")
        return [{"shape": s.label(), "seconds": 1.0, "sources": ["built"]} for s in shapes]

    monkeypatch.setattr(store, "_build", build)
    assert commands.main(["cache", "warm", "b=1,h=2,s=64,d=64", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"warmed": [{"shape": "b1-h2-s64-d64-bf16", "seconds": 1.0, "sources": ["built"]}]}
    assert "a line per shape" in err


# ---- exit codes ---------------------------------------------------------------------------------------


def test_help_documents_the_exit_codes(capsys):
    for argv in (["--help"], ["bench", "--help"], ["cache", "warm", "--help"]):
        with pytest.raises(SystemExit):
            commands.main(argv)
        text = capsys.readouterr().out
        assert "exit status:" in text and "1  environment error" in text and "2  usage error" in text


def test_usage_errors_exit_2(capsys, tmp_path):
    with pytest.raises(SystemExit) as done:  # argparse's own
        commands.main(["bench", "--frogs"])
    assert done.value.code == 2
    capsys.readouterr()
    cases = [
        (["bench", "b=1,frogs=2"], "frogs: unknown shape key"),
        (["bench", "--plot-from", str(ROOT / "docs/bench/grid_h100.json")], "--plot-from needs --plot"),
        (["bench", "--plot-from", str(tmp_path / "missing.json"), "--plot", str(tmp_path / "x.png")], "cannot read"),
        (["bench", "--plot-from", "r.json", "--plot", "x.png", "--serving", "b=1"], "takes no shapes, --serving"),
        (["cache", "warm"], "give shapes or --file"),
        (["bench", "--packed"], "go with --context-parallel"),
        (["bench", "--cp-mode", "all_gather"], "go with --context-parallel"),
        (["bench", "--page", "16"], "--page goes with --serving"),
        # a section that runs by itself, beside another: the others were dropped without a word
        (["bench", "--serving", "--mla"], "--serving runs by itself; drop --mla"),
        (["bench", "--serving", "--dtype", "fp8"], "--dtype fp8 runs by itself; drop --serving"),
        (["bench", "--serving", "--grid"], "--serving runs by itself; drop --grid"),
        (["bench", "--serving", "--stack"], "--serving runs by itself; drop --stack"),
        (["bench", "--serving", "b=2,h=4"], "--serving runs by itself; drop shapes"),
        # a --json file that cannot be written, before any work (FileNotFoundError, IsADirectoryError)
        (["cache", "ls", "--json", str(tmp_path / "missing" / "x.json")], "--json"),
        (["cache", "ls", "--json", str(tmp_path)], "a directory; give a file to write"),
        (["info", "--json", str(tmp_path / "missing" / "x.json")], "no directory"),
        (["bench", "--serving", "--json", str(tmp_path / "missing" / "y.json")], "no directory"),
    ]
    for argv, message in cases:
        assert commands.main(argv) == 2, argv
        assert message in capsys.readouterr().err


def test_environment_errors_exit_1(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert commands.main(["bench"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU, but no cuDNN library
    missing = {"frontend": "1.32.0", "cudnn": None, "cudnn_error": "the cuDNN library is not loadable here"}
    monkeypatch.setattr(versions, "frontend_versions", lambda: missing)
    assert commands.main(["cache", "warm", "b=1,h=2,s=64,d=64"]) == 1
    assert "needs cuDNN: the cuDNN library is not loadable here" in capsys.readouterr().err
    monkeypatch.setenv("CUDNN_ATTN_CACHE_DIR", "")
    import cudnn_attn.cache as cache_module

    monkeypatch.setattr(cache_module, "_default", None)
    assert commands.main(["cache", "ls"]) == 1
    assert "store is off" in capsys.readouterr().err


def test_plot_without_matplotlib_exits_1_naming_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    grid = str(ROOT / "docs/bench/grid_h100.json")
    assert commands.main(["bench", "--plot-from", grid, "--plot", str(tmp_path / "x.png")]) == 1
    assert 'pip install "cudnn-attn[plot]"' in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_batching_without_transformers_batching_exits_1_naming_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # checked before the GPU: CI has none
    assert commands.main(["bench", "--batching"]) == 1
    assert "--batching needs transformers with continuous batching" in capsys.readouterr().err


# ---- bench: every section reaches --json and --plot ------------------------------------------------------


def _fake_sections(monkeypatch) -> dict[str, dict]:
    """Each section's measurement replaced by a committed GPU report's figures; what each
    ``bench`` command line should then write."""
    from cudnn_attn.bench import context_parallel, fp8, frontend_rebuild, mla, model_shapes, prefill, serving, varlen

    grid, overhead = committed("grid_h100.json"), committed("overhead_h100.json")
    targets_h100 = committed("targets_h100.json")
    by_label = {row["shape"]: row for row in grid["rows"]}  # the grid's shapes; any other: the overhead's row
    monkeypatch.setattr(attention, "bench_shape", lambda shape: by_label.get(shape.label(), overhead["rows"][0]))
    monkeypatch.setattr(attention, "cold_start", lambda: targets_h100["cold_start"])
    monkeypatch.setattr(host, "host_paths", lambda: overhead["host_time"])
    monkeypatch.setattr(host, "layer_steps", lambda batch, seq: overhead[f"layer_step_b{batch}_s{seq}"])
    for name, fn in (("stack", "stack_steps"), ("paged_decode", "paged_decode"), ("naive", "naive_vs_fused")):
        monkeypatch.setattr(targets, fn, lambda name=name: targets_h100[name])
    fp8_h100 = committed("fp8_h100.json")
    for name in ("fp8_rows", "crossover", "accuracy"):
        monkeypatch.setattr(fp8, name, lambda name=name: fp8_h100[name.removesuffix("_rows")])
    serving_h100 = committed("serving_h100.json")
    monkeypatch.setattr(serving, "serving_rows", lambda page: serving_h100["serving"])
    monkeypatch.setattr(prefill, "prefill_row", lambda: serving_h100["prefill"])
    # One eager chunked-prefill step's memory on an H200 (docs/benchmarks.md), standing in for it.
    prefill_memory = {"io_bytes": 1128333312, "peak_extra": 61440, "planner_bytes": 61440, "held_after": 27136}
    monkeypatch.setattr(prefill, "prefill_memory", lambda: prefill_memory)
    varlen_h200 = committed("varlen_h200.json")
    for name, key in (
        ("mixed_batch", "mixed"),
        ("plans_over_packings", "plans"),
        ("llama_step", "llama"),
        ("packed_memory", "memory"),
    ):
        monkeypatch.setattr(varlen, name, lambda key=key: varlen_h200[key])
    models = committed("models_h100.json")["models"]
    monkeypatch.setattr(model_shapes, "model_rows", lambda: models)
    mla_h100 = {k: v for k, v in committed("mla_h100.json").items() if k != "device"}
    monkeypatch.setattr(mla, "mla_rows", lambda: mla_h100)
    timing = {"ms_median": 30.0, "ms_low": 29.0, "ms_high": 33.0, "iterations": 20, "rounds": 5}
    ours = {**timing, "ms_median": 1.0, "ms_low": 0.9, "ms_high": 1.2}
    rebuild = {
        "device": "test GPU",
        "shape": "b2 h8 s1024 d64 fp16 causal",
        "cudnn": timing,
        "cudnn_attn": ours,
        "speedup": 30.0,
        "identical": True,
    }
    monkeypatch.setattr(frontend_rebuild, "rebuild_loop", lambda: rebuild)
    ring = committed("context_parallel_2xh200.json")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)

    def ring_main(options):
        Path(options[options.index("--json") + 1]).write_text(json.dumps(ring))
        return 0

    monkeypatch.setattr(context_parallel, "main", ring_main)
    device = {"device": "test GPU"}
    return {
        "--grid": {**device, "rows": grid["rows"]},
        "--overhead -b 1 -h 8 -s 128 -d 64": {
            k: overhead[k] for k in ("rows", "host_time", "layer_step_b2_s512", "layer_step_b8_s2048")
        },
        "--stack --paged-decode --naive --cold-start": {
            k: targets_h100[k] for k in ("stack", "paged_decode", "naive", "cold_start")
        },
        "--dtype fp8": {**device, **{k: fp8_h100[k] for k in ("fp8", "crossover", "accuracy")}},
        "--serving": {
            **device,
            "serving": serving_h100["serving"],
            "prefill": {**serving_h100["prefill"], "memory": prefill_memory},
        },
        "--varlen": {**device, **{k: varlen_h200[k] for k in ("memory", "mixed", "plans", "llama")}},
        "--models": {**device, "models": models},
        "--mla": {**device, **mla_h100},
        "--frontend-rebuild": rebuild,
        "--context-parallel 2": ring,
    }


def test_every_section_writes_json_to_stdout_and_draws_its_chart(gpu_machine, monkeypatch, tmp_path, capsys):
    expected = _fake_sections(monkeypatch)
    for flags, figures in expected.items():
        png = tmp_path / (flags.split()[0].strip("-") + ".png")
        assert commands.main(["bench", *flags.split(), "--json", "-", "--plot", str(png)]) == 0, flags
        out, err = capsys.readouterr()
        written = json.loads(out)  # stdout is the JSON alone: the section's tables went to stderr
        assert {k: v for k, v in written.items() if k in figures} == figures, flags
        drawn = {s.name for s in charts.sections_in(written)}
        assert drawn == set(bench_command.requested(commands.parser.build().parse_args(["bench", *flags.split()])))
        assert_sane_png(png)


def test_bench_json_file_holds_what_stdout_would(gpu_machine, monkeypatch, tmp_path, capsys):
    _fake_sections(monkeypatch)
    path = tmp_path / "serving.json"
    assert commands.main(["bench", "--serving", "--json", str(path)]) == 0
    assert "PagedAttention" in capsys.readouterr().out  # the tables stay on stdout
    assert json.loads(path.read_text())["serving"] == committed("serving_h100.json")["serving"]


def test_serving_measures_the_page_size_asked_for(gpu_machine, monkeypatch, capsys):
    from cudnn_attn.bench import serving

    _fake_sections(monkeypatch)
    asked = []
    monkeypatch.setattr(serving, "serving_rows", lambda page: asked.append(page) or [])
    assert commands.main(["bench", "--serving"]) == 0
    assert commands.main(["bench", "--serving", "--page", "16"]) == 0
    assert asked == [64, 16]
    capsys.readouterr()


def test_a_section_without_a_chart_is_a_usage_error_before_anything_runs(gpu_machine, monkeypatch, tmp_path, capsys):
    from cudnn_attn.bench import serving

    monkeypatch.setattr(serving, "serving_rows", lambda: pytest.fail("measured before the usage error"))
    monkeypatch.setattr(charts, "CHARTED", charts.CHARTED - {"serving"})
    assert commands.main(["bench", "--serving", "--plot", str(tmp_path / "s.png")]) == 2
    assert "no chart for the serving section" in capsys.readouterr().err
    report = {**committed("grid_h100.json"), "frogs": {"a": 1}}  # a report with a section no chart draws
    path = tmp_path / "frogs.json"
    path.write_text(json.dumps(report))
    assert commands.main(["bench", "--plot-from", str(path), "--plot", str(tmp_path / "f.png")]) == 2
    assert "no chart for section 'frogs'" in capsys.readouterr().err
    path.write_text(json.dumps({"device": "x", "serving": [{"batch": 1}]}))  # not as bench writes it
    assert commands.main(["bench", "--plot-from", str(path), "--plot", str(tmp_path / "l.png")]) == 2
    assert "section 'serving' is not laid out as bench writes it" in capsys.readouterr().err
    path.write_text(json.dumps({"device": "x", "rows": []}))  # nothing to draw: refused, never an empty chart
    assert commands.main(["bench", "--plot-from", str(path), "--plot", str(tmp_path / "e.png")]) == 2
    assert "no figures to draw" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.png"))


MALFORMED_REPORTS = {
    # a null, a string and a boolean where a number goes: a TypeError from matplotlib, or a chart of strings
    "null": ({"cold_start": {"cold_s": 1.0, "warm_store_s": None}}, "cold_start"),
    "string": ({"cold_start": {"cold_s": "x", "warm_store_s": "y"}}, "cold_start"),
    "boolean": ({"cold_start": {"cold_s": True, "warm_store_s": None}}, "cold_start"),
    # a low time of 0: chart_kit.rate's ZeroDivisionError
    "zero": (
        {"paged_decode": {"columns": {"a": {"gbps": 1.0, "median_us": 1.0, "low_us": 0, "high_us": 1}}}},
        "paged_decode",
    ),
    # met only as the axes are laid out: no positive value on a log scale
    "nan": ({"naive": {"seqs": {"1": {"timings": {"a": {"median_us": float("nan"), "low_us": 1, "high_us": 2}}}}}}, ""),
}


@pytest.mark.parametrize("name", list(MALFORMED_REPORTS))
def test_plot_from_values_that_cannot_be_drawn_is_a_usage_error(name, tmp_path, capsys):
    report, section = MALFORMED_REPORTS[name]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    assert commands.main(["bench", "--plot-from", str(path), "--plot", str(tmp_path / "r.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cudnn-attn bench: --plot-from {path}: ") and err.count("\n") == 1, err
    assert f"section '{section}' is not laid out" in err if section else "not laid out as bench writes" in err
    assert not (tmp_path / "r.png").exists()


# ---- --plot-from every committed report ---------------------------------------------------------------


@pytest.mark.parametrize("path", DOCS_BENCH, ids=[p.stem for p in DOCS_BENCH])
def test_plot_from_every_committed_report(path, tmp_path):
    png = tmp_path / f"{path.stem}.png"
    assert commands.main(["bench", "--plot-from", str(path), "--plot", str(png)]) == 0
    assert_sane_png(png)


def test_committed_reports_are_charted_section_by_section():
    found = {p.stem: [s.name for s in charts.sections_in(json.loads(p.read_text()))] for p in DOCS_BENCH}
    assert found["targets_h100"] == ["attention", "overhead", "stack", "paged_decode", "naive", "cold_start"]
    assert found["mla_h100"] == ["mla"] and found["grid_h100"] == ["attention"]
    assert found["varlen_h200"] == ["varlen"] and found["serving_h100"] == ["serving"]
    panels = charts.panels(committed("fp8_h100.json"))
    titles = [title.removeprefix("--dtype fp8: ") for title, _ in panels]
    assert titles == ["forward", "backward", "speed vs torch's bf16", "relative error vs bf16"]


def test_spreads_are_drawn_as_error_bars_from_low_to_high():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    chart_kit.grouped(ax, ["a", "b"], {"x": [chart_kit.Bar(2.0, 1.0, 4.0), None]}, "ms")
    from matplotlib.container import BarContainer

    (bars,) = [c for c in ax.containers if isinstance(c, BarContainer)]
    assert [p.get_height() for p in bars.patches] == [2.0]  # the missing cell draws no bar
    segments = bars.errorbar.lines[2][0].get_segments()
    assert [tuple(point[1] for point in s) for s in segments] == [(1.0, 4.0)]
    centred = chart_kit.spread(10.0, 20.0)  # only the width recorded: 20% of 10, centred
    assert (centred.low, centred.high) == (9.0, 11.0)
    slow_round = chart_kit.rate(100.0, median=1.0, low=0.5, high=2.0)
    assert (slow_round.low, slow_round.high) == (50.0, 200.0)
    plt.close(fig)


# ---- progress bars ----------------------------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bars_show_on_a_terminal_only(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert progress.progress(range(3), "rounds").disable
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    bar = progress.progress(range(3), "rounds")
    assert not bar.disable and list(bar) == [0, 1, 2]
    assert "rounds" in terminal.getvalue()


def test_context_parallel_passes_its_mode_and_packing_to_the_ring_benchmark(gpu_machine, monkeypatch, tmp_path):
    from cudnn_attn.bench import context_parallel

    seen = []

    def ring(options):  # the ring benchmark's own entry point: its options, and the report it writes
        seen.append(options)
        Path(options[options.index("--json") + 1]).write_text(json.dumps({"world": 2, "cells": {}}))
        return 0

    monkeypatch.setattr(context_parallel, "main", ring)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    argv = [
        "bench",
        "--context-parallel",
        "2",
        "--cp-mode",
        "all_gather",
        "--packed",
        "--json",
        str(tmp_path / "r.json"),
    ]
    assert commands.main(argv) == 0
    (options,) = seen
    assert options[options.index("--mode") + 1] == "all_gather" and "--packed" in options
    assert commands.main(["bench", "--context-parallel", "2", "--json", str(tmp_path / "r.json")]) == 0
    assert seen[1][seen[1].index("--mode") + 1] == "p2p" and "--packed" not in seen[1]
