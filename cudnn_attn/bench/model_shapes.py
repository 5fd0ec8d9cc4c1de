"""Today's training shapes (``bench --models``): DeepSeek-V3 and gpt-oss attention, forward and
backward from 4k to 32k, through ``cudnn_attn.sdpa`` against the bare frontend's graphs.

The shapes and the count of FLOPs are the cuDNN frontend's own training benchmark
(``benchmark/sdpa_benchmark_training``: configs ``dsv3`` and ``gpt_oss``, bf16, causal, top-left):

- DeepSeek-V3: B1, 128 heads, d_qk 192, d_v 128;
- gpt-oss: B2, 64 query / 8 K/V heads, d64, a causal window of 1024 keys (the frontend's
  ``diagonal_band_left_bound=1024``, ``window_size=(1023, 0)`` here), and the same with its
  learned attention sinks (the frontend's benchmark runs none).

The columns run on the same inputs in one process, in interleaved rounds of a fresh order
(median of rounds and the spread); the forward is the training forward (it keeps the
log-sum-exp), the backward reuses one forward. A third column runs the frontend's graphs with dO
in BHSD memory, as the frontend's own benchmark makes it (O and the inputs BSHD): a layout the
doors copy into O's. Each column's peak memory is what one forward and
backward allocate beyond the inputs. The outputs and gradients of the two are compared.
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..ops.cudnn import autotune
from .host import round_order
from .paused_timing import paused_kernel_ms
from .progress import progress

SEQS = (4096, 8192, 16384, 32768)
ROUNDS = 8


@dataclass(frozen=True)
class Model:
    name: str
    b: int
    h: int
    h_kv: int
    d: int
    d_v: int
    window: int | None = None  # the frontend's left bound: keys j > i - window
    sinks: bool = False

    def flops(self, s: int, backward: bool) -> float:
        """The frontend benchmark's count: unmasked scores x 2 x (d_qk + d_v) forward, x 2 x
        (3 d_qk + 2 d_v) backward."""
        w = self.window
        scores = s * (s + 1) // 2 if w is None or s <= w else w * (w + 1) // 2 + (s - w) * w
        per_score = 3 * self.d + 2 * self.d_v if backward else self.d + self.d_v
        return 2.0 * self.b * self.h * scores * per_score


MODELS = (
    Model("deepseek-v3", 1, 128, 128, 192, 128),
    Model("gpt-oss", 2, 64, 8, 64, 64, window=1024),
    Model("gpt-oss+sinks", 2, 64, 8, 64, 64, window=1024, sinks=True),
)


def _inputs(m: Model, s: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(s)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16)

    # BSHD memory, as models hold it, viewed BHSD.
    t = {
        "q": randn(m.b, s, m.h, m.d).transpose(1, 2),
        "k": randn(m.b, s, m.h_kv, m.d).transpose(1, 2),
        "v": randn(m.b, s, m.h_kv, m.d_v).transpose(1, 2),
        "grad_o": randn(m.b, s, m.h, m.d_v).transpose(1, 2),
    }
    if m.sinks:
        t["sinks"] = torch.randn(m.h, device="cuda", generator=gen)
    return t


def _ours(m: Model, t: dict[str, torch.Tensor]) -> tuple[Callable, Callable, Callable]:
    from ..functional import sdpa

    leaves = [t[n].detach().requires_grad_() for n in ("q", "k", "v")]
    if m.sinks:
        leaves.append(t["sinks"].detach().requires_grad_())
    window = (m.window - 1, 0) if m.window else (-1, -1)
    options = dict(is_causal=True, enable_gqa=m.h != m.h_kv, window_size=window, scale=m.d**-0.5)

    def forward() -> torch.Tensor:
        return sdpa(leaves[0], leaves[1], leaves[2], sinks=leaves[3] if m.sinks else None, **options)

    out = forward()

    def backward() -> tuple:
        return torch.autograd.grad(out, leaves, t["grad_o"], retain_graph=True)

    return forward, backward, lambda: (out, *backward())


def _frontend(m: Model, t: dict[str, torch.Tensor]) -> tuple[Callable, Callable, Callable]:
    """The two graphs built straight through the frontend, as its benchmark builds them."""
    import cudnn

    from ..ops.cudnn.platform import cudnn_handle

    handle = cudnn_handle(torch.cuda.current_device())
    bf16, f32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    q, k, v, d_o = t["q"], t["k"], t["v"], t["grad_o"]
    b, _, s, _ = q.shape
    o = torch.empty(b, s, m.h, m.d_v, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    stats = torch.empty(b, m.h, s, 1, device="cuda", dtype=torch.float32)
    masks: dict[str, Any] = dict(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=0)
    if m.window:
        masks["diagonal_band_left_bound"] = m.window
    sink = t["sinks"].float().view(1, m.h, 1, 1).contiguous() if m.sinks else None
    d_sink = torch.empty_like(sink) if sink is not None else None

    def graph() -> Any:
        return cudnn.pygraph(io_data_type=bf16, intermediate_data_type=f32, compute_data_type=f32, handle=handle)

    fwd = graph()
    fq, fk, fv = (fwd.tensor_like(x) for x in (q, k, v))
    extra = {"sink_token": fwd.tensor_like(sink)} if sink is not None else {}
    fo, fstats = fwd.sdpa(q=fq, k=fk, v=fv, generate_stats=True, attn_scale=m.d**-0.5, **masks, **extra)
    fo.set_output(True).set_dim(list(o.shape)).set_stride(list(o.stride())).set_data_type(bf16)
    fstats.set_output(True).set_data_type(f32)
    fwd.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    fwd_pack = {fq: q, fk: k, fv: v, fo: o, fstats: stats, **({extra["sink_token"]: sink} if sink is not None else {})}
    bwd = graph()
    bq, bk, bv, bo, bdo = (bwd.tensor_like(x) for x in (q, k, v, o, d_o))
    bstats = bwd.tensor_like(stats)
    sinks_in: dict[str, Any] = {}
    if sink is not None:
        sinks_in = {"sink_token": bwd.tensor_like(sink), "dSink_token": bwd.tensor_like(d_sink)}
    dq, dk, dv = bwd.sdpa_backward(
        q=bq, k=bk, v=bv, o=bo, dO=bdo, stats=bstats, attn_scale=m.d**-0.5, **masks, **sinks_in
    )
    grads = [torch.empty_like(x) for x in (q, k, v)]
    for handle_, like in zip((dq, dk, dv), grads):
        handle_.set_output(True).set_dim(list(like.shape)).set_stride(list(like.stride())).set_data_type(bf16)
    bwd.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    bwd_pack = {bq: q, bk: k, bv: v, bo: o, bdo: d_o, bstats: stats, dq: grads[0], dk: grads[1], dv: grads[2]}
    if sink is not None:
        bwd_pack.update({sinks_in["sink_token"]: sink, sinks_in["dSink_token"]: d_sink})
    workspace = torch.empty(
        max(fwd.get_workspace_size(), bwd.get_workspace_size(), 1), dtype=torch.uint8, device="cuda"
    )

    def forward() -> None:
        fwd.execute(fwd_pack, workspace, handle=handle)

    def backward() -> None:
        bwd.execute(bwd_pack, workspace, handle=handle)

    def results() -> tuple:
        forward()
        backward()
        return (o, *grads, *([d_sink.view(-1)] if d_sink is not None else []))

    forward()
    return forward, backward, results


def _frontend_bhsd_grad(m: Model, t: dict[str, torch.Tensor]) -> tuple[Callable, Callable, Callable]:
    """The frontend's graphs with dO in BHSD memory, as its own benchmark makes it
    (``torch.randn(output.shape)`` of a BSHD output viewed BHSD): O, Q, K, V stay BSHD."""
    return _frontend(m, {**t, "grad_o": t["grad_o"].contiguous()})


COLUMNS: dict[str, Callable[[Model, dict[str, torch.Tensor]], tuple[Callable, Callable, Callable]]] = {
    "cudnn_attn": _ours,
    "frontend": _frontend,
    "frontend, dO BHSD": _frontend_bhsd_grad,
}


def _peak_bytes(make: Callable, m: Model, t: dict[str, torch.Tensor]) -> tuple[tuple, int]:
    """A column's runners, and what building it and one forward and backward allocate at most.
    Garbage from earlier shapes is collected first: freed during the measure, it would hide the
    column's own allocations."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    runners = make(m, t)
    runners[1]()
    torch.cuda.synchronize()
    return runners, torch.cuda.max_memory_allocated() - base


