"""Builds of recorded graphs, kept by what was recorded.

A ``with Graph()`` block that records exactly what an earlier block recorded (the same ops,
arguments, tensor geometry and aliasing, handle settings and graph options) would validate
the same problems and get the same plans. Its key proves that, so the graph adopts the
earlier build instead: no keyword parsing, assembly, validation or runner construction,
which is what lets code that rebuilds its graph per call pay a few microseconds for it.

Each plan cache keeps its own recorded builds (``PlanCache.recorded``, a ``KeyedCache``) and
forgets them all whenever it drops a plan (eviction or ``clear``), so a recorded build never
holds a plan its cache has let go.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.bounds import value_problems
from ..core.problem import TensorSpec
from ..core.roles import offset_roles
from ..errors import ValidationError
from .handles import InputHandle

if TYPE_CHECKING:
    from ..runtime.runner import Runner
    from .state import Recording

# The Node fields a build sets, which a later identical recording adopts.
_BUILT_FIELDS = (
    "parsed",
    "spelling",
    "paged",
    "kv_cache_layout",
    "deterministic",
    "problem",
    "plan",
    "backend",
    "cache_key",
)
# Integer inputs whose values a build checks where they are given as tensors.
_VALUE_ROLES = frozenset({"seq_len_q", "seq_len_kv", "page_table_k", "page_table_v", *offset_roles()})


@dataclass(frozen=True)
class BuiltNode:
    """One node's share of a build: what ``Node`` fields it had, and which inputs it read."""

    fields: dict[str, Any]  # parsed, spelling, paged, kv_cache_layout, deterministic, problem, plan, ...
    inputs: tuple[tuple[str, str, int], ...]  # (role, "input" | "output", index among those)
    output_specs: tuple[TensorSpec | None, ...]  # in the node's output order
    value_roles: tuple[tuple[str, int], ...]  # integer inputs whose values the build checked: (role, input)


@dataclass(frozen=True)
class InputSource:
    """One run-time input of a build: its handle's name, geometry and first role, and where a
    new recording finds it: its ``index``-th distinct tensor, or its ``index``-th handle made
    with ``Graph.tensor``/``tensor_like`` (``made`` True)."""

    name: str
    spec: TensorSpec
    role: str
    made: bool
    index: int


@dataclass(frozen=True)
class RecordedBuild:
    nodes: tuple[BuiltNode, ...]
    inputs: tuple[InputSource, ...]  # in positional order
    runner: Any  # a Runner to rebind to the new graph's handles
    cache_keys: tuple[Hashable, ...]


def recorded(recording: Recording, runner: Runner) -> RecordedBuild | None:
    """A built recording, for later recordings of the same calls to adopt (None: not kept)."""
    if any(h.receiver is not None for node in recording.nodes for h in node.outputs.values()):
        return None  # kept, its runner would keep the caller's receiving tensors alive with it
    inputs = list(recording.inputs)
    position = {h: i for i, h in enumerate(inputs)}
    outputs = {h: i for i, h in enumerate(h for node in recording.nodes for h in node.outputs.values())}
    sources = []
    for handle in inputs:
        slot = recording.key.slot(handle.template) if handle.made_index is None else handle.made_index
        if slot is None:
            return None
        sources.append(InputSource(handle.name, handle.spec, handle.role, handle.made_index is not None, slot))
    nodes = []
    for node in recording.nodes:
        bound: list[tuple[str, str, int]] = []
        for role, source in node.inputs.items():
            if source in position:
                bound.append((role, "input", position[source]))  # type: ignore[index]
            elif source in outputs:
                bound.append((role, "output", outputs[source]))  # type: ignore[index]
            else:
                return None  # an input outside the positional order: not worth keeping
        fields = {name: getattr(node, name) for name in _BUILT_FIELDS}
        value_roles = tuple((role, i) for role, kind, i in bound if kind == "input" and role in _VALUE_ROLES)
        specs = tuple(h.spec for h in node.outputs.values())
        nodes.append(BuiltNode(fields, tuple(bound), specs, value_roles))
    return RecordedBuild(tuple(nodes), tuple(sources), runner, tuple(n.cache_key for n in recording.nodes))


def adopt(recording: Recording, earlier: RecordedBuild, default_handle: Any) -> Runner:
    """Give ``recording`` ``earlier``'s build (its key proved this recording makes the same one):
    its nodes take the built fields, and the runner returned is ``earlier``'s, rebound."""
    made, tensors = recording.made, recording.key.tensors
    inputs: list[InputHandle] = []
    for source in earlier.inputs:
        if source.made:
            inputs.append(made[source.index])
        else:
            inputs.append(InputHandle(recording, source.name, source.spec, source.role, tensors[source.index]))
            recording.names.add(source.name)
    outputs = [h for node in recording.nodes for h in node.outputs.values()]
    found = []
    for node, built in zip(recording.nodes, earlier.nodes):
        node.__dict__.update(built.fields)
        node.inputs = {role: inputs[i] if kind == "input" else outputs[i] for role, kind, i in built.inputs}
        for output, spec in zip(node.outputs.values(), built.output_specs):
            output.built_spec = spec
        if built.value_roles:  # the values of integer inputs are this recording's own
            data = {role: t for role, i in built.value_roles if (t := inputs[i].template) is not None}
            assert node.problem is not None
            lines = value_problems(node.problem, data)
            found += [f"{node.name}: {line}" if len(recording.nodes) > 1 else line for line in lines]
    recording.inputs = inputs
    recording.calls, recording.interpreted = [], True
    if found:
        raise ValidationError(found, context=recording.name)
    return earlier.runner.rebound(recording.name, inputs, outputs, default_handle)
