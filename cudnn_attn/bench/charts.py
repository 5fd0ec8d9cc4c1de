"""``bench --plot``: a chart for every section a report holds, one panel per table.

A report is what ``bench --json`` writes. Each section claims the report keys it draws; a key no
section claims raises ``NoChartError`` naming it (a chart is never silently incomplete), and so does a
report with nothing to draw (never an empty chart). Spreads are error bars (``chart_kit``).

Example::

    report = json.load(open("docs/bench/serving_h100.json"))
    draw(report, "serving_h100.png")  # decode per layer, and chunked prefill
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .chart_kit import Bar, grouped, horizontal, ranged, rate, spread

Panel = tuple[str, Callable[[Any], None]]  # a title, and what draws it on an Axes


class NoChartError(ValueError):
    """A report, or a section of one, that ``bench --plot`` has no chart for."""


@dataclass(frozen=True)
class Section:
    """A bench section: the report keys it reads (a trailing ``*``: any key with that prefix)
    and its panels. ``when``: whether a report is this section's (two share the key ``rows``)."""

    name: str
    keys: tuple[str, ...]
    panels: Callable[[dict[str, Any]], list[Panel]]
    when: Callable[[dict[str, Any]], bool] = lambda report: True

    def claims(self, key: str, report: dict[str, Any]) -> bool:
        return self.when(report) and any(key == k or (k.endswith("*") and key.startswith(k[:-1])) for k in self.keys)


def _grouped(groups: list[str], series: Mapping[str, Sequence[Bar | None]], label: str, log: bool = False) -> Any:
    """What draws ``chart_kit.grouped`` on an Axes, with these arguments bound now."""
    return lambda ax: grouped(ax, groups, series, label, log=log)


def _horizontal(bars: Mapping[str, Bar | None], label: str, log: bool = False) -> Any:
    return lambda ax: horizontal(ax, bars, label, log=log)


def _union(dicts: list[dict[str, Any]]) -> list[str]:
    """Every key of ``dicts``, in order of first appearance (columns differ between rows)."""
    return list(dict.fromkeys(k for d in dicts for k in d))


def _spread(cell: dict[str, Any] | None, key: str) -> Bar | None:
    """``cell[key]`` with the cell's spread; None for a column not measured (absent, or an error)."""
    if not cell or cell.get(key) is None:
        return None
    return spread(cell[key], cell.get("spread_pct"))


def _us(cell: dict[str, Any], scale: float = 1.0) -> Bar:
    return ranged(cell["median_us"], cell["low_us"], cell["high_us"], scale)


def _attention(r: dict[str, Any]) -> list[Panel]:
    rows = r["rows"]
    cols = [row["columns"] for row in rows]
    series = {n: [_spread(c.get(n), "tflops") for c in cols] for n in _union(cols)}
    shapes = [row["shape"] for row in rows]
    return [("attention: TFLOP/s by shape", _grouped(shapes, series, "TFLOP/s"))]


def _overhead(r: dict[str, Any]) -> list[Panel]:
    panels: list[Panel] = []
    if r.get("host_time"):
        host = {name: _us(cell) for name, cell in r["host_time"].items()}
        panels.append(("--overhead: host time per call", _horizontal(host, "us per call", log=True)))
    steps = {k.removeprefix("layer_step_").replace("_", " ").upper(): v for k, v in r.items() if k.startswith("layer_")}
    if steps:
        series = {n: [_us(s[n]) if n in s else None for s in steps.values()] for n in _union(list(steps.values()))}
        title = "--overhead: nn.Attention training step"
        panels.append((title, _grouped(list(steps), series, "us per step")))
    return panels


def _stack(r: dict[str, Any]) -> list[Panel]:
    shapes = r["stack"]["shapes"]
    timings = [s["timings"] for s in shapes.values()]
    series = {n: [_us(t[n], 1e-3) if n in t else None for t in timings] for n in _union(timings)}
    return [("--stack: 4-layer decoder training step", _grouped(list(shapes), series, "ms per step"))]


