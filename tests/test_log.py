"""The debug switch: ``CUDNN_ATTN_LOG_LEVEL=info`` (the ``cudnn_attn`` logger) says, once per plan
a graph obtains, the problem, the backend, where the plan came from, the engine and seconds;
runs log nothing; ``cudnn-attn info`` shows the level and the plan store."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import randn

import cudnn_attn
import cudnn_attn.cache as cache_module
from cudnn_attn import log
from cudnn_attn.cli import commands as cli

LOGGER = "cudnn_attn"


def plan_records(caplog):
    return [r for r in caplog.records if r.name == LOGGER and hasattr(r, "plan_source")]


def qkv(s=16, seed=0, dtype=torch.float16, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return tuple(randn(2, 4, s, 32, dtype=dtype, generator=gen, device=device) for _ in range(3))


def check_line(record, problem, backend, source, engine):
    """The record's text names all five, in the documented form, and its fields agree."""
    text = record.getMessage()
    assert text.startswith(f"plan {problem.describe()}: backend={backend} source={source} engine={engine} "), text
    assert text.endswith("s") and 0 <= float(text.rsplit(" ", 1)[1][:-1]) < 600
    assert (record.plan_backend, record.plan_source, record.plan_engine) == (backend, source, engine)
    assert record.levelno == logging.INFO


def test_one_line_per_plan_obtained_built_then_memory(caplog, cache):
    q, k, v = qkv()
    short = qkv(s=8)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        with cudnn_attn.Graph(cache=cache) as g:
            g.sdpa(q, k, v)  # built
            g.sdpa(q, k, v)  # the same problem: the plan the first node built, from memory
            g.sdpa(*short)  # built
    records = plan_records(caplog)
    assert len(records) == 3
    first, again, other = g.problems
    assert first == again != other
    check_line(records[0], first, "reference", "built", "reference")
    check_line(records[1], first, "reference", "memory", "reference")
    check_line(records[2], other, "reference", "built", "reference")


def test_runs_and_repeated_recordings_log_nothing_at_info(caplog, cache):
    q, k, v = qkv(seed=1)
    with cudnn_attn.Graph(cache=cache) as g:
        g.sdpa(q, k, v, use_causal_mask=True)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(3):
            g(q, k, v)  # steady-state runs
            with cudnn_attn.Graph(cache=cache) as again:  # a recording that repeats the first: adopted
                again.sdpa(q, k, v, use_causal_mask=True)
            again(q, k, v)
    assert [r for r in caplog.records if r.name.startswith(LOGGER)] == []
    assert cache.stats()["builds"] == 1 and cache.stats()["hits"] == 3
    with caplog.at_level(logging.DEBUG, logger=LOGGER):  # debug shows the adopted plans too
        with cudnn_attn.Graph(cache=cache) as again:
            again.sdpa(q, k, v, use_causal_mask=True)
    (record,) = [r for r in caplog.records if r.name.startswith(LOGGER)]
    assert record.levelno == logging.DEBUG
    assert (
        record.getMessage()
        == f"plan {g.problems[0].describe()}: backend=reference source=memory (a repeated recording)"
    )


def test_the_functional_form_logs_its_first_call_only(caplog):
    q, k, v = qkv(s=40, seed=2)  # a signature no other test uses
    # On the CPU the functional form's graphs are the reference backend's ("auto" runs plain calls on torch's kernel).
    with caplog.at_level(logging.INFO, logger=LOGGER), cudnn_attn.backend("reference"):
        for _ in range(3):
            cudnn_attn.sdpa(q, k, v, is_causal=True)
    records = plan_records(caplog)
    assert len(records) == 1
    assert records[0].plan_backend == "reference"
    assert records[0].plan_source in ("built", "memory")  # "memory" if another test built this problem already
    assert "s40" in records[0].getMessage() and "causal-top_left" in records[0].getMessage()


def test_the_environment_variable_prints_the_line_to_stderr(tmp_path):
    script = textwrap.dedent(
        """
        import torch, cudnn_attn
        q = torch.randn(1, 2, 8, 16, dtype=torch.float16)
        with cudnn_attn.Graph() as g:
            g.sdpa(q, q, q)
        for _ in range(5):
            g(q)
        """
    )
    env = {**os.environ, "CUDNN_ATTN_CACHE_DIR": str(tmp_path), log.ENV_VAR: "info"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    lines = done.stderr.splitlines()
    assert len(lines) == 1, lines  # one plan, five runs: one line
    prefix = "[cudnn_attn INFO] plan sdpa-BHSD-float16-b1-h2-s8-d16: backend=reference source=built engine=reference "
    assert lines[0].startswith(prefix) and lines[0].endswith("s"), lines


@pytest.mark.parametrize("value", ["", "loud", "²", "debug", "20"])
def test_the_environment_variable_sets_the_level_or_says_it_cannot(monkeypatch, value, capfd):
    """What the import does with each value (run here again, with the logger restored after)."""
    logger = logging.getLogger(LOGGER)
    handlers, level = list(logger.handlers), logger.level
    monkeypatch.setenv(log.ENV_VAR, value)
    try:
        log._configure_from_environment()
        added = [h for h in logger.handlers if h not in handlers]
        configured = logger.level
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)
    err = capfd.readouterr().err
    if value == "":
        assert added == [] and configured == level and err == ""  # off unless asked
        return
    assert len(added) == 1
    if value in ("loud", "²"):
        assert configured == logging.WARNING
        assert f"CUDNN_ATTN_LOG_LEVEL={value!r} is not a logging level; use debug, info, warning or error" in err
    else:
        assert configured == {"debug": logging.DEBUG, "20": logging.INFO}[value] and err == ""


