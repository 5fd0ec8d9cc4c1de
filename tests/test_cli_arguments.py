"""The command line's arguments are checked before any work: a file that cannot be written
(``--json``, ``--plot``) and a number out of range are usage errors (exit 2, one line), found
before a GPU is looked for and before anything is measured."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import cudnn_attn
from cudnn_attn.bench import shapes
from cudnn_attn.cli import bench_command, commands, versions

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parent.parent
GRID = str(ROOT / "docs" / "bench" / "grid_h100.json")


def one_line_usage_error(argv: list[str], capsys) -> str:
    assert commands.main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def gpu_machine(monkeypatch):
    """A machine that claims a GPU and cuDNN, where measuring fails the test: what is refused
    here is refused before anything runs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(versions, "cudnn_missing", lambda: None)
    monkeypatch.setattr(bench_command, "_measure", lambda args: pytest.fail("measured before the usage error"))


def test_plot_targets_are_checked_before_anything_is_measured(gpu_machine, tmp_path, capsys):
    """These ended in a traceback from savefig (FileNotFoundError, ValueError) after the
    measurements, or wrote ``DIR.png`` beside a directory given as ``--plot DIR``."""
    cases = {
        str(tmp_path / "missing" / "x.png"): "no directory",
        str(tmp_path / "x.txt"): "'.txt' is no image format matplotlib writes",
        str(tmp_path): "a directory; give a file to write",
        str(tmp_path / "chart"): "no file extension",
    }
    for target, message in cases.items():
        for argv in (["bench", "--serving", "--plot", target], ["bench", "--plot-from", GRID, "--plot", target]):
            err = one_line_usage_error(argv, capsys)
            assert err.startswith(f"cudnn-attn bench: --plot {target}: ") and message in err, err
    assert not list(tmp_path.iterdir()) and not Path(f"{tmp_path}.png").exists()
    assert commands.main(["bench", "--plot-from", GRID, "--plot", str(tmp_path / "grid.svg")]) == 0  # another format
    assert (tmp_path / "grid.svg").read_text().lstrip().startswith("<?xml")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_json_into_a_path_that_cannot_be_opened_is_a_usage_error(tmp_path, capsys):
    """/proc takes no new file, but os.access says it is writable to root: the report was a
    FileNotFoundError traceback."""
    err = one_line_usage_error(["info", "--json", "/proc/cudnn_attn_report.json"], capsys)
    assert err.startswith("cudnn-attn info: --json /proc/cudnn_attn_report.json: cannot be written"), err
    # The check opens the file as the write will: an existing report is left as it is, and a
    # file it made is removed when the command stops at a later usage error.
    kept = tmp_path / "kept.json"
    kept.write_text('{"rows": []}\n')
    for target in (kept, tmp_path / "new.json"):
        one_line_usage_error(["bench", "-b", "-1", "--json", str(target)], capsys)
    assert kept.read_text() == '{"rows": []}\n' and not (tmp_path / "new.json").exists()


BAD_NUMBERS = {
    "-b -1": "-b/--batch: -1; must be >= 1",
    "-d 0": "-d/--head-dim: 0; must be >= 1",
    "-s 0": "-s/--seq: 0; must be >= 1",
    "-h 0": "-h/--heads: 0; must be >= 1",
    "--kv-heads 3 -h 16": "--kv-heads: 3 does not divide -h/--heads=16",
    "--kv-heads -2": "--kv-heads: -2; must be >= 1 (or 0: as h)",
    "b=0,h=2,s=16,d=64": "shape 'b=0,h=2,s=16,d=64': b: 0; must be >= 1",
    "b=1,h=8,hkv=3,s=16,d=64": "shape 'b=1,h=8,hkv=3,s=16,d=64': hkv: 3 does not divide h=8",
    "b=1,s=0,d=64": "shape 'b=1,s=0,d=64': s: 0; must be >= 1",
    "--context-parallel -1": "--context-parallel: -1; give the number of GPUs to shard over (>= 1)",
    "--context-parallel 3 -s 4096": "-s/--seq: 4096; --context-parallel 3 needs a multiple of 6",
}