def _paged_decode(r: dict[str, Any]) -> list[Panel]:
    columns = r["paged_decode"]["columns"]
    bars = {n: rate(c["gbps"], c["median_us"], c["low_us"], c["high_us"]) for n, c in columns.items()}
    return [("--paged-decode: bandwidth", _horizontal(bars, "GB/s"))]


def _naive(r: dict[str, Any]) -> list[Panel]:
    seqs = r["naive"]["seqs"]
    timings = [s["timings"] for s in seqs.values()]
    series = {n: [_us(t[n]) if n in t else None for t in timings] for n in _union(timings)}
    groups = [f"S {s}" for s in seqs]
    return [("--naive: fused vs naive attention", _grouped(groups, series, "us per call", log=True))]


def _cold_start(r: dict[str, Any]) -> list[Panel]:
    c = r["cold_start"]  # one cold run and the best of two warm ones: no spread to show
    bars = {
        "empty plan store": Bar(c["cold_s"], c["cold_s"], c["cold_s"]),
        "filled plan store": Bar(c["warm_store_s"], c["warm_store_s"], c["warm_store_s"]),
    }
    return [("--cold-start: time to first result", _horizontal(bars, "seconds", log=True))]


def _fp8(r: dict[str, Any]) -> list[Panel]:
    panels: list[Panel] = []
    rows = r.get("fp8") or []
    shapes = [row["shape"] for row in rows]
    for kind in ("forward", "backward"):
        cells = [row.get(kind, {}) for row in rows]
        series = {n: [_spread(c.get(n), "tflops") for c in cells] for n in _union(cells)}
        if series:
            panels.append((f"--dtype fp8: {kind}", _grouped(shapes, series, "TFLOP/s")))
    if r.get("crossover"):
        xs = r["crossover"]
        groups = [f"S {x['s']} B{x['batch']}" + (" causal" if x["causal"] else "") for x in xs]
        cells = [x["cells"] for x in xs]
        speed = {n: [_spread(c.get(n), "vs_bf16") for c in cells] for n in _union(cells)}
        panels.append(("--dtype fp8: speed vs torch's bf16", _grouped(groups, speed, "x bf16")))
    if r.get("accuracy"):
        kinds = r["accuracy"]
        errors = {t: [Bar(v[t], v[t], v[t]) for v in kinds.values()] for t in _union(list(kinds.values()))}
        title = "--dtype fp8: relative error vs bf16"
        panels.append((title, _grouped(list(kinds), errors, "relative error", log=True)))
    return panels


def _serving(r: dict[str, Any]) -> list[Panel]:
    panels: list[Panel] = []
    if r.get("serving"):
        rows = r["serving"]
        groups = [f"B{x['batch']} KV{_k(x['kv'])} Sq{x['s_q']}" for x in rows]
        cols = [x["columns"] for x in rows]
        series = {n: [_spread(c.get(n), "us_per_layer") for c in cols] for n in _union(cols)}
        pages = sorted({x.get("page", 64) for x in rows})  # reports before the page was recorded: 64
        title = f"--serving: paged decode per layer (CUDA-graph replay, page {', '.join(map(str, pages))})"
        panels.append((title, _grouped(groups, series, "us per layer", log=True)))
    if r.get("prefill"):
        cells = r["prefill"]["columns"]
        bars = {n: _spread(c, "tflops") for n, c in cells.items()}
        panels.append(("--serving: chunked prefill", _horizontal(bars, "effective TFLOP/s")))
    return panels


def _varlen(r: dict[str, Any]) -> list[Panel]:
    panels: list[Panel] = []
    if r.get("mixed"):
        mixed = r["mixed"]
        bars = {n: _spread(c, "ms") for n, c in mixed["cells"].items()}
        plans = r.get("plans") or {}
        built = f"; {plans['plans_built']} plans for {plans['packings']} packings" if plans else ""
        title = f"--varlen: mixed-length batch, {mixed['tokens']} tokens, fwd+bwd{built}"
        panels.append((title, _horizontal(bars, "ms per step")))
    if r.get("llama"):
        llama = r["llama"]
        rates = {n: _spread(c, "tokens_per_s") for n, c in llama["cells"].items()}
        title = f"--varlen: Llama training step, {llama['documents']} documents"
        panels.append((title, _horizontal(rates, "tokens per second")))
    return panels


