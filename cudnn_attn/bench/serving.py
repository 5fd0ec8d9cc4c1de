"""``cudnn-attn bench --serving``: decode attention per layer inside a CUDA-graph replay.

Per shape (Hq32 Hkv8 d128 bf16, pages of 64 tokens, or ``page``, handed out in a random order): ``PagedAttention``
with its chosen layout (split-KV, query packing, the causal tail), the same with neither
(one paged cuDNN call per layer, as a plain paged graph runs), and torch's SDPA on the same K/V
laid out contiguously. Each column is a step of ``LAYERS`` layers captured in a CUDA graph
(more where their caches would fit in three times the L2 cache, which would then serve a
replay's reads: ``layers_for``) and replayed; the figure is time per layer. One more column
runs the same decode over FP8 (e4m3) caches, half the bytes (its error against the bf16
caches' attention is FP8's). Bandwidth is
the K/V bytes each layer must read (each sequence's valid tokens) plus q and o, as a fraction of the memory's peak measured in the same
rounds: the better of a 1 GiB device copy (read + write) and a 4 GiB read-only stream (a sum).
A transfer as small as the layer's own is launch-bound and would flatter small shapes; its
rates (a copy and a sum of the K/V bytes) are reported beside, as ``pct_of_small_rate``. Every
column is checked against a float32 computation of the same attention.

The process holds more than three CUDA graphs, as a server does: from a process's fourth
graph on, every graph kernel node costs the device more (on an H200, 0.18-0.39 us a node;
docs/benchmarks.md), and these figures are that state's.

The GPU's SM clock is read after each timed sample and reported beside every figure (median and
range, in MHz; NVML's average over its last sample period, so it places a figure roughly; read
through ``nvidia-ml-py``): a decode layer at these small shapes takes time in step with the SM
clock, which sinks after sustained work, far more than the memory's peak does.
"""

from __future__ import annotations

import gc
import math
import statistics
from collections.abc import Callable
from typing import Any

import torch

from .. import PagedAttention
from ..kernels.fp8_cast import E4M3_MAX
from ..ops.dispatch import DECODE_KERNELS
from .host import round_order
from .progress import progress

HQ, HKV, D, PAGE = 32, 8, 128, 64
LAYERS = 4
PEAK_COPY_BYTES, PEAK_READ_BYTES = 2**30, 2**32
CLOCK_KEYS = ("clock_mhz", "clock_low", "clock_high")
SHAPES = ((1, 2048, 1), (1, 32768, 1), (4, 8192, 1), (8, 32768, 1), (64, 4096, 1), (8, 8192, 4), (8, 8192, 8))


def layers_for(layer_bytes: int) -> int:
    """Layers per captured step: ``LAYERS``, or enough that their caches outgrow three times the
    L2 cache, so that each layer reads its cache from memory as a model's layers do."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(LAYERS, math.ceil(3 * l2 / layer_bytes))


def _step(batch: int, kv: int, s_q: int, seed: int = 0, page: int = PAGE) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    pages = kv // page
    num_pages = batch * pages
    table = torch.randperm(num_pages, generator=gen).view(batch, pages).int().cuda()
    layers = layers_for(2 * num_pages * HKV * page * D * 2)
    caches = [
        [torch.randn(num_pages, HKV, page, D, generator=gen).to("cuda", torch.bfloat16) for _ in range(2)]
        for _ in range(layers)
    ]
    q = torch.randn(batch, HQ, s_q, D, generator=gen).to("cuda", torch.bfloat16)
    return {"q": q, "caches": caches, "table": table, "lengths": torch.full((batch,), kv, dtype=torch.int32).cuda()}


def _dense(t: dict[str, Any], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's K/V gathered into contiguous [B, Hkv, S, D] (torch's column reads these)."""
    table = t["table"].long()
    k, v = t["caches"][layer]
    return tuple(c[table].permute(0, 2, 1, 3, 4).flatten(2, 3).contiguous() for c in (k, v))  # type: ignore[return-value]


