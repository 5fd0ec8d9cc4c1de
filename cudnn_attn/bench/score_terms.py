"""What score terms cost (``bench --score-terms``): each call with its term against the same call without.

- soft-capping (cap 50, causal): B2 H16/8 S4k d128, B1 H32/16 S8k d256, and Gemma-2 9B's layer
  (B1 H16/8 S8k d256, cap 50) through the transformers registration;
- attention sinks: gpt-oss (B2 H64/8 S8k d64) with its windows of 128 and 1024 keys and fully causal.

Both columns run on the same inputs in interleaved rounds of a fresh order (medians and the
spread); the forward keeps the log-sum-exp as training does, and "fwd+bwd" is one forward and its
backward. ``speed`` is the plain call's time over the call's with the term (1.0: free).
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..functional import sdpa
from ..ops.cudnn import autotune
from .host import round_order
from .progress import progress

ROUNDS = 8


@dataclass(frozen=True)
class Case:
    name: str
    b: int
    h: int
    h_kv: int
    s: int
    d: int
    term: str  # "softcap", "sinks" or "gemma-2" (soft-capping through the transformers registration)
    window: int | None = None  # FlashAttention's left bound: keys i - window .. i

    def flops(self, backward: bool) -> float:
        w = self.window
        scores = self.s * (self.s + 1) // 2 if w is None else sum(min(i + 1, w + 1) for i in range(self.s))
        return 4.0 * self.b * self.h * scores * self.d * (2.5 if backward else 1.0)


CASES = (
    Case("softcap", 2, 16, 8, 4096, 128, "softcap"),
    Case("softcap", 1, 32, 16, 8192, 256, "softcap"),
    Case("gemma-2 9B", 1, 16, 8, 8192, 256, "gemma-2"),
    Case("gpt-oss sinks", 2, 64, 8, 8192, 64, "sinks", window=127),
    Case("gpt-oss sinks", 2, 64, 8, 8192, 64, "sinks", window=1023),
    Case("gpt-oss sinks", 2, 64, 8, 8192, 64, "sinks"),
)


def _calls(c: Case, with_term: bool) -> tuple[Callable[[], Any], Callable[[], Any]]:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:  # BSHD, as a model's projections lay them out
        t = torch.randn(shape[0], shape[2], shape[1], shape[3], device="cuda", generator=gen, dtype=torch.bfloat16)
        return t.transpose(1, 2).requires_grad_()

    q, k, v = randn(c.b, c.h, c.s, c.d), randn(c.b, c.h_kv, c.s, c.d), randn(c.b, c.h_kv, c.s, c.d)
    d_out = torch.randn_like(q)
    leaves: list[torch.Tensor] = [q, k, v]
    options: dict[str, Any] = {"is_causal": True, "enable_gqa": True}
    if c.window is not None:
        options["window_size"] = (c.window, 0)
    if with_term and c.term == "sinks":
        leaves.append(torch.randn(c.h, device="cuda", generator=gen).requires_grad_())
        options["sinks"] = leaves[-1]
    if with_term and c.term == "softcap":
        options["softcap"] = 50.0

    def call() -> torch.Tensor:
        if c.term == "gemma-2":
            return _gemma2(q, k, v, 50.0 if with_term else None)
        return sdpa(q, k, v, **options)

    def forward() -> Any:
        with torch.no_grad():
            return call()

    def both() -> Any:
        return torch.autograd.grad(call(), leaves, d_out.transpose(1, 2) if c.term == "gemma-2" else d_out)

    return forward, both


def _gemma2(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cap: float | None) -> torch.Tensor:
    from ..integrations.transformers import attention_forward

    return attention_forward(_CausalLayer(), q, k, v, attention_mask=None, scaling=q.shape[-1] ** -0.5, softcap=cap)[0]


class _CausalLayer(torch.nn.Module):
    is_causal = True


def case_row(c: Case) -> dict[str, Any]:
    device = torch.device("cuda", torch.cuda.current_device())
    runs = {"term": _calls(c, True), "plain": _calls(c, False)}
    times: dict[str, list[float]] = {f"{n} {p}": [] for n in runs for p in ("fwd", "fwd+bwd")}
    for round_ in range(ROUNDS):
        for key in round_order(sorted(times), round_):
            name, part = key.split()
            times[key].append(autotune.time_plan(runs[name][part == "fwd+bwd"], device, warmup=2, repeats=5))
    row: dict[str, Any] = {"case": c.name, "shape": _shape(c), "columns": {}}
    for key, values in times.items():
        name, part = key.split()
        ms = statistics.median(values)
        row["columns"].setdefault(name, {})[part] = {
            "ms": ms,
            "tflops": c.flops(part == "fwd+bwd") / (ms * 1e-3) / 1e12,
            "spread_pct": 100.0 * (max(values) - min(values)) / ms,
        }
    for part in ("fwd", "fwd+bwd"):
        row[f"{part} speed"] = row["columns"]["plain"][part]["ms"] / row["columns"]["term"][part]["ms"]
    del runs
    gc.collect()
    torch.cuda.empty_cache()
    return row


def score_term_rows(cases: tuple[Case, ...] = CASES) -> list[dict[str, Any]]:
    rows = []
    for c in progress(cases, "score terms", unit="case"):
        rows.append(case_row(c))
        print(format_row(rows[-1]), flush=True)
    return rows


def _shape(c: Case) -> str:
    window = "" if c.window is None else f" window {c.window}"
    return f"B{c.b} H{c.h}/{c.h_kv} S{c.s} d{c.d}{window}"


def format_row(row: dict[str, Any]) -> str:
    cells = []
    for part in ("fwd", "fwd+bwd"):
        term, plain = row["columns"]["term"][part], row["columns"]["plain"][part]
        cells.append(
            f"{part} {term['ms']:.3f} ms ({term['spread_pct']:.1f}%, {term['tflops']:.0f} TF/s) vs "
            f"{plain['ms']:.3f} ({plain['spread_pct']:.1f}%): {row[f'{part} speed']:.2f}x"
        )
    return f"{row['case']:<14} {row['shape']:<32} " + "; ".join(cells)


def format_score_terms(rows: list[dict[str, Any]]) -> str:
    head = f"score terms against the same call without, bf16 causal ({torch.cuda.get_device_name()})"
    return "\n".join([head, *(format_row(r) for r in rows)])