def _models(r: dict[str, Any]) -> list[Panel]:
    rows = r["models"]
    groups = [f"{row['model']} {_k(row['seq'])}" for row in rows]
    panels: list[Panel] = []
    for part in ("fwd", "bwd"):
        cols = [row["columns"] for row in rows]
        series = {n: [_spread(c.get(n, {}).get(part), "tflops") for c in cols] for n in _union(cols)}
        panels.append((f"--models: {part}", _grouped(groups, series, "TFLOP/s")))
    return panels


def _score_terms(r: dict[str, Any]) -> list[Panel]:
    rows = r["score_terms"]
    groups = [f"{row['case']} {row['shape']}" for row in rows]
    panels: list[Panel] = []
    for part in ("fwd", "fwd+bwd"):
        series = {
            label: [_spread(row["columns"][name][part], "ms") for row in rows]
            for name, label in (("term", "with the term"), ("plain", "without"))
        }
        panels.append((f"--score-terms: {part}", _grouped(groups, series, "ms per call", log=True)))
    return panels


def _batching(r: dict[str, Any]) -> list[Panel]:
    served = r["batching"]
    bars = {n: ranged(c["tokens_per_s"], c["low"], c["high"]) for n, c in served["columns"].items()}
    w = served["workload"]
    title = f"--batching: {w['requests']} requests, {w['shortest']}-{w['longest']} prompt tokens, {w['new_tokens']} new"
    return [(title, _horizontal(bars, "tokens per second"))]


def _mla(r: dict[str, Any]) -> list[Panel]:
    rows = r["rows"]
    groups = [f"H{x['heads']} B{x['batch']} KV{_k(x['kv'])}" for x in rows]
    columns = (
        ("picked", "PagedAttention's kernel"),
        ("cudnn", "cuDNN paged decode"),
        ("bound", "split-KV bound: reads, partials, merge (no math)"),
    )
    series = {
        label: [ranged(x[key]["us"], x[key]["low"], x[key]["high"]) if key in x else None for x in rows]
        for key, label in columns
        if any(key in x for x in rows)
    }
    return [("--mla: MLA decode per layer", _grouped(groups, series, "us per layer", log=True))]


def _frontend_rebuild(r: dict[str, Any]) -> list[Panel]:
    bars = {f"through {n}": ranged(r[n]["ms_median"], r[n]["ms_low"], r[n]["ms_high"]) for n in ("cudnn", "cudnn_attn")}
    title = f"--frontend-rebuild: a graph rebuilt every call ({r.get('shape', '')})"
    return [(title, _horizontal(bars, "ms per iteration", log=True))]


def _context_parallel(r: dict[str, Any]) -> list[Panel]:
    bars = {n: ranged(c["median_ms"], c["low_ms"], c["high_ms"]) for n, c in r["cells"].items()}
    title = f"--context-parallel: {r.get('world')} GPUs, S {r.get('seq')}, {r.get('mode')}"
    return [(title, _horizontal(bars, "ms per training step"))]


