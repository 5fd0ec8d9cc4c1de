"""The frontend's run-time geometry: ``execute(..., override_uids=, override_shapes=, override_strides=)``.

A graph made with ``is_override_shape_enabled=True`` may run on tensors whose dims and strides
differ from those it was built with (THD code builds one graph for a batch and overrides each
run's longest sequence). Here each distinct override is its own problem: validated like any
other, its plan taken from the plan cache, and a runner for it kept on the graph, so a repeated
override costs a dict lookup.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from ..core import validation
from ..core.problem import TensorSpec
from ..errors import ShapeMismatchError, ValidationError
from ..recording.handles import ints_or_problem
from ..recording.node import Node
from ..runtime import planner
from ..runtime.runner import Runner
from .declared import resolve
from .port import GraphPort


class StandIn:
    """A graph tensor as one override sees it: its name and offsets, the overridden geometry."""

    def __init__(self, handle: Any, spec: TensorSpec | None):
        self.name, self.spec = handle.name, spec
        self.is_output = getattr(handle, "is_output", False)
        self.ragged_offset = getattr(handle, "ragged_offset", None)
        self.receiver = getattr(handle, "receiver", None)  # the caller's tensor: it must still fit
        if self.receiver is not None and spec != handle.spec:
            raise ValidationError(
                [
                    f"{handle.name}: the override changes the geometry of the tensor given to receive it "
                    "(written otherwise into a temporary); record the graph with a receiver of the new geometry"
                ]
            )


def overridden_runner(
    graph: GraphPort, runners: dict[Hashable, Any], uids: Any, shapes: Any, strides: Any
) -> tuple[Runner, dict[Any, Any]] | None:
    """The runner for this override and the graph's handles -> its own, made on first use and
    kept in ``runners``; None when the override changes nothing. Bad overrides raise
    ``ValidationError`` naming the argument."""
    specs = _overridden_specs(graph, uids, shapes, strides)
    if all(handle.spec == spec for handle, spec in specs.items()):
        return None
    key = ("override", *[(handle.get_uid(), spec.shape, spec.stride) for handle, spec in specs.items()])
    if key not in runners:
        runners[key] = _runner(graph, specs)
    return runners[key]


def _overridden_specs(graph: GraphPort, uids: Any, shapes: Any, strides: Any) -> dict[Any, TensorSpec]:
    if not graph.is_override_shape_enabled:
        raise ValidationError(
            ["override_uids: this graph was made without is_override_shape_enabled=True"], context=graph.name
        )
    lists = {"override_uids": uids, "override_shapes": shapes, "override_strides": strides}
    problems = [
        f"{name}: {type(v).__name__}; expected a list"
        for name, v in lists.items()
        if not isinstance(v, Sequence) or isinstance(v, str)
    ]
    if not problems and not len(uids) == len(shapes) == len(strides):
        problems.append(f"override_uids: {len(uids)} uids for {len(shapes)} shapes and {len(strides)} strides")
    if problems:
        raise ValidationError(problems, context=graph.name)
    specs: dict[Any, TensorSpec] = {}
    for uid, shape, stride in zip(uids, shapes, strides):
        handle = resolve(graph.recording, uid)
        if handle is None or handle.spec is None:
            problems.append(f"override_uids: {uid!r} is not a tensor of this graph")
            continue
        spec = handle.spec
        dims = ints_or_problem(shape, f"override_shapes[{uid}]", problems)
        steps = ints_or_problem(stride, f"override_strides[{uid}]", problems)
        if dims is None or steps is None:
            continue
        if len(dims) != spec.rank:
            problems.append(f"override_shapes[{uid}]: {list(dims)}; {handle.name} has {spec.rank} dims")
            continue
        if len(steps) == spec.rank - 1 and handle.ragged_offset is not None:
            # The packed [T, H, D] tensor's own strides: tokens, heads, elements (its batch stride is unused).
            steps = (spec.stride[0], steps[1], steps[0], *steps[2:])
        if len(steps) != spec.rank:
            problems.append(f"override_strides[{uid}]: {list(steps)}; {handle.name} has {spec.rank} dims")
            continue
        specs[handle] = dataclasses.replace(spec, shape=dims, stride=steps)
    if problems:
        raise ValidationError(problems, context=graph.name)
    return specs


def _runner(graph: GraphPort, specs: dict[Any, TensorSpec]) -> tuple[Runner, dict[Any, Any]]:
    """Each node's problem with the overridden geometry, validated and planned; handles stand-ins
    carry the new specs (the runner checks every run's tensors against them)."""
    stand_in: dict[Any, Any] = {}
    nodes: list[Node] = []
    found: list[str] = []
    for node in graph.nodes:
        assert node.problem is not None, "a built graph's nodes have their problems"
        changes: dict[str, Any] = {role: specs[h] for role, h in {**node.inputs, **node.outputs}.items() if h in specs}
        problem = dataclasses.replace(node.problem, **changes)
        lines = validation.problems(problem)
        if lines:
            found += lines
            continue
        for role, handle in node.outputs.items():
            if handle not in stand_in:
                stand_in[handle] = StandIn(handle, getattr(problem, role, None))
        for read in node.inputs.values():
            if read not in stand_in:
                stand_in[read] = StandIn(read, specs.get(read, read.spec))
        planned = planner.plan(problem, graph.backend, graph.autotune, graph.cache)
        nodes.append(
            dataclasses.replace(
                node,
                problem=problem,
                plan=planned.plan,
                inputs={role: stand_in[h] for role, h in node.inputs.items()},
                outputs={role: stand_in[h] for role, h in node.outputs.items()},
            )
        )
    if found:
        raise ValidationError([f"with the overrides: {line}" for line in found], context=graph.name)
    inputs = [stand_in[h] for h in graph.recording.inputs]
    return Runner(graph.name, inputs, nodes, graph.handle), stand_in


def check_overridden(given: Mapping[Any, Any], stand_in: Mapping[Any, Any], context: str) -> None:
    """``ShapeMismatchError`` for each tensor whose dims or strides are not those this run's
    override gives it, said as such (the runner's check speaks of the geometry the graph was
    built for; it checks the dtype and device, and the tensors no override touches)."""
    found = []
    for handle, tensor in given.items():
        spec = stand_in[handle].spec if handle in stand_in else None
        if spec is None or spec == handle.spec or handle.ragged_offset is not None or type(tensor) is not torch.Tensor:
            continue
        uid = handle.get_uid()
        if tuple(tensor.shape) != spec.shape:
            found.append(f"{handle.name}: shape {list(tensor.shape)}; override_shapes[{uid}] gives {list(spec.shape)}")
        elif any(n != 1 and a != b for n, a, b in zip(spec.shape, tensor.stride(), spec.stride)):
            found.append(
                f"{handle.name}: strides {list(tensor.stride())}; override_strides[{uid}] gives {list(spec.stride)}"
            )
    if found:
        raise ShapeMismatchError(found, context=context)