def model_row(m: Model, s: int) -> dict[str, Any]:
    t = _inputs(m, s)
    device = torch.device("cuda", torch.cuda.current_device())
    row: dict[str, Any] = {"model": m.name, "seq": s, "columns": {}}
    runners: dict[str, tuple] = {}
    for name, make in COLUMNS.items():
        try:
            runners[name], peak = _peak_bytes(make, m, t)
        except Exception as failure:  # a column that cannot run this shape: reported, not fatal
            text = str(failure).strip().splitlines()
            row["columns"][name] = {"error": text[0][:160] if text else type(failure).__name__}
            continue
        row["columns"][name] = {"peak_bytes": peak}
    times: dict[str, list[float]] = {f"{n} {p}": [] for n in runners for p in ("fwd", "bwd")}
    for round_ in range(ROUNDS):
        for key in round_order(sorted(times), round_):
            name, part = key.rsplit(" ", 1)
            run = runners[name][0 if part == "fwd" else 1]
            times[key].append(autotune.time_plan(run, device, warmup=2, repeats=5))
    for key, values in times.items():
        name, part = key.rsplit(" ", 1)
        ms = statistics.median(values)
        row["columns"][name][part] = {
            "ms": ms,
            "tflops": m.flops(s, part == "bwd") / (ms * 1e-3) / 1e12,
            "spread_pct": 100.0 * (max(values) - min(values)) / ms,
        }
    if "cudnn_attn" in runners and "frontend" in runners:
        ours, theirs = (runners[n][2]() for n in ("cudnn_attn", "frontend"))
        labels = ("O", "dQ", "dK", "dV", "dSinks")
        with torch.no_grad():
            row["rel_err_vs_frontend"] = {
                label: float((a.float() - b.float()).norm() / b.float().norm())
                for label, a, b in zip(labels, ours, theirs)
            }
        for part in ("fwd", "bwd"):
            row[f"{part}_ratio"] = row["columns"]["frontend"][part]["ms"] / row["columns"]["cudnn_attn"][part]["ms"]
            paused = paused_kernel_ms({n: runners[n][0 if part == "fwd" else 1] for n in ("cudnn_attn", "frontend")})
            row[f"{part}_paused"] = {
                name: {**cell, "tflops": m.flops(s, part == "bwd") / (cell["ms"] * 1e-3) / 1e12}
                for name, cell in paused.items()
            }
    del t, runners
    gc.collect()
    torch.cuda.empty_cache()
    return row


