"""Kernel time of one call after a pause, as the cuDNN frontend's training benchmark times it.

Its ``benchmark_single_sdpa.py`` times each iteration alone: it zeroes an L2-sized buffer, waits
for the GPU, runs one call under torch's profiler and sums the device time of the call's kernels;
the figure is the median over iterations after the first few. A GPU that has just waited runs
its next kernels faster than one kept busy (its clocks recover), so these figures come out above
back-to-back timing of the same kernels (about 11% for DeepSeek-V3's backward on an H200). To
compare with that benchmark's published numbers, a column is timed the same way here; the
columns alternate within each iteration. Every device activity of the call counts (kernels,
memsets, copies), for every column alike.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

L2_FLUSH_BYTES = 256 * 2**20  # above any current GPU's L2
WARMUP = 3


def paused_kernel_ms(runs: dict[str, Callable[[], object]], iterations: int = 10) -> dict[str, dict[str, float]]:
    """Per column: the median kernel milliseconds of one call after a pause, and the spread (%)."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(WARMUP + iterations):
        for name, run in runs.items():
            flush.zero_()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run()
                torch.cuda.synchronize()
            if i >= WARMUP:
                times[name].append(sum(e.device_time_total for e in prof.key_averages()) / 1000)
    return {
        name: {"ms": statistics.median(ts), "spread_pct": 100.0 * (max(ts) - min(ts)) / statistics.median(ts)}
        for name, ts in times.items()
    }
