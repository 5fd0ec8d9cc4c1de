"""Frontend code that rebuilds its graph on every call (``bench --frontend-rebuild``).

The frontend's notebook 50 (``samples/python/50_sdpa_forward.ipynb``) in its pythonic form,
``cudnn.Graph(inputs=[...], outputs=[...])``, built and run in a loop, as code that builds its graph
inside the step does: through the frontend itself, and unchanged but for the import through
this library, where the rebuild adopts the first build (``recording/reuse.py``). Same process,
same inputs, the two columns alternating round by round; milliseconds per iteration (median of
rounds, with the spread) and whether the two outputs are identical.
"""

from __future__ import annotations

import importlib
import math
import statistics
import time
from typing import Any

import torch

B, S, H, D = 4, 1024, 12, 64  # the notebook's shape
ROUNDS = 6


def _step(cudnn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: Any) -> torch.Tensor:
    with cudnn.Graph(
        io_data_type=cudnn.data_type.HALF,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
        inputs=["SDPA::q", "SDPA::k", "SDPA::v"],
        outputs=["attn_output"],
    ) as graph:
        o, _ = graph.sdpa(
            name="SDPA", q=q, k=k, v=v, attn_scale=1 / math.sqrt(D), is_inference=True, use_causal_mask=True
        )
        o.set_output(True).set_name("attn_output").set_dim(q.shape).set_stride(q.stride())
    return graph(q, k, v, handle=handle)


def rebuild_loop(iterations: int = 200, frontend_iterations: int = 20) -> dict[str, Any]:
    """ms per iteration of the loop through ``cudnn`` and ``cudnn_attn`` (the frontend's rebuild
    takes tens of ms: it runs fewer iterations per round)."""
    gen = torch.Generator(device="cuda").manual_seed(42)
    q, k, v = (
        torch.randn(B, S, H, D, device="cuda", dtype=torch.half, generator=gen).transpose(1, 2) for _ in range(3)
    )
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "shape": f"b{B} h{H} s{S} d{D} fp16 causal"}
    packages = {name: importlib.import_module(name) for name in ("cudnn", "cudnn_attn")}
    counts = {"cudnn": frontend_iterations, "cudnn_attn": iterations}
    handles = {name: cudnn.create_handle() for name, cudnn in packages.items()}
    outputs = {name: _step(cudnn, q, k, v, handles[name]).clone() for name, cudnn in packages.items()}  # first builds
    rounds: dict[str, list[float]] = {name: [] for name in packages}
    for round_ in range(ROUNDS):  # the two columns alternate, round by round, in turns
        for name in sorted(packages, reverse=round_ % 2 == 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(counts[name]):
                _step(packages[name], q, k, v, handles[name])
            torch.cuda.synchronize()
            rounds[name].append((time.perf_counter() - start) / counts[name] * 1e3)
    for name, times in rounds.items():
        report[name] = {
            "ms_median": statistics.median(times),
            "ms_low": min(times),
            "ms_high": max(times),
            "iterations": counts[name],
            "rounds": len(times),
        }
    report["identical"] = bool(torch.equal(outputs["cudnn"], outputs["cudnn_attn"]))
    report["speedup"] = report["cudnn"]["ms_median"] / report["cudnn_attn"]["ms_median"]
    return report


def format_rebuild(report: dict[str, Any]) -> str:
    lines = [f"frontend code rebuilding its graph every call ({report['shape']}, {report['device']})"]
    for name in ("cudnn", "cudnn_attn"):
        r = report[name]
        lines.append(f"  {name:<12}{r['ms_median']:>10.3f} ms/iter  ({r['ms_low']:.3f} - {r['ms_high']:.3f})")
    lines.append(f"  speedup {report['speedup']:.0f}x, outputs identical: {report['identical']}")
    return "\n".join(lines)