def model_rows(models: tuple[Model, ...] = MODELS, seqs: tuple[int, ...] = SEQS) -> list[dict[str, Any]]:
    rows = []
    for m in progress(models, "models", unit="model"):
        for s in seqs:
            rows.append(model_row(m, s))
            print(format_row(rows[-1]), flush=True)
    return rows


def format_row(row: dict[str, Any]) -> str:
    cells = []
    for name, cell in row["columns"].items():
        if "error" in cell:
            cells.append(f"{name}: not run ({cell['error']})")
            continue
        fwd, bwd = cell["fwd"], cell["bwd"]
        cells.append(
            f"{name} fwd {fwd['tflops']:.0f} TF/s ({fwd['spread_pct']:.1f}%) bwd {bwd['tflops']:.0f} TF/s "
            f"({bwd['spread_pct']:.1f}%) peak {cell['peak_bytes'] / 2**30:.2f} GiB"
        )
    ratio = ""
    if "fwd_ratio" in row:
        worst = max(row["rel_err_vs_frontend"].values())
        ratio = f" | ours/frontend fwd {row['fwd_ratio']:.3f}x bwd {row['bwd_ratio']:.3f}x, max rel err {worst:.1e}"
    if "bwd_paused" in row:  # reports saved before this column have none
        paused = [
            f"{part} {row[f'{part}_paused']['cudnn_attn']['tflops']:.0f} vs {row[f'{part}_paused']['frontend']['tflops']:.0f}"
            for part in ("fwd", "bwd")
        ]
        ratio += f" | after a pause (the frontend's timing), ours vs frontend TF/s: {', '.join(paused)}"
    return f"{row['model']:<14} s{row['seq']:<6} " + "; ".join(cells) + ratio


def format_models(rows: list[dict[str, Any]]) -> str:
    head = f"training shapes, bf16 causal, TFLOP/s as the frontend's benchmark counts ({torch.cuda.get_device_name()})"
    return "\n".join([head, *(format_row(r) for r in rows)])