def test_the_default_cache_says_why_its_store_is_off(monkeypatch):
    monkeypatch.setattr(cache_module, "_default", None)
    monkeypatch.setenv("CUDNN_ATTN_CACHE_DIR", "")
    cache = cudnn_attn.default_cache()
    assert cache.store is None
    assert cache.store_unused_reason() == 'CUDNN_ATTN_CACHE_DIR="" turns it off'
    assert cache.store_unused_reason() is None  # said once
    assert "without path=" in cudnn_attn.PlanCache().store_unused_reason()
    assert cudnn_attn.PlanCache(path="/nonexistent/x").store_unused_reason() is None


def test_info_shows_the_log_level_and_the_plan_store(monkeypatch, tmp_path, capsys, caplog):
    logger = logging.getLogger(LOGGER)
    monkeypatch.setenv(log.ENV_VAR, "info")
    monkeypatch.setenv("CUDNN_ATTN_CACHE_DIR", str(tmp_path / "plans"))
    with caplog.at_level(logging.INFO, logger=LOGGER):  # what the variable sets at import
        assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    assert "log_level            INFO (CUDNN_ATTN_LOG_LEVEL=info)" in text.splitlines()
    assert f"plan_store           {tmp_path / 'plans'}" in text.splitlines()
    monkeypatch.delenv(log.ENV_VAR, raising=False)
    monkeypatch.setenv("CUDNN_ATTN_CACHE_DIR", "")
    assert cli.main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    expected_level = logging.getLevelName(logger.getEffectiveLevel())  # the root's, as logging decides
    assert report["log_level"] == f"{expected_level} (set CUDNN_ATTN_LOG_LEVEL=info to log every plan)"
    assert report["plan_store"] == 'off (CUDNN_ATTN_CACHE_DIR="")'


# ---- on a GPU: disk, tuned, and why the store was not used ----------------------------------------


@pytest.mark.gpu
def test_gpu_lines_say_built_disk_and_tuned_with_the_engine(caplog, tmp_path):
    q, k, v = qkv(s=256, seed=3, dtype=torch.bfloat16, device="cuda")
    sources = []
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for autotune in (False, False, True, True):
            cache = cudnn_attn.PlanCache(path=tmp_path)  # a new process's cache, the same store
            with cudnn_attn.Graph(cache=cache, autotune=autotune) as g:
                g.sdpa(q, k, v, use_causal_mask=True)
            (record,) = plan_records(caplog)
            caplog.clear()
            plan = g.nodes[0].plan
            check_line(record, g.problems[0], "cudnn", record.plan_source, plan.engine)
            assert plan.engine and plan.engine != "cudnn"
            sources.append(record.plan_source)
    assert sources == ["built", "disk", "tuned", "disk"]


@pytest.mark.gpu
def test_gpu_the_store_not_used_is_said_once_with_the_reason(caplog, tmp_path):
    cache = cudnn_attn.PlanCache()  # no path: nothing stored
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for s in (128, 256):
            with cudnn_attn.Graph(cache=cache) as g:
                g.sdpa(*qkv(s=s, dtype=torch.bfloat16, device="cuda"))
    unused = [r.getMessage() for r in caplog.records if "plan store not used" in r.getMessage()]
    assert unused == ["plan store not used: this PlanCache was made without path="]
    assert len(plan_records(caplog)) == 2
    caplog.clear()
    # A damaged stored plan: the store warns, the plan is built (one line) and rewritten.
    q, k, v = qkv(s=128, seed=4, dtype=torch.bfloat16, device="cuda")
    with cudnn_attn.Graph(cache=cudnn_attn.PlanCache(path=tmp_path)) as g:
        g.sdpa(q, k, v)
    (file,) = tmp_path.glob("*.plan")
    file.write_bytes(file.read_bytes()[:-10])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        with cudnn_attn.Graph(cache=cudnn_attn.PlanCache(path=tmp_path)) as g:
            g.sdpa(q, k, v)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("truncated, corrupted" in w for w in warnings), warnings
    (record,) = plan_records(caplog)
    assert record.plan_source == "built"


def test_a_superscript_digit_is_reported_as_a_bad_value_not_an_import_failure(tmp_path):
    """A superscript two is a digit to str.isdigit that int() refuses: the import failed with ValueError."""
    env = {**os.environ, log.ENV_VAR: "²"}
    done = subprocess.run(
        [sys.executable, "-c", "import cudnn_attn.log as log; print(log.logger.level)"],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(logging.WARNING)
    assert done.stderr.count("is not a logging level") == 1, done.stderr
