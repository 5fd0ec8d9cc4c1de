"""``cudnn-attn bench --dtype fp8``: FP8 attention beside bf16, forward and backward, same run.

Per shape (d128 grid shapes and S = 16384): our bf16 graph, our FP8 graph on pre-quantised
inputs, ``cudnn_attn.sdpa_fp8`` (amax, scale and quantise of Q, K, V and the dequantised
output included; current and delayed scaling; and with FP8 in or out, ``Fp8Tensor``, as
for an FP8 producer or consumer) and torch's cuDNN backend in bf16; then the bf16 and FP8 backward graphs.
Columns are timed in shuffled interleaved rounds (``host.round_order``): medians and
spreads. FP8 outputs are checked against the bf16 graph's (relative error of O).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from .. import Fp8Scaling, Fp8Tensor, Graph, PlanCache, sdpa_fp8
from ..fp8 import quantised
from ..functional import sdpa as cudnn_attn_sdpa
from ..ops.cudnn import autotune
from .host import round_order
from .progress import progress

SHAPES = (
    (4, 16, 4096, 128, False),
    (4, 16, 4096, 128, True),
    (1, 16, 16384, 128, False),
    (1, 16, 16384, 128, True),
    (4, 16, 4096, 64, True),
)


def _flops(b: int, h: int, s: int, d: int, causal: bool) -> float:
    return 4.0 * b * h * s * s * d / (2 if causal else 1)


def _columns(b: int, h: int, s: int, d: int, causal: bool) -> tuple[dict[str, Callable], dict[str, Callable], dict]:
    """The forward and backward columns of one shape, and the outputs to check."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(0)
    q, k, v, d_o = (torch.randn(b, h, s, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(4))
    (q8, dq), (k8, dk), (v8, dv) = (quantised(x) for x in (q, k, v))
    scale_s = torch.full((1, 1, 1, 1), 448.0, device="cuda")
    fp8_args = (q8, k8, v8, dq, dk, dv, 1.0 / scale_s, scale_s, 1.0 / dv)
    cache = PlanCache()
    with Graph(cache=cache) as bf16:
        bf16.sdpa(q, k, v, use_causal_mask=causal, generate_stats=True)
    with Graph(cache=cache) as fp8:
        fp8.sdpa_fp8(*fp8_args, use_causal_mask=causal, generate_stats=True)
    with Graph(cache=cache) as fp8_lean:  # without Amax_S: the frontend says it narrows the engines
        fp8_lean.sdpa_fp8(*fp8_args, use_causal_mask=causal, generate_stats=True)[2].set_output(False)
    o, stats = bf16(q, k, v)
    o8, stats8, _, _ = fp8(*fp8_args)

    def torch_cudnn() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    delayed = Fp8Scaling()
    fp8_q, fp8_k, fp8_v = (Fp8Tensor.quantise(x) for x in (q, k, v))
    forward = {
        "bf16 graph": lambda: bf16(q, k, v),
        "fp8 graph": lambda: fp8(*fp8_args),
        "fp8 frontend direct": _frontend_direct(fp8, fp8_args),
        "fp8 graph, no Amax_S": lambda: fp8_lean(*fp8_args),
        "sdpa_fp8 (scaling included)": lambda: sdpa_fp8(q, k, v, is_causal=causal),
        "sdpa_fp8, delayed scaling": lambda: sdpa_fp8(q, k, v, is_causal=causal, scaling=delayed),
        # Where the caller lets FP8 through (an FP8 producer or consumer), no casts or fewer:
        "sdpa_fp8, bf16 in, FP8 out": lambda: sdpa_fp8(
            q, k, v, is_causal=causal, scaling=delayed, out_dtype=torch.float8_e4m3fn
        ),
        "sdpa_fp8, FP8 in, bf16 out": lambda: sdpa_fp8(fp8_q, fp8_k, fp8_v, is_causal=causal, out_dtype=torch.bfloat16),
        "sdpa_fp8, FP8 in and out": lambda: sdpa_fp8(fp8_q, fp8_k, fp8_v, is_causal=causal),
        "torch cudnn bf16": torch_cudnn,
    }
    backward: dict[str, Callable] = {}
    with Graph(cache=cache) as bf16_bwd:
        bf16_bwd.sdpa_backward(q, k, v, o, d_o, stats, use_causal_mask=causal)
    backward["bf16 backward graph"] = lambda: bf16_bwd(q, k, v, o, d_o, stats)
    do8, d_do = quantised(d_o)
    # Twelve distinct tensors: a tensor given twice is one graph input.
    unit = [torch.ones(1, 1, 1, 1, device="cuda") for _ in range(5)]
    scales = (dq, dk, dv, dv.clone(), d_do, 1.0 / scale_s, unit[0], scale_s.clone(), *unit[1:])
    try:
        with Graph(cache=cache) as fp8_bwd:
            fp8_bwd.sdpa_fp8_backward(q8, k8, v8, o8, do8, stats8, *scales, use_causal_mask=causal)
        backward["fp8 backward graph"] = lambda: fp8_bwd(q8, k8, v8, o8, do8, stats8, *scales)
    except Exception as failure:  # e.g. Hopper's FP8 backward takes d = 128 only: reported, not fatal
        backward["fp8 backward graph"] = _refused(failure)
    checks = {"o_bf16": o, "o_fp8": o8.float() * dv, "sdpa_fp8": sdpa_fp8(q, k, v, is_causal=causal)}
    return forward, backward, checks


def _frontend_direct(graph: Graph, args: tuple) -> Callable:
    """The FP8 graph's plan through the frontend's own ``execute``, its variant pack prepared once."""
    from ..core.synthetic import empty
    from ..ops.cudnn.platform import cudnn_handle

    node = graph.nodes[0]
    plan: Any = node.plan
    outputs = {role: empty(h.spec) for role, h in node.outputs.items() if h.spec is not None}
    pack = plan.variant_pack(dict(zip(node.inputs, args)), outputs)  # node inputs: in the op's order
    workspace = torch.empty(max(plan.workspace_size, 1), dtype=torch.uint8, device="cuda")
    handle = cudnn_handle(torch.cuda.current_device())
    return lambda: plan.graph.execute(pack, workspace, handle=handle)


def _refused(failure: Exception) -> Callable:
    def run() -> None:
        raise failure

    return run


def _time(paths: dict[str, Callable], rounds: int = 12) -> dict[str, dict]:
    device = torch.device("cuda", torch.cuda.current_device())
    samples: dict[str, list[float]] = {}
    results: dict[str, dict] = {}
    runnable = {}
    for name, fn in paths.items():
        try:
            fn()
            runnable[name] = fn
            samples[name] = []
        except Exception as failure:
            results[name] = {"error": str(failure).splitlines()[0][:160]}
    for r in range(rounds):
        for name in round_order(list(runnable), r):
            samples[name].append(autotune.time_plan(runnable[name], device, 3, 10))
    for name, ms in samples.items():
        median = statistics.median(ms)
        results[name] = {"ms": median, "spread_pct": 100.0 * (max(ms) - min(ms)) / median}
    return results


def fp8_rows() -> list[dict[str, Any]]:
    rows = []
    for b, h, s, d, causal in progress(SHAPES, "fp8", unit="shape"):
        forward, backward, checks = _columns(b, h, s, d, causal)
        flops = _flops(b, h, s, d, causal)
        row: dict[str, Any] = {"shape": f"b{b}-h{h}-s{s}-d{d}{'-causal' if causal else ''}"}
        for kind, paths, work in (("forward", forward, flops), ("backward", backward, 2.5 * flops)):
            cells = _time(paths)
            for cell in cells.values():
                if "ms" in cell:
                    cell["tflops"] = work / (cell["ms"] * 1e-3) / 1e12
            row[kind] = cells
        o = checks["o_bf16"].float()
        row["rel_err_vs_bf16"] = {
            name: float((checks[name].float() - o).norm() / o.norm()) for name in ("o_fp8", "sdpa_fp8")
        }
        rows.append(row)
        del forward, backward, checks
        torch.cuda.empty_cache()
    return rows


CROSSOVER_LENGTHS = (1024, 2048, 4096, 8192)


def crossover(tokens: int = 32768, h: int = 16, d: int = 128) -> list[dict[str, Any]]:
    """``sdpa_fp8`` (delayed and current scaling, quantisation included) against torch's bf16
    cuDNN attention at lengths where the quantisation's share is largest: the same tokens per
    batch (``tokens / S`` sequences), causal and not. Where the ratio crosses 1 is the shortest
    length at which FP8 pays for its casts."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for s in progress(CROSSOVER_LENGTHS, "fp8 crossover", unit="length"):
        for causal in (False, True):
            gen = torch.Generator().manual_seed(s)
            q, k, v = (torch.randn(tokens // s, h, s, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
            delayed = Fp8Scaling()

            def bf16(q=q, k=k, v=v, causal=causal) -> torch.Tensor:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

            cells = _time(
                {
                    "torch cudnn bf16": bf16,
                    "sdpa_fp8 (scaling included)": lambda q=q, k=k, v=v, c=causal: sdpa_fp8(q, k, v, is_causal=c),
                    "sdpa_fp8, delayed scaling": lambda q=q, k=k, v=v, c=causal, sc=delayed: sdpa_fp8(
                        q, k, v, is_causal=c, scaling=sc
                    ),
                }
            )
            base = cells["torch cudnn bf16"]["ms"]
            for cell in cells.values():
                cell["vs_bf16"] = base / cell["ms"]
            rows.append({"s": s, "batch": tokens // s, "causal": causal, "cells": cells})
    return rows


def format_crossover(rows: list[dict[str, Any]]) -> str:
    lines = ["sdpa_fp8 against torch's bf16 cuDNN attention, same tokens per batch (x = bf16 time / FP8 time):"]
    for row in rows:
        cells = "  ".join(
            f"{name} {cell['vs_bf16']:.2f}x (spread {cell['spread_pct']:.0f}%)"
            for name, cell in row["cells"].items()
            if name != "torch cudnn bf16"
        )
        lines.append(f"  s{row['s']:<6} b{row['batch']:<3} {'causal' if row['causal'] else 'full  '}  {cells}")
    return "\n".join(lines)


def format_fp8(rows: list[dict[str, Any]]) -> str:
    lines = ["FP8 beside bf16 (TFLOP/s, median of shuffled rounds; x = over our bf16 graph):"]
    for row in rows:
        lines.append(
            f"  {row['shape']}:  O vs bf16 relative error: "
            + ", ".join(f"{k} {v:.3f}" for k, v in row["rel_err_vs_bf16"].items())
        )
        for kind, base in (("forward", "bf16 graph"), ("backward", "bf16 backward graph")):
            reference = row[kind].get(base, {}).get("tflops")
            for name, cell in row[kind].items():
                if "error" in cell:
                    lines.append(f"    {name:<30} not run: {cell['error']}")
                    continue
                ratio = f"{cell['tflops'] / reference:.2f}x" if reference else "-"
                lines.append(
                    f"    {name:<30}{cell['tflops']:>8.1f} TFLOP/s  {ratio:>6}  (spread {cell['spread_pct']:.1f}%)"
                )
    return "\n".join(lines)


def _outlier_heavy(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Activations as large models make them: a few channels (4 of the head dim) 20x the rest."""
    channels = torch.randperm(x.shape[-1], generator=gen)[:4]
    x = x.clone()
    x[..., channels.to(x.device)] *= 20
    return x


def accuracy(b: int = 2, h: int = 16, s: int = 2048, d: int = 128) -> dict[str, dict[str, float]]:
    """Relative error against bf16 of O (``sdpa_fp8``) and of the FP8 backward's dQ, dK, dV
    (current scaling of dO; the scales of dS and of the gradients from their own amaxes, the
    best a scaling recipe can pick), on random normal and on outlier-heavy inputs."""
    results = {}
    for kind in ("random normal", "outlier channels"):
        gen = torch.Generator().manual_seed(1)
        q, k, v, d_o = (torch.randn(b, h, s, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(4))
        if kind == "outlier channels":
            q, k = _outlier_heavy(q, gen), _outlier_heavy(k, gen)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o = cudnn_attn_sdpa(leaves[0], leaves[1], leaves[2], is_causal=True)
        grads = torch.autograd.grad(o, leaves, d_o)
        row = {"O": _relative(sdpa_fp8(q, k, v, is_causal=True), o)}
        (q8, dq), (k8, dk), (v8, dv), (do8, ddo) = (quantised(x) for x in (q, k, v, d_o))
        scale_s = torch.full((1, 1, 1, 1), 448.0, device="cuda")
        fwd_args = (q8, k8, v8, dq, dk, dv, 1.0 / scale_s, scale_s, 1.0 / dv)
        with Graph() as fwd:
            fwd.sdpa_fp8(*fwd_args, use_causal_mask=True, generate_stats=True)
        o8, stats, _, _ = fwd(*fwd_args)
        grad_scales = [(448.0 / g.abs().max().float()).reshape(1, 1, 1, 1) for g in grads]
        scale_dp, descale_dp = torch.ones(1, 1, 1, 1, device="cuda"), torch.ones(1, 1, 1, 1, device="cuda")
        scales = (dq, dk, dv, dv.clone(), ddo, 1.0 / scale_s, descale_dp, scale_s.clone(), *grad_scales, scale_dp)
        with Graph() as bwd:
            bwd.sdpa_fp8_backward(q8, k8, v8, o8, do8, stats, *scales, use_causal_mask=True)
        # dS's scale from its own amax: a first run reports Amax_dP, the second uses it.
        amax_dp = bwd(q8, k8, v8, o8, do8, stats, *scales)[6]
        scale_dp.copy_(448.0 / amax_dp)
        descale_dp.copy_(amax_dp / 448.0)
        fp8_grads = bwd(q8, k8, v8, o8, do8, stats, *scales)
        for name, g8, scale, reference in zip(("dQ", "dK", "dV"), fp8_grads, grad_scales, grads):
            row[name] = _relative(g8.float() / scale, reference)
        results[kind] = row
    return results


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.detach().float()
    return float((actual.detach().float() - expected).norm() / expected.norm())


def format_accuracy(results: dict[str, dict[str, float]]) -> str:
    lines = ["FP8 accuracy against bf16 (b2 h16 s2048 d128 causal; relative error):"]
    for kind, row in results.items():
        lines.append(f"  {kind:<18}" + "  ".join(f"{name} {err:.3f}" for name, err in row.items()))
    return "\n".join(lines)
