"""``bench --serving``'s CPU-checkable parts: the SM clock read beside each timed sample, the
summary of a column's samples, and the table's text with and without a clock."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cudnn_attn.bench import serving

COMMITTED = Path(__file__).resolve().parents[1] / "docs" / "bench" / "serving_h100.json"


def _column(**clock) -> dict:
    return {
        "us_per_layer": 7.2,
        "spread_pct": 4.6,
        "tbps": 1.25,
        "pct_of_peak": 29.4,
        "pct_of_small_rate": 57.6,
        "rel_err": 2.2e-3,
        **clock,
    }


def _row(columns: dict[str, dict], **extra) -> dict:
    return {
        "batch": 1,
        "kv": 2048,
        "s_q": 1,
        "page": 64,
        "layers": 19,
        "schedule": "Schedule(splits=16)",
        "copy_tbps": 1.58,
        "read_tbps": 0.57,
        "peak_copy_tbps": 4.21,
        "peak_read_tbps": 4.38,
        "columns": columns,
        **extra,
    }


# ---- the clock and the summary of samples --------------------------------------------------------------


def test_the_clock_is_read_from_the_device_asked_for(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda device: asked.append(device) or 1980)
    assert serving.sm_clock_mhz(3) == 1980.0
    assert asked == [3]


@pytest.mark.parametrize("error", [ModuleNotFoundError("no NVML"), RuntimeError("driver"), OSError("gone")])
def test_a_clock_that_cannot_be_read_is_none_never_a_failure(monkeypatch, error):
    def unreadable(device):
        raise error

    monkeypatch.setattr(torch.cuda, "clock_rate", unreadable)
    assert serving.sm_clock_mhz(0) is None


def test_summary_gives_median_and_range_of_times_and_clocks():
    got = serving.summary([9.0, 7.0, 8.0, 10.0, 7.5], [1215.0, 1980.0, 1470.0, 1215.0, 1980.0])
    assert got == {
        "us": 8.0,
        "low": 7.0,
        "high": 10.0,
        "clock_mhz": 1470.0,
        "clock_low": 1215.0,
        "clock_high": 1980.0,
    }


def test_summary_reads_the_clock_from_the_samples_that_have_one():
    got = serving.summary([1.0, 2.0, 3.0], [None, 1500.0, 1700.0])
    assert (got["clock_mhz"], got["clock_low"], got["clock_high"]) == (1600.0, 1500.0, 1700.0)
    assert (got["us"], got["low"], got["high"]) == (2.0, 1.0, 3.0)


def test_summary_without_any_clock_gives_none_beside_the_times():
    got = serving.summary([1.0, 2.0, 3.0], [None, None, None])
    assert got == {"us": 2.0, "low": 1.0, "high": 3.0, "clock_mhz": None, "clock_low": None, "clock_high": None}
    json.dumps(got)  # a report's row stays JSON: None is written as null


# ---- the table ------------------------------------------------------------------------------------------


def test_each_column_shows_the_clock_beside_its_time_and_its_range():
    clock = {"clock_mhz": 1980.0, "clock_low": 1950.0, "clock_high": 1980.0}
    text = serving.format_serving([_row({"PagedAttention": _column(**clock)})])
    line = next(line for line in text.splitlines() if line.strip().startswith("PagedAttention"))
    assert "      7.2 us @ 1980 MHz   1.25 TB/s" in line
    assert "(spread 5%, clock 1950-1980 MHz, rel err 2.2e-03)" in line
    assert "SM clock (MHz)" in text.splitlines()[0]


def test_a_clock_that_held_still_is_shown_as_one_figure():
    clock = {"clock_mhz": 1215.0, "clock_low": 1215.0, "clock_high": 1215.0}
    text = serving.format_serving([_row({"PagedAttention": _column(**clock)})])
    assert "7.2 us @ 1215 MHz" in text
    assert "(spread 5%, clock 1215 MHz, rel err" in text


@pytest.mark.parametrize(
    "clock", [{}, {"clock_mhz": None, "clock_low": None, "clock_high": None}], ids=["recorded before", "unread"]
)
def test_a_column_without_a_clock_shows_a_question_mark_in_the_same_place(clock):
    with_clock = _column(clock_mhz=1980.0, clock_low=1980.0, clock_high=1980.0)
    text = serving.format_serving([_row({"PagedAttention": with_clock, "torch sdpa, contiguous KV": _column(**clock)})])
    read, unread = [line for line in text.splitlines() if line.startswith("    ")]
    assert "7.2 us @    ? MHz   1.25 TB/s" in unread
    assert "(spread 5%, rel err 2.2e-03)" in unread and "clock" not in unread
    assert read.index("TB/s") == unread.index("TB/s")  # the columns stay aligned


def test_the_row_line_gives_the_clock_range_of_its_transfers():
    transfers = {
        "device copy (1 GiB)": {"clock_mhz": 1470.0, "clock_low": 1410.0, "clock_high": 1500.0},
        "read-only stream (4 GiB)": {"clock_mhz": 1980.0, "clock_low": 1965.0, "clock_high": 1980.0},
        "device copy (K+V bytes)": {"clock_mhz": None, "clock_low": None, "clock_high": None},
    }
    text = serving.format_serving([_row({}, transfer_clocks=transfers)])
    assert "read 0.57 TB/s, clock 1410-1980 MHz; Schedule(splits=16))" in text.splitlines()[1]
    unread = {name: {"clock_mhz": None, "clock_low": None, "clock_high": None} for name in transfers}
    for row in (_row({}), _row({}, transfer_clocks=unread)):
        assert "read 0.57 TB/s; Schedule(splits=16))" in serving.format_serving([row]).splitlines()[1]


def test_a_committed_report_without_clocks_still_formats():
    rows = json.loads(COMMITTED.read_text())["serving"]
    text = serving.format_serving(rows)
    assert text.count("@    ? MHz") == sum(len(row["columns"]) for row in rows)
    assert "clock" not in text.split("\n", 1)[1]
