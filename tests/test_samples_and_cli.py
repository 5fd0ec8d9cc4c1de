"""The samples and the command line run end to end."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

from cudnn_attn import cli

SAMPLES = sorted((Path(__file__).parent.parent / "samples").glob("*.py"))


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.stem for s in SAMPLES])
def test_sample_runs_and_checks_its_results(sample, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(sample)])
    runpy.run_path(str(sample), run_name="__main__")
    assert "all results match" in capsys.readouterr().out


def test_info_reports_versions_and_features(capsys):
    assert cli.main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cudnn_attn"] and report["torch"]
    assert set(report["features"]) >= {"causal", "paged KV cache", "backward"}
    if report["backend"] == "reference":
        assert all(status == "yes" for status in report["features"].values())