def _captured(run_layer: Callable[[int], Any], layers: int = LAYERS) -> Callable[[], None]:
    for layer in range(layers):  # warm-up outside the capture: plans built, buffers made
        run_layer(layer)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # A capture was seen invalidated once in a few runs by a call from outside the captured
    # work (cause not found): no garbage collection inside it, and other threads' calls let be.
    gc.disable()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for layer in range(layers):
                run_layer(layer)
    finally:
        gc.enable()
    return graph.replay


def sm_clock_mhz(device: int) -> float | None:
    """The SM clock ``device`` runs at now, in MHz, or None where it cannot be read."""
    try:
        return float(torch.cuda.clock_rate(device))
    except Exception:  # no NVML (or no driver answer): the clock is beside the figures, never a reason to fail
        return None


def summary(times_us: list[float], clocks_mhz: list[float | None]) -> dict[str, float | None]:
    """Median and range of a column's samples: its time, and the SM clock read after each (None
    where no sample's clock could be read)."""
    read = [clock for clock in clocks_mhz if clock is not None]
    return {
        "us": statistics.median(times_us),
        "low": min(times_us),
        "high": max(times_us),
        "clock_mhz": statistics.median(read) if read else None,
        "clock_low": min(read) if read else None,
        "clock_high": max(read) if read else None,
    }


def _time(paths: dict[str, Callable[[], Any]], rounds: int = 10, replays: int = 20) -> dict[str, dict]:
    times: dict[str, list[float]] = {name: [] for name in paths}
    clocks: dict[str, list[float | None]] = {name: [] for name in paths}
    device = torch.cuda.current_device()
    for fn in paths.values():
        fn()
    for r in range(rounds):
        for name in round_order(list(paths), r):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                paths[name]()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / replays)
            clocks[name].append(sm_clock_mhz(device))  # read outside the timed span, so it costs the sample nothing
    return {name: summary(times[name], clocks[name]) for name in paths}


