"""``cudnn-attn bench``: cudnn_attn against torch's SDPA backends and the bare frontend, side by side.

For each shape, every column runs on the same fresh random inputs in one process: time
(median of CUDA-event timings after warm-up), TFLOP/s, GB/s, and the relative error against
the reference backend. Also: host time per call on a tiny shape (ours vs the frontend's own
``execute``) and cold start to first result in a fresh process, with and without the
persistent plan store.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from .. import Graph, PlanCache
from ..core import synthetic
from ..ops.cudnn import autotune
from .charts import draw
from .host import round_order
from .progress import progress
from .reports import write_json
from .shapes import Shape

COLUMNS = ("cudnn_attn", "cudnn_attn tuned", "frontend direct", "torch cudnn", "torch flash", "torch efficient")


def _bytes(shape: Shape) -> float:
    item = torch.empty(0, dtype=shape.torch_dtype).element_size()
    q = shape.b * shape.h * shape.sq * shape.d
    kv = shape.b * shape.h_kv * shape.skv * (shape.d + shape.d_v)
    o = shape.b * shape.h * shape.sq * shape.d_v
    moved = q + kv + o if not shape.bwd else 2 * (q + kv) + 3 * o  # backward: reads q,k,v,o,dO; writes dq,dk,dv
    return float(moved * item)


def _graphs(shape: Shape, t: dict, tune: bool) -> tuple[Graph, Graph | None]:
    cache = PlanCache()  # private: each column builds (and tunes) its own plans
    with Graph(autotune=tune, cache=cache) as fwd:
        fwd.sdpa(t["q"], t["k"], t["v"], use_causal_mask=shape.causal, generate_stats=shape.bwd)
    if not shape.bwd:
        return fwd, None
    o, stats = fwd(t["q"], t["k"], t["v"])
    t["o"], t["stats"] = o, stats
    with Graph(autotune=tune, cache=cache) as bwd:
        bwd.sdpa_backward(t["q"], t["k"], t["v"], o, t["grad_o"], stats, use_causal_mask=shape.causal)
    return fwd, bwd


def _ours(shape: Shape, t: dict, tune: bool, plans: dict[str, str] | None = None) -> Callable:
    fwd, bwd = _graphs(shape, t, tune)
    if plans is not None:  # which engine ran, for the report
        plan: Any = (bwd or fwd).nodes[0].plan
        plans["tuned" if tune else "heuristic"] = plan.choice.name
    if bwd is None:
        return lambda: fwd(t["q"], t["k"], t["v"])
    args = (t["q"], t["k"], t["v"], t["o"], t["grad_o"], t["stats"])
    return lambda: bwd(*args)


def _frontend_direct(shape: Shape, t: dict, ordered: bool = False) -> Callable:
    """The plan the library would build, executed through the frontend's ``execute`` directly."""
    fwd, bwd = _graphs(shape, t, False)
    graph = bwd or fwd
    node = graph.nodes[0]
    plan: Any = node.plan
    inputs = {
        role: t[role]
        for role in ("q", "k", "v", "o", "grad_o", "stats")
        if role in t and (role in ("q", "k", "v") or bwd)
    }
    outputs = {role: synthetic.empty(h.spec) for role, h in node.outputs.items() if h.spec is not None}
    pack = plan.variant_pack(inputs, outputs)
    workspace = torch.empty(max(plan.workspace_size, 1), dtype=torch.uint8, device="cuda")
    from ..ops.cudnn.backend import cudnn_handle

    handle = cudnn_handle(torch.cuda.current_device())
    if ordered:  # the frontend's fastest form: buffers in a tuple, uids given once
        buffers, uids = tuple(pack.values()), tuple(pack)
        return lambda: plan.graph.execute(buffers, workspace, handle=handle, tensor_uids=uids)
    return lambda: plan.graph.execute(pack, workspace, handle=handle)


