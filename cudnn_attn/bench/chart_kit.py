"""Bars with their spreads: the two chart forms every bench section uses.

A value is drawn as its median with an error bar from the lowest to the highest round. A report
that records only the spread's width (``spread_pct``: (high - low) / median) gets a bar of that
width centred on the median: the width is measured, the centring is not.

Example::

    fig, ax = plt.subplots()
    grouped(ax, ["S 1k", "S 4k"], {"ours": [Bar(1.0, 0.9, 1.1), None], "torch": [...]}, "ms")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any

WIDTH = 0.8  # of each group's slot, shared by its bars


@dataclass(frozen=True)
class Bar:
    """A median and the range of the rounds around it."""

    value: float
    low: float
    high: float

    def __post_init__(self) -> None:
        # A report's values arrive unchecked: matplotlib draws strings as categories and fails on null.
        for name in ("value", "low", "high"):
            number = getattr(self, name)
            if isinstance(number, bool) or not isinstance(number, Real):
                raise TypeError(f"{name} {number!r} is not a number")


def spread(value: float, spread_pct: float | None) -> Bar:
    """``value`` with ``spread_pct`` percent of it as its range, centred (see the module's note)."""
    half = value * (spread_pct or 0.0) / 200.0
    return Bar(value, value - half, value + half)


def ranged(median: float, low: float, high: float, scale: float = 1.0) -> Bar:
    """A median and its lowest and highest rounds, times ``scale``."""
    return Bar(median * scale, low * scale, high * scale)


def rate(value: float, median: float, low: float, high: float) -> Bar:
    """A rate (TFLOP/s, GB/s) measured over a time with this median, low and high: the slowest round
    gives the lowest rate."""
    return Bar(value, value * median / high, value * median / low)


def grouped(
    ax: Any,
    groups: Sequence[str],
    series: Mapping[str, Sequence[Bar | None]],
    label: str,
    *,
    log: bool = False,
) -> None:
    """One group of bars per entry of ``groups``, one bar per series in each (None: not measured)."""
    width = WIDTH / max(len(series), 1)
    for i, (name, bars) in enumerate(series.items()):
        xs = [x + (i - (len(series) - 1) / 2) * width for x, bar in enumerate(bars) if bar is not None]
        shown = [bar for bar in bars if bar is not None]
        ax.bar(xs, [b.value for b in shown], width, label=name, yerr=_errors(shown), capsize=2, error_kw={"lw": 0.8})
    ax.set_xticks(range(len(groups)), groups, rotation=20 if len(groups) > 4 else 0, ha="right", fontsize=7)
    ax.set_ylabel(label, fontsize=8)
    if log:
        _log(ax.yaxis, ax.set_yscale)
    ax.legend(fontsize=6, ncol=2 if len(series) > 3 else 1)
    ax.grid(axis="y", alpha=0.3)


def horizontal(ax: Any, bars: Mapping[str, Bar | None], label: str, *, log: bool = False) -> None:
    """One horizontal bar per entry, first at the top (for columns measured on one shape)."""
    shown = {name: bar for name, bar in bars.items() if bar is not None}
    names = list(shown)[::-1]
    values = [shown[n] for n in names]
    colors = [f"C{list(shown).index(n) % 10}" for n in names]
    ax.barh(names, [b.value for b in values], 0.6, color=colors, xerr=_errors(values), capsize=2, error_kw={"lw": 0.8})
    ax.tick_params(axis="y", labelsize=7)
    ax.set_xlabel(label, fontsize=8)
    if log:
        _log(ax.xaxis, ax.set_xscale)
    ax.grid(axis="x", alpha=0.3)


def _log(axis: Any, set_scale: Any) -> None:
    """A log scale labelled in plain numbers (1, 10, 100), minor ticks unlabelled (they collide)."""
    from matplotlib import ticker

    set_scale("log")
    axis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(ticker.NullFormatter())


def _errors(bars: Sequence[Bar]) -> list[list[float]] | None:
    """matplotlib's asymmetric error form: distances below and above each value; None where no bar
    has a range (single measurements: no error bar at all, rather than a flat one)."""
    if all(b.low == b.value == b.high for b in bars):
        return None
    return [[max(b.value - b.low, 0.0) for b in bars], [max(b.high - b.value, 0.0) for b in bars]]
