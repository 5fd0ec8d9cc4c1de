"""Tracing the frontend's ``score_mod`` / ``score_mod_bprop`` callbacks into a ``ScoreModifier``.

The frontend calls ``score_mod(graph, scores)`` with a graph whose pointwise ops build a subgraph
on the scores; here the callback gets a ``ScoreGraph``: the same ops by the same names and
parameters (``graph.tanh(input=...)``, ``graph.binary_select(input0=, input1=, mask=)``,
``graph.gen_index(input=, axis=)``, ``graph.tensor_scalar(value, scalar_type)``), each returning
a ``ScoreTensor`` with the frontend tensor's setters. An op's arguments may be those tensors, the
graph's own tensors (read at each run: a pass-by-value scalar, per-sequence lengths, ...) or
Python numbers. A callback is traced once, when its op is interpreted at build; what it records
becomes ``core.score_mod`` data, checked and keyed like every other problem field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..core.dtypes import to_torch_dtype
from ..core.score_mod import GRAD, MAX_INPUTS, OPS, SCORE, Expr, ScoreModifier
from ..errors import UnsupportedError, ValidationError
from ..runtime import interop
from .handles import TensorHandle


class ScoreTensor:
    """A tensor of a score modifier's subgraph; setters chain, as the frontend's do."""

    def __init__(self, op: str, args: tuple[Any, ...] = (), value: Any = None, compute: Any = None, name: str = ""):
        self.op, self.args, self.value, self.compute, self.name = op, args, value, compute, name
        self.dtype: torch.dtype | None = None

    def set_data_type(self, data_type: Any) -> ScoreTensor:
        try:
            self.dtype = to_torch_dtype(data_type, f"{self.name or self.op}.set_data_type")
        except TypeError as error:
            raise ValidationError([str(error)]) from None
        return self

    def get_data_type(self) -> torch.dtype | None:
        return self.dtype

    def set_name(self, name: str) -> ScoreTensor:
        self.name = str(name)
        return self

    def get_name(self) -> str:
        return self.name

    def set_output(self, value: bool) -> ScoreTensor:
        if value:
            raise UnsupportedError(
                [
                    f"{self.name or self.op}: a score modifier's tensors stay inside the fused "
                    "attention; they cannot be graph outputs"
                ]
            )
        return self

    def set_is_virtual(self, value: bool) -> ScoreTensor:
        return self

    def __repr__(self) -> str:
        return f"<ScoreTensor {self.name or self.op}>"


class ScoreGraph:
    """What a ``score_mod`` callback receives: the frontend's pointwise ops on the scores."""

    def __init__(self, owner: Any):
        self._owner = owner  # the recording: graph tensors of another graph are refused
        self.inputs: list[Any] = []  # graph tensors (or tensors) read at each run, in first-use order

    def _arg(self, value: Any, where: str) -> Any:
        if isinstance(value, ScoreTensor):
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if isinstance(value, TensorHandle) and value.recording is not self._owner:
                raise ValidationError([f"{where}: a tensor of another graph"])
            if not isinstance(value, TensorHandle) and interop.as_torch(value) is None:
                raise ValidationError(
                    [
                        f"{where}: {type(value).__name__}; expected a tensor of the score "
                        "modifier, a tensor of this graph or a number"
                    ]
                )
            for i, known in enumerate(self.inputs):
                if known is value:
                    return ScoreTensor("input", value=i)
            self.inputs.append(value)
            return ScoreTensor("input", value=len(self.inputs) - 1)
        if value != value:
            raise ValidationError([f"{where}: NaN; a score modifier's constants are numbers"])
        return ScoreTensor("constant", value=float(value))

    def _op(self, name: str, given: tuple, keywords: dict[str, Any], compute: Any, label: str) -> ScoreTensor:
        params = OPS[name]
        if len(given) > len(params):
            raise ValidationError([f"{name}: takes {len(params)} tensors ({', '.join(params)}); got {len(given)}"])
        bound = dict(zip(params, given))
        for key, value in keywords.items():
            if key not in params or key in bound:
                raise ValidationError([f"{name}: unexpected argument {key!r}; it takes {', '.join(params)}"])
            bound[key] = value
        missing = [p for p in params if p not in bound]
        if missing:
            raise ValidationError([f"{name}: missing {', '.join(missing)}"])
        try:
            compute_dtype = to_torch_dtype(compute, f"{name}.compute_data_type")
        except TypeError as error:
            raise ValidationError([str(error)]) from None
        args = tuple(self._arg(bound[p], f"{name}.{p}") for p in params)
        return ScoreTensor(name, args, compute=compute_dtype, name=label)

    def gen_index(self, input: Any, axis: int, name: str = "", compute_data_type: Any = None) -> ScoreTensor:
        out = self._op("gen_index", (input,), {}, compute_data_type, name)
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise ValidationError([f"gen_index.axis: {axis!r}; expected 0-3 (B, H, S_q, S_kv)"])
        out.value = axis
        return out

    def tensor_scalar(self, value: Any, scalar_type: Any = None, name: str = "") -> ScoreTensor:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise ValidationError([f"tensor_scalar: {value!r}; expected a number"])
        return ScoreTensor("constant", value=float(value), name=name)

    def __getattr__(self, name: str) -> Callable[..., ScoreTensor]:
        if name not in OPS:
            raise UnsupportedError(
                [
                    f"graph.{name}: not an op a score modifier may use; it takes the pointwise ops "
                    f"{', '.join(sorted(OPS))} and tensor_scalar"
                ]
            )

        def record(*args: Any, name: str = "", compute_data_type: Any = None, **kwargs: Any) -> ScoreTensor:
            return self._op(op_name, args, kwargs, compute_data_type, name)

        op_name = name
        return record


def trace(score_mod: Any, score_mod_bprop: Any, owner: Any, label: str = "score_mod") -> tuple[ScoreModifier, list]:
    """Run the callbacks on a ``ScoreGraph``: the modifier they build and the graph tensors it reads.
    ``ValidationError`` for a callback that is not callable or returns no tensor of its graph."""
    for name, fn in (("score_mod", score_mod), ("score_mod_bprop", score_mod_bprop)):
        if fn is not None and not callable(fn):
            raise ValidationError([f"{name}: {type(fn).__name__}; expected a callable (graph, tensor) -> tensor"])
    if score_mod is None:
        raise ValidationError(["score_mod_bprop: given without score_mod (the forward it differentiates)"])
    graph = ScoreGraph(owner)
    scores, grad = ScoreTensor("score", name="scores"), ScoreTensor("grad", name="dS")
    frozen: dict[int, tuple[ScoreTensor, Expr]] = {id(scores): (scores, SCORE), id(grad): (grad, GRAD)}
    forward = _freeze(_returned(score_mod(graph, scores), "score_mod"), frozen)
    backward = None
    if score_mod_bprop is not None:
        backward = _freeze(_returned(score_mod_bprop(graph, grad), "score_mod_bprop"), frozen)
    if len(graph.inputs) > MAX_INPUTS:  # only that many are bound (score_input_0 ...): refused before binding
        count = len(graph.inputs)
        raise ValidationError([f"score_mod: reads {count} graph tensors; at most {MAX_INPUTS} are supported"])
    return ScoreModifier(forward=forward, backward=backward, name=label), graph.inputs


def _returned(value: Any, name: str) -> ScoreTensor:
    if not isinstance(value, ScoreTensor):
        raise ValidationError([f"{name}: returned {type(value).__name__}; expected the tensor its graph's ops built"])
    return value


def _freeze(tensor: ScoreTensor, frozen: dict[int, tuple[ScoreTensor, Expr]]) -> Expr:
    """``tensor``'s subgraph as ``Expr`` nodes; a tensor used twice becomes one shared node. The
    table holds each tensor it names (an id is unique only while its object lives)."""
    found = frozen.get(id(tensor))
    if found is None:
        args = tuple(_freeze(a, frozen) for a in tensor.args)
        found = (tensor, Expr(tensor.op, args, value=tensor.value, dtype=tensor.dtype, compute=tensor.compute))
        frozen[id(tensor)] = found
    return found[1]