def _torch(shape: Shape, t: dict, backend: Any) -> Callable:
    from torch.nn.attention import sdpa_kernel

    kw: dict[str, Any] = dict(is_causal=shape.causal, enable_gqa=shape.h_kv != shape.h, scale=shape.scale())
    if not shape.bwd:

        def run() -> torch.Tensor:
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(t["q"], t["k"], t["v"], **kw)

        run()  # raises here if this backend cannot run the shape
        return run
    leaves = [t[n].detach().requires_grad_() for n in ("q", "k", "v")]
    with sdpa_kernel(backend):
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, **kw)
    return lambda: torch.autograd.grad(out, leaves, t["grad_o"], retain_graph=True)


def _reference_output(shape: Shape, t: dict) -> torch.Tensor | None:
    """The reference backend's O for this shape's inputs (forward shapes that fit in memory)."""
    if shape.bwd or shape.sq * shape.skv * shape.b * shape.h > 2**31:
        return None
    with Graph(backend="reference", cache=PlanCache()) as g:
        g.sdpa(t["q"], t["k"], t["v"], use_causal_mask=shape.causal)
    return g(t["q"], t["k"], t["v"]).float()


def _relative_error(result: Any, expected: torch.Tensor | None) -> float | None:
    """A column's relative error against the reference; None where there is nothing to compare
    (a backward, or a column that writes into buffers of its own)."""
    actual = result[0] if isinstance(result, tuple) else result
    if expected is None or not isinstance(actual, torch.Tensor):
        return None
    return float((actual.float() - expected).norm() / expected.norm())


def bench_shape(shape: Shape, warmup: int = 5, repeats: int = 15, rounds: int = 30) -> dict[str, Any]:
    t = shape.tensors("cuda")
    device = torch.device("cuda", torch.cuda.current_device())
    row: dict[str, Any] = {"shape": shape.label(), "flops": shape.flops(), "columns": {}, "plans": {}}
    from torch.nn.attention import SDPBackend

    makers: dict[str, Callable[[], Callable]] = {
        "cudnn_attn": lambda: _ours(shape, t, False, row["plans"]),
        "cudnn_attn tuned": lambda: _ours(shape, t, True, row["plans"]),
        "frontend direct": lambda: _frontend_direct(shape, t),
        "torch cudnn": lambda: _torch(shape, t, SDPBackend.CUDNN_ATTENTION),
        "torch flash": lambda: _torch(shape, t, SDPBackend.FLASH_ATTENTION),
        "torch efficient": lambda: _torch(shape, t, SDPBackend.EFFICIENT_ATTENTION),
    }
    runs: dict[str, Callable] = {}
    for name, make in makers.items():
        try:
            runs[name] = make()
        except Exception as failure:  # a backend that cannot run this shape: reported, not fatal
            text = str(failure).strip()
            row["columns"][name] = {"error": text.splitlines()[0][:120] if text else type(failure).__name__}
    # Columns are timed in interleaved rounds and report the median of their round medians, so clock and
    # thermal drift during the run favour no column.
    medians: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    # Columns in a fresh order each round: none always follows a light one.
    for round_ in progress(range(rounds), shape.label()):
        for name in round_order(names, round_):
            medians[name].append(autotune.time_plan(runs[name], device, warmup, repeats))
    expected = _reference_output(shape, t)
    for name, run in runs.items():
        ms = statistics.median(medians[name])
        error = _relative_error(run(), expected)
        row["columns"][name] = {
            "ms": ms,
            "tflops": shape.flops() / (ms * 1e-3) / 1e12,
            "gbps": _bytes(shape) / (ms * 1e-3) / 1e9,
            # How far one column's round medians spread: differences below it are noise.
            "spread_pct": 100.0 * (max(medians[name]) - min(medians[name])) / ms,
            **({"rel_err": error} if error is not None else {}),
        }
    return row


TOLERANCE = {"bf16": 1.6e-2, "fp16": 4e-3}


