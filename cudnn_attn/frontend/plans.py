"""The frontend's plan helpers: the candidate plans of a one-node graph, in cuDNN's ranking
(``get_execution_plan_count``, ``get_plan_name_at_index``, ``execute_plan_at_index``, ...).

The reference backend has one candidate. A candidate other than the chosen plan is built when
first run by index, and its runner kept in the graph's table of other runners.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

from ..errors import UnsupportedError, ValidationError
from ..recording.node import Node
from ..recording.state import Recording
from ..runtime.runner import Runner
from .port import GraphPort


def count(recording: Recording) -> int:
    """How many candidate plans every node has: 0 until the graph is built."""
    if not recording.built:
        return 0
    return min(node.plan.plan_count() if node.plan is not None else 0 for node in recording.nodes)


def workspace_size(graph: GraphPort) -> int:
    """The largest workspace, in bytes, of the graph's plans (the graph built first)."""
    graph.build()
    return max((getattr(node.plan, "workspace_size", 0) for node in graph.nodes), default=0)


def name_at(graph: GraphPort, index: Any) -> str:
    """The engine name of candidate plan ``index`` of a one-node graph."""
    return _planned(_single(graph, "get_plan_name_at_index")).plan_name_at(_index(graph, index))


def workspace_at(graph: GraphPort, index: Any) -> int:
    """The workspace, in bytes, of candidate plan ``index`` of a one-node graph."""
    return _planned(_single(graph, "get_workspace_size_plan_at_index")).at_index(_index(graph, index)).workspace_size


def runner_at(graph: GraphPort, runners: dict[Hashable, Any], index: Any) -> Runner:
    """The runner of candidate plan ``index`` of a one-node graph, made on first use and kept in ``runners``."""
    node = _single(graph, "execute_plan_at_index")
    index = _index(graph, index)
    if ("index", index) not in runners:
        indexed = dataclasses.replace(node, plan=_planned(node).at_index(index))
        runners["index", index] = Runner(graph.name, graph.recording.inputs, [indexed], graph.handle)
    return runners["index", index]


def _planned(node: Node) -> Any:
    assert node.plan is not None, "a built node has its plan"
    return node.plan


def _single(graph: GraphPort, method: str) -> Node:
    """The graph's one node, built: plan indices address one node's candidates."""
    graph.build()
    if len(graph.nodes) != 1:
        reason = f"{method}: this graph has {len(graph.nodes)} nodes, each with its own candidate plans"
        raise UnsupportedError([f"{reason}; plan indices address a one-node graph"], context=graph.name)
    return graph.nodes[0]


def _index(graph: GraphPort, index: Any) -> int:
    found = count(graph.recording)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < found:
        line = f"index: {index!r}; this graph has {found} candidate plan(s), 0..{found - 1}"
        raise ValidationError([line], context=graph.name)
    return index
