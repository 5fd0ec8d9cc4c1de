"""A score modifier (``core/score_mod.py``) replayed on the frontend's graph: the ``score_mod`` and
``score_mod_bprop`` callbacks its ``sdpa`` and ``sdpa_backward`` call while lowering.

The frontend calls ``score_mod`` with its own graph and the scaled scores, and (backward) later
``score_mod_bprop`` with dS; both replays of one lowering share one table of built nodes, so a
bprop that reads a forward node (soft-capping's value before its tanh) gets the very tensor the
forward built. A graph lowered again (after a rejected lowering) starts a table of its own: nodes
of the C++ graph it dropped must not reach the new one.

The frontend (1.32) hands each callback its C++ graph behind a shim whose tensor-lowering
function holds that graph, and the C++ graph holds the callback: a cycle through C++ that
Python's collector cannot see, so every graph with a score modifier outlived its plan (and
nanobind reported the leak at exit). ``release``, run once the frontend graph is gone (with its
plan), empties that function's hold on the C++ graph and our table, and the C++ graph is freed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ...core.score_mod import OPS, Expr, ScoreModifier
from . import frontend_internals
from .dtypes import cudnn_dtype


class Callbacks(NamedTuple):
    """What ``sdpa``/``sdpa_backward`` take (``bprop`` None when the modifier has none), and
    ``release``: called once the frontend graph is gone, it lets the C++ graph be freed."""

    forward: Callable
    bprop: Callable | None
    release: Callable[[], None]


def callbacks(mod: ScoreModifier, inputs: Sequence[Any]) -> Callbacks:
    """The frontend's callbacks for ``mod``; ``inputs``: the graph tensors of the modifier's
    ``input`` leaves, in order."""
    # One table of built nodes (by value: a tree read back from JSON shares no objects) per
    # lowering, keyed by the frontend's tensor-lowering function; callbacks handed no such
    # function (another frontend) share one table, as every lowering did before.
    tables: list[tuple[Any, dict[Expr, Any]]] = []

    def table_of(graph: Any) -> dict[Expr, Any]:
        lowering = frontend_internals.callback_lowering(graph)
        for seen, built in tables:
            if seen is lowering:
                return built
        tables.append((lowering, {}))
        return tables[-1][1]

    def replay(graph: Any, root: Expr, leaves: dict[str, Any]) -> Any:
        import cudnn

        built = table_of(graph)
        for node in root.nodes():
            if node in built:
                continue
            if node.op in leaves:
                built[node] = leaves[node.op]
                continue
            if node.op == "input":
                assert isinstance(node.value, int)
                built[node] = inputs[node.value]
                continue
            if node.op == "constant":
                scalar = graph.tensor_scalar(float(node.value or 0.0), cudnn.scalar_type.RUNTIME_PARAM)
                built[node] = scalar
                continue
            args = {name: built[a] for name, a in zip(OPS[node.op], node.args)}
            extra: dict[str, Any] = {}
            if node.compute is not None:
                extra["compute_data_type"] = cudnn_dtype(node.compute)
            if node.op == "gen_index":
                out = graph.gen_index(args["input"], int(node.value or 0), **extra)
            else:
                out = getattr(graph, node.op)(**args, **extra)
            if node.dtype is not None:
                out.set_data_type(cudnn_dtype(node.dtype))
            built[node] = out
        return built[root]

    def score_mod(graph: Any, scores: Any) -> Any:
        return replay(graph, mod.forward, {"score": scores})

    def release() -> None:
        for lowering, _ in tables:
            if lowering is not None:
                frontend_internals.forget_lowered_graph(lowering)
        tables.clear()

    backward = mod.backward
    if backward is None:
        return Callbacks(score_mod, None, release)

    def score_mod_bprop(graph: Any, grad: Any) -> Any:
        return replay(graph, backward, {"grad": grad})

    return Callbacks(score_mod, score_mod_bprop, release)
