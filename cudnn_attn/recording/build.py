"""Building a recorded graph: nodes to problems, problems to plans, plans to a runner.

A recording that repeats an earlier one adopts its build (``reuse.py``). Otherwise a pure step
over the nodes: every node's problem is assembled and validated (all problems of all nodes
raised together in one ``ValidationError``), then each problem's plan is taken through the
runtime's planner (backend chosen, plan from the plan cache, built on a miss).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..cache import PlanCache
from ..core import bounds, validation
from ..errors import UnsupportedError, ValidationError
from ..runtime import planner
from ..runtime.runner import Runner
from . import interpret, reuse
from .assembly import assemble_problem, missing_inputs
from .handles import InputHandle
from .node import Node
from .pairing import pairing_problems
from .state import Recording


def runner_for(
    recording: Recording,
    dtypes: dict[str, torch.dtype | None],
    backend: str,
    autotune: bool,
    cache: PlanCache,
    handle: Any,
) -> Runner:
    """The runner of ``recording``'s plans: an identical earlier recording's build adopted, or
    every call interpreted, validated and planned (and that build kept for the next)."""
    # A build that failed validation has interpreted its calls already: it is built in full again.
    key = None if recording.interpreted else recording.key.key(recording)
    earlier = cache.recorded.get(key) if key is not None else None
    if earlier is not None and cache.touch(earlier.cache_keys):
        return reuse.adopt(recording, earlier, handle)
    interpret.interpret_calls(recording)
    validate_nodes(recording.nodes, dtypes, recording.name, frontend_rules=recording.frontend_rules)
    plan_nodes(recording.nodes, backend, autotune, cache, recording.name)
    recording.inputs = positional_inputs(recording.nodes)
    runner = Runner(recording.name, recording.inputs, recording.nodes, handle)
    recorded = reuse.recorded(recording, runner) if key is not None else None
    if recorded is not None:
        cache.recorded.put(key, recorded)
    return runner


def validate_nodes(
    nodes: Sequence[Node], dtypes: dict[str, torch.dtype | None], context: str, *, frontend_rules: bool = False
) -> None:
    """Assemble and validate each node's problem; raise every problem found at once.
    ``frontend_rules``: the frontend's graph (an omitted attn_scale is no scaling)."""
    if not nodes:
        raise ValidationError(["graph: no ops were recorded; call g.sdpa(...) inside the `with` block"])
    found: list[str] = []
    prefix = len(nodes) > 1
    valid: list[Node] = []  # nodes whose problems passed, for the checks across nodes
    for node in nodes:
        if node.parsed is not None and node.parsed.unsupported:
            continue  # what is not run here is refused as unsupported (plan_nodes), not judged as invalid
        problem = assemble_problem(node, dtypes, frontend_rules=frontend_rules)
        lines = list(node.errors)
        if problem is None:
            named = {line.split(":")[0] for line in lines}  # an argument refused already is not also missing
            lines += [line for line in missing_inputs(node) if line.split(":")[0] not in named]
            if not lines:
                lines = ["inputs: an input comes from a node that failed"]
        else:
            # Structural problems are reported alongside argument errors: all problems at once.
            lines += [line for line in validation.problems(problem) if line not in lines]
            if not lines:
                lines += bounds.value_problems(problem, _templates(node))
            node.problem = problem
            if not lines:
                lines += pairing_problems(node, valid)
            if not lines:
                valid.append(node)
            for role, handle in node.outputs.items():
                handle.built_spec = getattr(problem, role)
        found += [f"{node.name}: {line}" if prefix else line for line in lines]
    if found:
        raise ValidationError(found, context=context)


def plan_nodes(nodes: Sequence[Node], backend: str, autotune: bool, cache: PlanCache, context: str) -> None:
    """Give every (validated) node its plan; raise every node's unsupported reasons at once."""
    reasons: list[str] = []
    alternatives: list[str] = []
    prefix = len(nodes) > 1
    for node in nodes:
        if node.parsed is not None and node.parsed.unsupported:  # valid keywords this library cannot run yet
            reasons += [f"{node.name}: {r}" if prefix else r for r in node.parsed.unsupported]
            continue
        assert node.problem is not None, "plan_nodes runs after validate_nodes"
        try:
            planned = planner.plan(node.problem, backend, autotune, cache)
        except UnsupportedError as error:
            reasons += [f"{node.name}: {r}" if prefix else r for r in error.problems]
            alternatives = error.alternatives
            continue
        node.plan, node.backend, node.cache_key = planned.plan, planned.backend, planned.cache_key
    if reasons:
        raise UnsupportedError(reasons, context=context, alternatives=alternatives)


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