@pytest.mark.parametrize("flags", list(BAD_NUMBERS))
def test_bad_bench_numbers_are_usage_errors_before_the_gpu_check(flags, monkeypatch, capsys):
    """These were reported as "needs a CUDA GPU" (exit 1); on a GPU they reached torch's
    "negative dimension" RuntimeError or a kernel's refusal."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["bench", *flags.split()] if flags.startswith("-") else ["bench", flags]
    assert one_line_usage_error(argv, capsys) == f"cudnn-attn bench: {BAD_NUMBERS[flags]}\n"


def test_cache_warm_checks_its_shapes_before_the_gpu_check(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = one_line_usage_error(["cache", "warm", "b=-1,h=2,s=16,d=64"], capsys)
    assert err == "cudnn-attn cache warm: shape 'b=-1,h=2,s=16,d=64': b: -1; must be >= 1\n"
    with pytest.raises(cudnn_attn.ValidationError, match="d: -4; must be >= 1"):  # never torch's RuntimeError
        shapes.parse("b=1,h=2,s=16,d=-4").tensors("cpu")


@pytest.mark.parametrize(
    "flags", ["-b 1 -h 8 --kv-heads 2 -s 16 -d 64", "b=1,h=4,hkv=1,sq=1,skv=64,d=64", "--context-parallel 2"]
)
def test_good_bench_numbers_still_reach_the_gpu_check(flags, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["bench", *flags.split()] if flags.startswith("-") else ["bench", flags]
    assert commands.main(argv) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("shape", ["b=0", "foo=1"])
def test_shapes_beside_grid_are_checked_before_the_gpu_check(shape, monkeypatch, capsys):
    """With --grid the shapes were ignored unchecked: "needs a CUDA GPU" (exit 1)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = one_line_usage_error(["bench", "--grid", shape], capsys)
    assert err.startswith(f"cudnn-attn bench: shape '{shape}': "), err


def test_good_shapes_beside_grid_are_refused_not_dropped(gpu_machine, capsys):
    err = one_line_usage_error(["bench", "--grid", "b=1,h=2,s=64,d=64"], capsys)
    assert "--grid runs the standard grid of shapes; drop the shapes" in err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [["info"], ["cache", "ls"]])
def test_json_that_fails_as_it_is_written_is_one_line(argv, monkeypatch, tmp_path, capsys):
    """/dev/full opens, and fails at the write: it was an OSError traceback."""
    monkeypatch.setenv("CUDNN_ATTN_CACHE_DIR", str(tmp_path / "plans"))
    import cudnn_attn.cache as cache_module

    monkeypatch.setattr(cache_module, "_default", None)
    err = one_line_usage_error([*argv, "--json", "/dev/full"], capsys)
    assert err == f"cudnn-attn {' '.join(argv)}: --json /dev/full: cannot be written (No space left on device)\n"


@pytest.mark.parametrize(
    "argv,dropped",
    [
        (["--grid", "-b", "2"], "--batch"),
        (["--grid", "-s", "1024", "-d", "64"], "--seq, --head-dim"),
        (["b=1,h=2,s=64,d=64", "--causal"], "--causal"),
        (["b=1,h=2,s=64,d=64", "--dtype", "fp16", "--bwd"], "--dtype, --bwd"),
    ],
)
def test_shape_flags_beside_grid_or_shapes_are_refused_not_dropped(argv, dropped, gpu_machine, capsys):
    """The number and kind flags describe the one shape run when no shape is named: beside
    --grid or shapes they were silently ignored."""
    err = one_line_usage_error(["bench", *argv], capsys)
    assert f"drop {dropped} (or write them into a shape)" in err, err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_plot_that_fails_as_it_is_written_is_one_line(tmp_path, capsys):
    """An image path that opens and fails at the write (a .png name linked to /dev/full): it was
    an OSError traceback after the whole run."""
    pytest.importorskip("matplotlib")
    target = tmp_path / "full.png"
    target.symlink_to("/dev/full")
    report = str(ROOT / "docs/bench/serving_h200.json")
    err = one_line_usage_error(["bench", "--plot-from", report, "--plot", str(target)], capsys)
    assert err == f"cudnn-attn bench: --plot {target}: cannot be written (No space left on device)\n"
