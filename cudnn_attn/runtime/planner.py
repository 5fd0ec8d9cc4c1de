"""A problem's plan: its backend chosen, the plan taken from the plan cache or built on a miss.

The one place a plan-cache key is made. Whatever asks for a plan (a graph's node at build, a
prepared run of ``prepare.py``) gets it here, so one problem is one key and one plan.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from .. import log
from ..core.problem import AttentionProblem
from ..ops import get_backend, select
from ..ops.base import Plan
from . import backend_choice


@dataclass(frozen=True)
class Planned:
    """A problem's plan, the backend that runs it and its key in the plan cache."""

    plan: Plan
    backend: str
    cache_key: Hashable


def plan(problem: AttentionProblem, backend: str, autotune: bool, cache: Any) -> Planned:
    """``problem``'s plan on ``backend`` (a name of ``ops.BACKEND_NAMES``; "auto" takes an enclosing
    ``cudnn_attn.backend(...)`` block's choice) through ``cache`` (a ``PlanCache``). Raises
    ``UnsupportedError`` when the backend cannot run the problem."""
    chosen = select(problem, backend_choice.resolve(backend))
    tune = autotune and chosen.tunable
    planned = problem.for_plan()  # packed tensors' token counts do not split plans
    key = (chosen.name, chosen.plan_key(planned), planned, tune)
    start = time.perf_counter()
    made, built = cache.obtain(key, functools.partial(chosen.build, planned, autotune=tune, store=cache.store))
    if log.logger.isEnabledFor(logging.INFO):
        source, engine = origin(made, chosen.name) if built else ("memory", _engine(made, chosen.name))
        if built and chosen.stores_plans and cache.store is None and (why := cache.store_unused_reason()):
            log.store_unused(why)
        log.plan(planned, chosen.name, source, engine, time.perf_counter() - start)
    return Planned(made, chosen.name, key)


def origin(made: Any, backend: str) -> tuple[str, str]:
    """Where a plan this process just obtained came from (built, tuned or disk), and its engine."""
    source = getattr(made, "source", "built")
    choice = getattr(made, "choice", None)
    if source == "built" and getattr(choice, "tuned", False):
        source = "tuned"
    return source, _engine(made, backend)


def _engine(made: Any, backend: str) -> str:
    """The cuDNN engine (and knobs) where the plan knows it; the backend's name otherwise."""
    return getattr(made, "engine", None) or backend


def restore(problem: AttentionProblem, backend: str, blob: bytes) -> Planned:
    """The plan a serialized graph holds (``backend``'s ``to_blob``), ready to run: not taken
    from or put in the plan cache (it is this graph's own, as the frontend's deserialize gives)."""
    chosen = get_backend(backend)
    return Planned(chosen.from_blob(problem, blob), chosen.name, None)


def to_blob(planned_backend: str, plan: Plan) -> bytes:
    return get_backend(planned_backend).to_blob(plan)
