"""MLA decode (``bench --mla``): ``PagedAttention`` with DeepSeek-V3's latent geometry (one K/V head
of 576 = 512 + rope 64, V the latent's first 512 dims, page 64) per layer inside a CUDA-graph
replay of 8 layers: the kernel it picks against ``decode_kernel="cudnn"``, the two graphs
alternating round by round, beside the memory's large-transfer peak measured in the same run
(the better of a 1 GiB copy and a 4 GiB read). Each layer reads a latent cache of its own, as a
model's layers do: one cache read by every layer would stay in the L2 cache (50 MB on an H100)
wherever it fits, 37.7 MB at B1 KV 32k, and flatter the shapes a serving step reads from HBM.

On Hopper two more columns time what no split-KV decode kernel can beat on the same grid and
pages (``mla_bound.py``): **read**, the pages streamed into shared memory and nothing else, and
**bound**, that plus the splits' partial outputs written and merged, with no math at all."""

from __future__ import annotations

import statistics
from typing import Any

import torch

from ..serving.paged_attention import PagedAttention
from . import mla_bound
from .progress import progress

D, DV, PAGE, LAYERS, ROUNDS = 576, 512, 64, 8, 12
SHAPES = ((128, 16, 4096), (128, 64, 4096), (128, 1, 32768), (16, 16, 4096), (16, 4, 8192), (16, 1, 32768))


def _ms(fn: Any) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def memory_peak() -> dict[str, float]:
    """TB/s of a 1 GiB device copy (read and write counted) and a 4 GiB read-only sum."""
    x = torch.empty(2**29, dtype=torch.bfloat16, device="cuda")
    y, big = torch.empty_like(x), torch.empty(2**31, dtype=torch.bfloat16, device="cuda")
    peaks = {}
    for name, fn, nbytes in (("copy_1gib", lambda: y.copy_(x), 2**31), ("read_4gib", big.sum, 2**32)):
        for _ in range(3):
            fn()
        peaks[name] = nbytes / (statistics.median(_ms(fn) for _ in range(10)) * 1e-3) / 1e12
    return peaks


def _captured(heads: int, batch: int, kv: int, kernel: str | None, t: dict[str, Any]) -> tuple:
    attn = PagedAttention(
        heads,
        1,
        D,
        PAGE,
        dtype=torch.bfloat16,
        head_dim_v=DV,
        scale=192**-0.5,
        max_batch=batch,
        max_pages_per_seq=kv // PAGE,
        cuda_graph=True,
        device="cuda",
        decode_kernel=kernel,
    )
    attn.plan(t["table"], torch.full((batch,), kv, dtype=torch.int32, device="cuda"))
    out = torch.empty(batch, heads, 1, DV, device="cuda", dtype=torch.bfloat16)
    for latent in t["latents"]:
        attn.run(t["q"], latent, latent[..., :DV], out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for latent in t["latents"]:  # out ends as the last layer's
            attn.run(t["q"], latent, latent[..., :DV], out=out)
    assert attn.schedule is not None
    return graph, out, f"{attn.schedule.kernel} x{attn.schedule.splits}", attn


def _bounds(heads: int, batch: int, attn: PagedAttention, t: dict[str, Any]) -> dict[str, tuple]:
    """The **read** and **bound** columns' graphs, on the schedule ``attn`` picked."""
    schedule = attn.schedule
    assert schedule is not None
    splits, device = schedule.splits, t["q"].device
    partial_lse = torch.empty(batch, splits, heads, device=device)
    columns = {}
    for name in ("read", "bound"):
        out = torch.empty(batch, heads, 1, DV, device=device, dtype=torch.bfloat16) if name == "bound" else None
        # one split writes the layer's output itself (bf16), as the decode kernel does
        partial_o = (
            torch.empty(batch, splits, heads, DV, device=device) if splits > 1 or out is None else out.transpose(1, 2)
        )

        def step(out: torch.Tensor | None = out, partial_o: torch.Tensor = partial_o) -> None:
            for latent in t["latents"]:
                mla_bound.layer(
                    latent,
                    t["table"],
                    heads=heads,
                    splits=splits,
                    chunk_pages=schedule.chunk_pages,
                    partial_o=partial_o,
                    partial_lse=partial_lse,
                    out=out,
                )

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        columns[name] = (graph, out, f"{name} x{splits}", (partial_o, partial_lse))
    return columns


def mla_row(heads: int, batch: int, kv: int, peak: float) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(kv + heads + batch)
    pages = kv // PAGE
    latents = [
        torch.randn(batch * pages, 1, PAGE, D, device="cuda", generator=gen, dtype=torch.bfloat16)
        for _ in range(LAYERS)
    ]
    table = torch.randperm(batch * pages, device="cuda", generator=gen).int().view(batch, pages)
    q = torch.randn(batch, heads, 1, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    t: dict[str, Any] = {"latents": latents, "table": table, "q": q}
    columns = {"picked": _captured(heads, batch, kv, None, t), "cudnn": _captured(heads, batch, kv, "cudnn", t)}
    picked_attn = columns["picked"][3]
    picked_schedule = picked_attn.schedule
    if mla_bound.available(q.device) and picked_schedule is not None and picked_schedule.decode_kernel.one_kernel:
        columns.update(_bounds(heads, batch, picked_attn, t))
    names = list(columns)
    times: dict[str, list[float]] = {name: [] for name in columns}
    for round_ in range(ROUNDS):  # each column first in turn, each after a replay of its own as warm-up
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            graph = columns[name][0]
            graph.replay()
            times[name].append(_ms(graph.replay) / LAYERS * 1e3)
    flops, nbytes = 2.0 * batch * heads * kv * (D + DV), batch * kv * D * 2.0
    row: dict[str, Any] = {"heads": heads, "batch": batch, "kv": kv}
    for name, values in times.items():
        us = statistics.median(values)
        row[name] = {
            "kernel": columns[name][2],
            "us": us,
            "low": min(values),
            "high": max(values),
            "peak_pct": 100 * nbytes / us / 1e6 / peak,
        }
        if name not in ("read", "bound"):  # the no-math columns do no FLOPs
            row[name]["tflops"] = flops / us / 1e6
    picked, cudnn = (columns[n][1].float() for n in ("picked", "cudnn"))
    row["rel_diff"] = float((picked - cudnn).norm() / cudnn.norm())
    row["speedup"] = row["cudnn"]["us"] / row["picked"]["us"]
    return row


def mla_rows() -> dict[str, Any]:
    peaks = memory_peak()
    peak = max(peaks.values())
    rows = []
    for heads, batch, kv in progress(SHAPES, "mla", unit="shape"):
        rows.append(mla_row(heads, batch, kv, peak))
        print(format_row(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "peaks_tbps": peaks, "rows": rows}


def format_row(row: dict[str, Any]) -> str:
    cells = [
        f"{c['kernel']}: {c['us']:.1f} us ({c['low']:.1f}-{c['high']:.1f}) {c['tflops']:.0f} TFLOP/s "
        f"{c['peak_pct']:.0f}% of peak"
        for c in (row["picked"], row["cudnn"])
    ]
    cells += [
        f"{c['kernel']} (no math): {c['us']:.1f} us {c['peak_pct']:.0f}% of peak"
        for c in (row.get("read"), row.get("bound"))
        if c
    ]
    return (
        f"H{row['heads']} B{row['batch']} KV{row['kv']}: "
        + " | ".join(cells)
        + f" | {row['speedup']:.2f}x, rel diff {row['rel_diff']:.1e}"
    )