def serving_row(batch: int, kv: int, s_q: int, page: int = PAGE) -> dict[str, Any]:
    t = _step(batch, kv, s_q, page=page)
    q = t["q"]
    layers = len(t["caches"])
    ours = PagedAttention(
        HQ,
        HKV,
        D,
        page,
        dtype=torch.bfloat16,
        device="cuda",
        max_batch=batch,
        max_pages_per_seq=kv // page,
        cuda_graph=True,
    )
    plain = PagedAttention(
        HQ,
        HKV,
        D,
        page,
        dtype=torch.bfloat16,
        device="cuda",
        max_batch=batch,
        max_pages_per_seq=kv // page,
        cuda_graph=True,
        splits=1,
        pack=False,
        decode_kernel="cudnn",
    )
    # The other kernel than the one chosen, as a column of its own.
    chosen = _chosen_kernel(ours, t)
    other = next(name for name in DECODE_KERNELS if name != chosen)
    forced = PagedAttention(
        HQ,
        HKV,
        D,
        page,
        dtype=torch.bfloat16,
        device="cuda",
        max_batch=batch,
        max_pages_per_seq=kv // page,
        cuda_graph=True,
        decode_kernel=other,
    )
    # FP8 caches (e4m3, one scale per cache): half the bytes, read by the same decode kernel.
    fp8 = PagedAttention(
        HQ,
        HKV,
        D,
        page,
        dtype=torch.bfloat16,
        kv_dtype=torch.float8_e4m3fn,
        device="cuda",
        max_batch=batch,
        max_pages_per_seq=kv // page,
        cuda_graph=True,
    )
    scales = [[float(c.abs().max()) / E4M3_MAX for c in layer] for layer in t["caches"]]
    caches8 = [
        [(c.float() / sc).to(torch.float8_e4m3fn) for c, sc in zip(layer, layer_scales)]
        for layer, layer_scales in zip(t["caches"], scales)
    ]
    outs = {name: [torch.empty_like(q) for _ in range(layers)] for name in ("ours", "plain", "forced", "torch", "fp8")}
    for attn in (ours, plain, forced, fp8):
        attn.plan(t["table"], t["lengths"])
    dense = [_dense(t, layer) for layer in range(layers)]
    visible = torch.arange(kv, device="cuda")[None, :] <= (kv - s_q + torch.arange(s_q, device="cuda"))[:, None]

    def torch_layer(layer: int) -> None:
        k, v = dense[layer]
        mask = visible if s_q > 1 else None
        outs["torch"][layer].copy_(
            torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        )

    def layer_of(attn: PagedAttention, name: str) -> Callable[[int], Any]:
        return lambda layer: attn.run(q, t["caches"][layer][0], t["caches"][layer][1], out=outs[name][layer])

    paths: dict[str, Callable[[], Any]] = {
        "PagedAttention": _captured(layer_of(ours, "ours"), layers),
        "paged, no split or packing": _captured(layer_of(plain, "plain"), layers),
        "torch sdpa, contiguous KV": _captured(torch_layer, layers),
    }
    paths[f"PagedAttention, {other} kernel"] = _captured(layer_of(forced, "forced"), layers)
    paths["PagedAttention, FP8 caches"] = _captured(
        lambda layer: fp8.run(
            q,
            caches8[layer][0],
            caches8[layer][1],
            out=outs["fp8"][layer],
            k_scale=scales[layer][0],
            v_scale=scales[layer][1],
        ),
        layers,
    )
    kv_bytes = 2 * batch * kv * HKV * D * 2
    nbytes = kv_bytes + 2 * q.numel() * 2
    source = torch.empty(kv_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    target = torch.empty_like(source)
    paths["device copy (K+V bytes)"] = lambda: target.copy_(source)
    paths["read-only stream (K+V bytes)"] = lambda: source.sum(dtype=torch.float32)
    big = {
        "source": torch.empty(PEAK_COPY_BYTES // 2, dtype=torch.bfloat16, device="cuda").normal_(),
        "read": torch.empty(PEAK_READ_BYTES // 4, dtype=torch.float32, device="cuda").normal_(),
    }
    big["target"] = torch.empty_like(big["source"])
    paths["device copy (1 GiB)"] = lambda: big["target"].copy_(big["source"])
    paths["read-only stream (4 GiB)"] = lambda: big["read"].sum()
    timings = _time(paths)
    copy_rate = 2 * kv_bytes / (timings["device copy (K+V bytes)"]["us"] * 1e-6)
    read_rate = kv_bytes / (timings["read-only stream (K+V bytes)"]["us"] * 1e-6)
    small = max(copy_rate, read_rate)
    peak_copy = 2 * PEAK_COPY_BYTES / (timings["device copy (1 GiB)"]["us"] * 1e-6)
    peak_read = PEAK_READ_BYTES / (timings["read-only stream (4 GiB)"]["us"] * 1e-6)
    best = max(peak_copy, peak_read)
    big.clear()  # 6 GiB back before the next row
    # Correctness of the replayed outputs against float32 attention of the same K/V.
    k, v = dense[layers - 1]
    mask = visible if s_q > 1 else None
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True
    )
    row: dict[str, Any] = {
        "batch": batch,
        "kv": kv,
        "s_q": s_q,
        "page": page,
        "layers": layers,
        "schedule": str(ours.schedule),
        "copy_tbps": copy_rate / 1e12,
        "read_tbps": read_rate / 1e12,
        "peak_copy_tbps": peak_copy / 1e12,
        "peak_read_tbps": peak_read / 1e12,
        # The SM clock each of the four transfers ran at, recorded as each column's own is.
        "transfer_clocks": {
            name: {key: cell[key] for key in CLOCK_KEYS}
            for name, cell in timings.items()
            if name.startswith(("device copy", "read-only"))
        },
        "columns": {},
    }
    for name, cell in timings.items():
        if name.startswith(("device copy", "read-only")):
            continue
        per_layer = cell["us"] / layers
        moved = nbytes - kv_bytes // 2 if name == "PagedAttention, FP8 caches" else nbytes  # one byte per element
        column = {
            "us_per_layer": per_layer,
            "spread_pct": 100 * (cell["high"] - cell["low"]) / cell["us"],
            "tbps": moved / (per_layer * 1e-6) / 1e12,
            **{key: cell[key] for key in CLOCK_KEYS},
        }
        column["pct_of_peak"] = 100 * column["tbps"] * 1e12 / best
        column["pct_of_small_rate"] = 100 * column["tbps"] * 1e12 / small
        key = {
            "PagedAttention": "ours",
            "paged, no split or packing": "plain",
            "torch sdpa, contiguous KV": "torch",
            "PagedAttention, FP8 caches": "fp8",
        }.get(name, "forced")
        got = outs[key][layers - 1].float()
        column["rel_err"] = float((got - expected).norm() / expected.norm())
        row["columns"][name] = column
    return row


def _chosen_kernel(attn: PagedAttention, t: dict[str, Any]) -> str:
    """The decode kernel ``attn`` chooses for this step (its schedule, once planned and run)."""
    attn.plan(t["table"], t["lengths"])
    attn.run(t["q"], *t["caches"][0])
    assert attn.schedule is not None
    return attn.schedule.kernel


def serving_rows(shapes: tuple[tuple[int, int, int], ...] = SHAPES, page: int = PAGE) -> list[dict[str, Any]]:
    rows = []
    for batch, kv, s_q in progress(shapes, "serving", unit="shape"):
        rows.append(serving_row(batch, kv, s_q, page=page))
        torch.cuda.empty_cache()
    return rows


def clock_text(cell: dict[str, Any]) -> str:
    """``@ 1980 MHz``, the SM clock a figure ran at (``@    ? MHz`` where it was not read: rows
    recorded before the clock was, or without NVML)."""
    clock = cell.get("clock_mhz")
    shown = "?" if clock is None else f"{clock:.0f}"
    return f"@ {shown:>4} MHz"


def clock_range_text(cells: list[dict[str, Any]]) -> str:
    """The SM clock's range over ``cells``' samples as a clause to append, ``, clock 1215-1980 MHz``
    (one figure where it held still), or "" where none was read."""
    lows = [c["clock_low"] for c in cells if c.get("clock_low") is not None]
    highs = [c["clock_high"] for c in cells if c.get("clock_high") is not None]
    if not lows or not highs:
        return ""
    low, high = min(lows), max(highs)
    return f", clock {low:.0f} MHz" if low == high else f", clock {low:.0f}-{high:.0f} MHz"


def format_serving(rows: list[dict[str, Any]]) -> str:
    pages = sorted({row.get("page", PAGE) for row in rows})  # reports before the page was recorded: 64
    lines = [
        f"Decode attention per layer inside a CUDA-graph replay (Hq{HQ} Hkv{HKV} d{D} bf16, page "
        f"{', '.join(map(str, pages))}); "
        "% of the memory's peak (the better of a 1 GiB copy and a 4 GiB read, same rounds), and of the "
        "rate of a transfer of the layer's own size; each time at the SM clock (MHz) it ran at:"
    ]
    for row in rows:
        transfers = clock_range_text(list(row.get("transfer_clocks", {}).values()))
        lines.append(
            f"  B{row['batch']} KV {row['kv']} S_q {row['s_q']}  (peak: copy {row['peak_copy_tbps']:.2f}, "
            f"read {row['peak_read_tbps']:.2f} TB/s; K/V-sized: copy {row['copy_tbps']:.2f}, read "
            f"{row['read_tbps']:.2f} TB/s{transfers}; {row['schedule']})"
        )
        for name, c in row["columns"].items():
            clocks = clock_range_text([c])
            lines.append(
                f"    {name:<30}{c['us_per_layer']:>9.1f} us {clock_text(c)}  {c['tbps']:>5.2f} TB/s  "
                f"{c['pct_of_peak']:>5.1f}% of peak  {c['pct_of_small_rate']:>5.1f}% of K/V-sized  "
                f"(spread {c['spread_pct']:.0f}%{clocks}, rel err {c['rel_err']:.1e})"
            )
    return "\n".join(lines)