def _k(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


META = ("device", "note")  # every section's report may carry these
_CONTEXT_PARALLEL_META = (
    "world",
    "seq",
    "batch",
    "heads",
    "head_dim",
    "mode",
    "layout",
    "dtype",
    "rounds",
    "steps",
    "overlap",
    "rel_err_vs_single",
)
SECTIONS = (
    Section("attention", ("rows",), _attention, when=lambda r: "peaks_tbps" not in r),
    Section("overhead", ("host_time", "layer_step_*"), _overhead),
    Section("stack", ("stack",), _stack),
    Section("paged_decode", ("paged_decode",), _paged_decode),
    Section("naive", ("naive",), _naive),
    Section("cold_start", ("cold_start",), _cold_start),
    Section("fp8", ("fp8", "crossover", "accuracy"), _fp8),
    Section("serving", ("serving", "prefill"), _serving),
    Section("varlen", ("memory", "mixed", "plans", "llama"), _varlen),  # memory: a table, no panel
    Section("models", ("models",), _models),
    Section("score_terms", ("score_terms",), _score_terms),
    Section("batching", ("batching",), _batching),
    Section("mla", ("rows", "peaks_tbps"), _mla, when=lambda r: "peaks_tbps" in r),
    Section("frontend_rebuild", ("cudnn", "cudnn_attn", "identical", "speedup", "shape"), _frontend_rebuild),
    Section("context_parallel", ("cells", *_CONTEXT_PARALLEL_META), _context_parallel),
)
CHARTED = frozenset(s.name for s in SECTIONS)


def sections_in(report: dict[str, Any]) -> list[Section]:
    """The sections with figures in ``report``; ``NoChartError`` for a key no section draws."""
    found: list[Section] = []
    for key, value in report.items():
        if key in META or value in (None, [], {}):  # a section not run: nothing to draw, nothing amiss
            continue
        owner = next((s for s in SECTIONS if s.claims(key, report)), None)
        if owner is None:
            raise NoChartError(f"no chart for section {key!r} of this report")
        if owner not in found:
            found.append(owner)
    return found


# What a hand-edited or foreign report raises in a section's panels or while they are drawn (a null
# value, a string where a number goes, a low of 0 a rate divides by).
_MALFORMED = (KeyError, TypeError, AttributeError, ValueError, ArithmeticError)


def panels(report: dict[str, Any]) -> list[Panel]:
    """Every panel ``report`` calls for; ``NoChartError`` when there is none."""
    return [panel for _, panel in _sectioned(report)]


def _sectioned(report: dict[str, Any]) -> list[tuple[Section, Panel]]:
    """Every panel ``report`` calls for, with the section it draws."""
    if not isinstance(report, dict):
        raise NoChartError(f"a report is a JSON object, not {type(report).__name__}")
    drawn = []
    for section in sections_in(report):
        try:
            drawn += [(section, panel) for panel in section.panels(report)]
        except _MALFORMED as error:
            raise _not_laid_out(section, error) from error
    if not drawn:
        raise NoChartError("the report has no figures to draw")
    return drawn


def _not_laid_out(section: Section, error: Exception) -> NoChartError:
    return NoChartError(f"section {section.name!r} is not laid out as bench writes it ({error!r})")


def format_problem(path: str) -> str | None:
    """Why ``savefig`` would not write a chart at ``path`` as named (matplotlib reads the format
    from the extension, refuses one it does not write and appends ``.png`` where there is none),
    or None. Needs matplotlib (the ``plot`` extra)."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    extension = os.path.splitext(path)[1][1:].lower()
    known = ", ".join("." + name for name in formats)
    if not extension:
        return f"no file extension to name the image format; end it in .png (matplotlib writes {known})"
    if extension not in formats:
        return f"'.{extension}' is no image format matplotlib writes ({known}); a PNG chart ends in .png"
    return None


def draw(report: dict[str, Any], path: str, dpi: int = 100) -> None:
    """Every section of ``report`` as one PNG at ``path`` (matplotlib: the ``plot`` extra)."""
    todo = _sectioned(report)  # before matplotlib: a report with no chart fails fast
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    columns = 1 if len(todo) <= 2 else 2
    rows = math.ceil(len(todo) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(7 * columns if columns > 1 else 10, 3.6 * rows), squeeze=False)
    try:
        for ax, (section, (title, paint)) in zip(axes.flat, todo):
            try:  # values are only met here: a null or a string where a number goes
                paint(ax)
            except _MALFORMED as error:
                raise _not_laid_out(section, error) from error
            ax.set_title(title, fontsize=9)
        for ax in list(axes.flat)[len(todo) :]:
            ax.set_visible(False)
        fig.suptitle(f"cudnn-attn bench on {report.get('device', 'an unnamed GPU')}", fontsize=10)
        try:  # some values fail only as the axes are laid out (a log scale with no positive value)
            fig.tight_layout()
            fig.savefig(path, dpi=dpi)
        except _MALFORMED as error:
            raise NoChartError(f"the report is not laid out as bench writes it ({error!r})") from error
    finally:
        plt.close(fig)
