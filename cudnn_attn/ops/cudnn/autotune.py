"""Autotuning: build every candidate plan, time each on the device, keep the fastest.

Each candidate runs on the same fresh random inputs: a few warm-up runs, then timed
repetitions between CUDA events; the median decides. The chosen plan's engine and knobs are
recorded so the choice can be stored and replayed without tuning again.
"""

from __future__ import annotations

import functools
import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import ValidationError

log = logging.getLogger("cudnn_attn.autotune")

ENV = "CUDNN_ATTN_AUTOTUNE"
WARMUP = 3
REPEATS = 20
ROUNDS = 5
MARGIN = 0.03  # a challenger must beat the heuristic's pick by 3% (run-to-run noise here) to replace it


_default: bool | None = None

# How cuDNN and the CUDA runtime word an allocation that failed (torch raises its own class).
_OUT_OF_MEMORY = ("out of memory", "alloc_failed", "cudaerrormemoryallocation", "cuda_error_out_of_memory")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is the GPU out of memory: torch's ``OutOfMemoryError``, or cuDNN's
    own failed allocation (a status in the frontend's message)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error).lower()
    return any(mark in text for mark in _OUT_OF_MEMORY)


def set_autotune(enabled: bool | None) -> None:
    """Autotune every graph that does not say otherwise (``Graph(autotune=None)``).

    Tuning times every candidate cuDNN plan at build on fresh random inputs and keeps the
    fastest; it costs build time and changes nothing on the reference backend.

    Args:
        enabled: True or False; None goes back to ``CUDNN_ATTN_AUTOTUNE`` (``1`` turns it on).

    Example:
        ```python
        import cudnn_attn

        cudnn_attn.set_autotune(True)
        cudnn_attn.set_autotune(None)  # back to the environment's choice
        ```
    """
    global _default
    if enabled is not None and not isinstance(enabled, bool):  # bool("no") is True
        raise ValidationError([f"enabled: {enabled!r}; expected True, False or None"], context="set_autotune")
    _default = enabled


def enabled_by_default() -> bool:
    """``set_autotune(True)`` or ``CUDNN_ATTN_AUTOTUNE=1`` turn tuning on for graphs that do not say."""
    if _default is not None:
        return _default
    return _env_on(os.environ.get(ENV, ""))


@functools.lru_cache(maxsize=8)
def _env_on(raw: str) -> bool:  # parsed once per spelling: graphs read it on every construction
    return raw.strip().lower() in ("1", "true", "yes", "on")


@dataclass
class Choice:
    """The plan a build settled on, and how."""

    index: int
    name: str
    engine_id: int | None = None
    knobs: dict[str, int] = field(default_factory=dict)
    tuned: bool = False
    timings_ms: dict[str, float] = field(default_factory=dict)  # candidate name -> median ms
    tuning_seconds: float = 0.0

    def as_record(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "engine_id": self.engine_id,
            "knobs": self.knobs,
            "tuned": self.tuned,
            "timings_ms": self.timings_ms,
            "tuning_seconds": self.tuning_seconds,
        }


def engine_and_knobs(graph: Any, index: int) -> tuple[int | None, dict[str, int]]:
    try:
        engine_id, knobs = graph.get_engine_and_knobs_at_index(index)
    except Exception:  # some candidates delegate to the backend's own choice
        return None, {}
    return int(engine_id), {getattr(k, "name", str(k)): int(v) for k, v in (knobs or {}).items()}


def time_plan(run, device: torch.device, warmup: int = WARMUP, repeats: int = REPEATS) -> float:
    """Median milliseconds of ``run()`` on ``device``'s current stream."""
    for _ in range(warmup):
        run()
    stream = torch.cuda.current_stream(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for start, end in zip(starts, ends):
        start.record(stream)
        run()
        end.record(stream)
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def tune(graph: Any, pack: dict[int, Any], handle: Any, device: torch.device, label: str) -> Choice:
    """Time every buildable candidate of ``graph`` (already planned) and select the fastest.

    Two phases: every candidate once, then the three fastest and the heuristic's own pick
    (index 0) again in interleaved rounds, best median of the rounds. The heuristic's pick
    stays unless a challenger beats it by more than ``MARGIN``: timings are noisy, and a
    choice made on noise can be slower than the heuristic's.
    """
    started = time.perf_counter()
    count = graph.get_execution_plan_count()
    runs: dict[int, Any] = {}
    names: dict[int, str] = {}
    first: dict[int, float] = {}
    progress = _progress(count, label)
    for index in range(count):
        progress.update(1)
        try:
            graph.build_plan_at_index(index)
            size = graph.get_workspace_size_plan_at_index(index)
            workspace = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
            names[index] = graph.get_plan_name_at_index(index)
            runs[index] = lambda i=index, w=workspace: graph.execute_plan_at_index(pack, w, i, handle)
            first[index] = time_plan(runs[index], device, repeats=REPEATS // 2)
        except Exception as error:  # a candidate that cannot build or run here is skipped
            if is_out_of_memory(error):
                # Not this candidate's fault: a choice made among the ones that fit now would be
                # stored and replayed when memory is free again. The build fails; the next tunes afresh.
                raise
            runs.pop(index, None)
            log.debug(
                "autotune %s: candidate %d skipped: %s",
                label,
                index,
                str(error).splitlines()[0] if str(error) else error,
            )
    progress.close()
    if not first:
        raise RuntimeError(f"autotune {label}: none of {count} candidate plans could be built and run")
    finalists = sorted(first, key=first.__getitem__)[:3]
    default = min(first)  # the heuristic's own pick: the first candidate that built
    if default not in finalists:
        finalists.append(default)
    best_ms = dict.fromkeys(finalists, float("inf"))
    for round_ in range(ROUNDS):
        for index in finalists[round_ % len(finalists) :] + finalists[: round_ % len(finalists)]:
            best_ms[index] = min(best_ms[index], time_plan(runs[index], device))
    best = min(best_ms, key=best_ms.__getitem__)
    if best_ms[best] * (1 + MARGIN) >= best_ms[default]:
        best = default
    graph.build_plan_at_index(best)  # selects it for execute()
    engine_id, knobs = engine_and_knobs(graph, best)
    timings = {names[i]: round(t, 5) for i, t in first.items()}
    timings.update({names[i]: round(t, 5) for i, t in best_ms.items()})
    choice = Choice(
        index=best,
        name=names[best],
        engine_id=engine_id,
        knobs=knobs,
        tuned=True,
        timings_ms=timings,
        tuning_seconds=time.perf_counter() - started,
    )
    log.debug(  # debug: at info, the plan's own line says "tuned" with the engine and seconds
        "autotune %s: %d candidates in %.2fs; best %s (%.4f ms)",
        label,
        len(first),
        choice.tuning_seconds,
        choice.name,
        best_ms[best],
    )
    return choice


def _progress(total: int, label: str) -> Any:
    """A progress bar on a terminal (tuning can take seconds), silent otherwise."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional
        return _Silent()
    return tqdm(total=total, desc=f"autotune {label}", unit="plan", leave=False, disable=None)


class _Silent:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass
