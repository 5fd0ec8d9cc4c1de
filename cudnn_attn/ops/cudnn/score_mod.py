"""A score modifier (``core/score_mod.py``) replayed on the frontend's graph: the ``score_mod`` and
``score_mod_bprop`` callbacks its ``sdpa`` and ``sdpa_backward`` call while lowering.

The frontend calls ``score_mod`` with its own graph and the scaled scores, and (backward) later
``score_mod_bprop`` with dS; both replays share one table of built nodes, so a bprop that reads a
forward node (soft-capping's value before its tanh) gets the very tensor the forward built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ...core.score_mod import OPS, Expr, ScoreModifier
from .dtypes import cudnn_dtype


def callbacks(mod: ScoreModifier, inputs: Sequence[Any]) -> tuple[Callable, Callable | None]:
    """``(score_mod, score_mod_bprop)`` for the frontend; ``inputs``: the graph tensors of the
    modifier's ``input`` leaves, in order. The bprop is None when the modifier has none."""
    built: dict[Expr, Any] = {}  # by value: a tree read back from JSON shares no objects

    def replay(graph: Any, root: Expr, leaves: dict[str, Any]) -> Any:
        import cudnn

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

    backward = mod.backward
    if backward is None:
        return score_mod, None

    def score_mod_bprop(graph: Any, grad: Any) -> Any:
        return replay(graph, backward, {"grad": grad})

    return score_mod, score_mod_bprop