def fmha_lines(row: dict[str, Any], dtype: str) -> str:
    """One shape's columns as FMHA_v2 prints them: a check line and an elapsed line each."""
    lines = [f"{row['shape']}:"]
    for name, cell in row["columns"].items():
        lines.append(f"  {name}:")
        if "error" in cell:
            lines.append(f"    not run: {cell['error']}")
            continue
        error = cell.get("rel_err")
        if error is None:
            lines.append("    Checks: not checked (a backward, or a column writing into buffers of its own)")
        else:
            verdict = "SUCCESS" if error < TOLERANCE[dtype] else "FAILED"
            lines.append(
                f"    Checks: {verdict} (relative error {error:.2e} vs the reference, tolerance {TOLERANCE[dtype]:g})"
            )
        lines.append(
            f"    Elapsed: {cell['ms'] * 1e3:.1f} us, {cell['tflops']:.1f} TFLOP/s, {cell['gbps']:.1f} GB/s"
            f" (median of rounds; spread {cell['spread_pct']:.1f}%)"
        )
    return "\n".join(lines)


_COLD_START = """
import time, torch
torch.cuda.init(); torch.empty(1, device="cuda")
import cudnn, cudnn_attn
q = torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
start = time.perf_counter()
with cudnn_attn.Graph(autotune=True) as g:
    g.sdpa(q, q, q, use_causal_mask=True)
g(q)
torch.cuda.synchronize()
print(time.perf_counter() - start)
"""


def cold_start() -> dict[str, float]:
    """Seconds from entering the first ``with Graph(autotune=True)`` to its first result, in fresh
    processes: with an empty plan store, then with the store that run filled."""
    with tempfile.TemporaryDirectory() as store:
        env = {**os.environ, "CUDNN_ATTN_CACHE_DIR": store}

        def once() -> float:
            done = subprocess.run(
                [sys.executable, "-c", _COLD_START], env=env, capture_output=True, text=True, check=True
            )
            return float(done.stdout.strip().splitlines()[-1])

        cold = once()
        warm = min(once() for _ in range(2))
    return {"cold_s": cold, "warm_store_s": warm, "speedup": cold / warm}


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'shape':<40}" + "".join(f"{c:>18}" for c in COLUMNS)]
    for row in rows:
        cells = []
        for c in COLUMNS:
            cell = row["columns"].get(c, {})
            cells.append(f"{cell['tflops']:>10.1f} TF/s  " if "tflops" in cell else f"{'n/a':>16}  ")
        lines.append(f"{row['shape']:<40}" + "".join(cells))
    lines.append("(TFLOP/s; per-column ms, GB/s and errors in --json)")
    return "\n".join(lines)


def run(
    shapes: list[Shape],
    *,
    json_path: str | None,
    plot_path: str | None,
    overhead: bool,
    cold: bool,
    stack: bool = False,
    paged_decode: bool = False,
    naive: bool = False,
) -> dict[str, Any]:
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "rows": []}
    for shape in shapes:
        report["rows"].append(bench_shape(shape))
        print(fmha_lines(report["rows"][-1], shape.dtype), flush=True)
    if len(shapes) > 1:
        print(format_table(report["rows"]))
    if overhead:
        from . import host

        report["host_time"] = host.host_paths()
        print(host.format_host(report["host_time"], "host time per call (b1 h8 s128 d64 bf16; decode: b1 kv 2k):"))
        for batch, seq in ((2, 512), (8, 2048)):
            steps = host.layer_steps(batch, seq)
            report[f"layer_step_b{batch}_s{seq}"] = steps
            print(host.format_host(steps, f"nn.Attention training step, B{batch} S{seq}, hidden 2048, 16 heads:"))
    if stack or paged_decode or naive:
        from . import targets

        sections: list[tuple[str, bool, Callable[[], dict[str, Any]], Callable[[dict[str, Any]], str]]] = [
            ("stack", stack, targets.stack_steps, targets.format_stack),
            ("paged_decode", paged_decode, targets.paged_decode, targets.format_paged_decode),
            ("naive", naive, targets.naive_vs_fused, targets.format_naive),
        ]
        for key, wanted, measure, format_section in sections:
            if wanted:
                report[key] = measure()
                print(format_section(report[key]), flush=True)
    if cold:
        report["cold_start"] = cold_start()
        print(
            "time to first result in a fresh process: "
            + json.dumps({k: round(v, 3) for k, v in report["cold_start"].items()})
        )
    if json_path:
        write_json(json_path, report)
    if plot_path:
        draw(report, plot_path)
    return report
