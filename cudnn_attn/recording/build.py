"""Building a recorded graph: nodes to problems, problems to plans, plans to a runner.

A pure step over the nodes: every node's problem is assembled and validated (all problems
of all nodes raised together in one ``ValidationError``), then each problem's backend is
chosen and its plan taken from the plan cache, built on a miss.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from .. import log
from ..cache import PlanCache
from ..core import validation
from ..errors import UnsupportedError, ValidationError
from ..ops import select_backend
from .assembly import assemble_problem, missing_inputs
from .handles import InputHandle
from .node import Node


def validate_nodes(nodes: Sequence[Node], dtypes: dict[str, torch.dtype | None], context: str) -> None:
    """Assemble and validate each node's problem; raise every problem found at once."""
    if not nodes:
        raise ValidationError(["graph: no ops were recorded; call g.sdpa(...) inside the `with` block"])
    found: list[str] = []
    prefix = len(nodes) > 1
    for node in nodes:
        problem = assemble_problem(node, dtypes)
        lines = list(node.errors)
        if problem is None:
            lines += [line for line in missing_inputs(node) if line not in lines]
            if not lines:
                lines = ["inputs: an input comes from a node that failed"]
        else:
            # Structural problems are reported alongside argument errors: all problems at once.
            lines += [line for line in validation.problems(problem) if line not in lines]
            if not lines:
                lines += validation.value_problems(problem, _templates(node))
            node.problem = problem
            for role, handle in node.outputs.items():
                handle._spec = getattr(problem, role)
        found += [f"{node.name}: {line}" if prefix else line for line in lines]
    if found:
        raise ValidationError(found, context=context)


def plan_nodes(nodes: Sequence[Node], backend: str, autotune: bool, cache: PlanCache, context: str) -> None:
    """Give every (validated) node its plan; raise every node's unsupported reasons at once."""
    reasons: list[str] = []
    alternatives: list[str] = []
    prefix = len(nodes) > 1
    for node in nodes:
        problem = node.problem
        assert problem is not None, "plan_nodes runs after validate_nodes"
        try:
            chosen = select_backend(backend, problem)
        except UnsupportedError as error:
            reasons += [f"{node.name}: {r}" if prefix else r for r in error.problems]
            alternatives = error.alternatives
            continue
        tune = autotune and chosen.name == "cudnn"  # the reference has nothing to tune
        planned = problem.for_plan()  # packed tensors' token counts do not split plans
        key = (chosen.name, chosen.plan_key(planned), planned, tune)
        node.backend = chosen.name
        node.cache_key = key
        start = time.perf_counter()
        plan, built = cache.obtain(key, functools.partial(chosen.build, planned, autotune=tune, store=cache.store))
        node.plan = plan
        if log.logger.isEnabledFor(logging.INFO):
            source, engine = origin(plan, chosen.name) if built else ("memory", _engine(plan, chosen.name))
            if built and chosen.name == "cudnn" and cache.store is None and (why := cache.store_unused_reason()):
                log.store_unused(why)
            log.plan(planned, chosen.name, source, engine, time.perf_counter() - start)
    if reasons:
        raise UnsupportedError(reasons, context=context, alternatives=alternatives)


def origin(plan: Any, backend: str) -> tuple[str, str]:
    """Where a plan this process just obtained came from (built, tuned or disk), and its engine."""
    source = getattr(plan, "source", "built")
    choice = getattr(plan, "choice", None)
    if source == "built" and getattr(choice, "tuned", False):
        source = "tuned"
    return source, _engine(plan, backend)


def _engine(plan: Any, backend: str) -> str:
    """The cuDNN engine (and knobs) where the plan knows it; the backend's name otherwise ("reference")."""
    return getattr(plan, "engine", None) or backend


def positional_inputs(nodes: Sequence[Node]) -> list[InputHandle]:
    """The graph's run-time inputs: distinct input tensors, node by node, each node's in the
    order of its method's parameters (outputs of earlier nodes are not inputs)."""
    ordered: dict[InputHandle, None] = {}
    for node in nodes:
        for role in node.positional:
            handle = node.inputs.get(role)
            if isinstance(handle, InputHandle):
                ordered.setdefault(handle, None)
    return list(ordered)


def _templates(node: Node) -> dict[str, Any]:
    """The data of the node's template inputs, for build-time value checks."""
    return {
        role: h.template for role, h in node.inputs.items() if isinstance(h, InputHandle) and h.template is not None
    }
