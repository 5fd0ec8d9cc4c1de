"""A score modifier (``core/score_mod.py``) evaluated in torch, one block of query rows at a time.

Numbers are computed in the reference's float dtype (float32 or float64), which holds every
index of a sequence cuDNN runs exactly; comparisons and logical ops give booleans, turned into
0/1 where arithmetic reads them (a mask declared INT32 and then scaled, as the frontend's own
document-mask example does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ...core.score_mod import Expr, ScoreModifier

Evaluate = Callable[[torch.Tensor, range], torch.Tensor]
EvaluateGrad = Callable[[torch.Tensor, torch.Tensor, range], torch.Tensor]

_UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "neg": torch.neg,
    "abs": torch.abs,
    "exp": torch.exp,
    "log": torch.log,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "reciprocal": torch.reciprocal,
    "floor": torch.floor,
    "ceil": torch.ceil,
    "identity": lambda x: x,
    "sin": torch.sin,
    "cos": torch.cos,
    "erf": torch.erf,
    "softplus": torch.nn.functional.softplus,
}
_BINARY: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
    "scale": torch.mul,
    "bias": torch.add,
    "max": torch.maximum,
    "min": torch.minimum,
    "pow": torch.pow,
    "mod": torch.fmod,
    "cmp_eq": torch.eq,
    "cmp_neq": torch.ne,
    "cmp_lt": torch.lt,
    "cmp_le": torch.le,
    "cmp_gt": torch.gt,
    "cmp_ge": torch.ge,
    "tanh_backward": lambda loss, x: loss * (1 - torch.tanh(x) ** 2),
    "sigmoid_backward": lambda loss, x: loss * torch.sigmoid(x) * (1 - torch.sigmoid(x)),
}


class BlockEvaluator:
    """Evaluates a modifier's trees on one block of rows, each node once: the bprop reuses the
    forward's nodes (soft-capping's backward reads the value before its tanh)."""

    def __init__(
        self, inputs: Sequence[torch.Tensor], rows: range, dtype: torch.dtype, leaves: dict[str, torch.Tensor]
    ):
        self.inputs, self.rows, self.dtype, self.leaves = inputs, rows, dtype, leaves
        self.shape = tuple(leaves["score"].shape)
        self.memo: dict[Expr, torch.Tensor] = {}  # by value: equal subtrees are one value

    def __call__(self, root: Expr) -> torch.Tensor:
        for node in root.nodes():
            if node not in self.memo:
                self.memo[node] = self._node(node)
        return self._number(self.memo[root])

    def _number(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype) if x.dtype != self.dtype else x

    def _node(self, e: Expr) -> torch.Tensor:
        if e.op in self.leaves:
            return self.leaves[e.op]
        if e.op == "constant":
            return torch.tensor(e.value, dtype=self.dtype, device=self.leaves["score"].device)
        if e.op == "input":
            assert isinstance(e.value, int)
            return self._input(self.inputs[e.value])
        args = [self.memo[a] for a in e.args]
        if e.op == "gen_index":
            return self._index(int(e.value or 0))
        if e.op in ("logical_and", "logical_or"):
            fn = torch.logical_and if e.op == "logical_and" else torch.logical_or
            return fn(args[0] != 0, args[1] != 0)
        if e.op == "logical_not":
            return args[0] == 0
        if e.op == "binary_select":
            return torch.where(args[2] != 0, self._number(args[0]), self._number(args[1]))
        if e.op in _UNARY:
            return _UNARY[e.op](self._number(args[0]))
        return _BINARY[e.op](self._number(args[0]), self._number(args[1]))

    def _index(self, axis: int) -> torch.Tensor:
        size = self.shape[axis]
        index = torch.arange(size, dtype=self.dtype, device=self.leaves["score"].device)
        if axis == 2:
            index = index + self.rows.start
        view = [1, 1, 1, 1]
        view[axis] = size
        return index.view(view)

    def _input(self, tensor: torch.Tensor) -> torch.Tensor:
        t = tensor.to(self.leaves["score"].device)
        if t.shape[2] != 1:  # per-row values: this block's rows
            t = t[:, :, self.rows.start : self.rows.stop]
        return t if t.dtype == torch.bool else t.to(self.dtype)


def forward_fn(mod: ScoreModifier, inputs: Sequence[torch.Tensor]) -> Evaluate:
    """``(scaled scores of a block, its rows) -> modified scores``."""

    def evaluate(scores: torch.Tensor, rows: range) -> torch.Tensor:
        return BlockEvaluator(inputs, rows, scores.dtype, {"score": scores})(mod.forward)

    return evaluate


def backward_fn(mod: ScoreModifier, inputs: Sequence[torch.Tensor]) -> EvaluateGrad | None:
    """``(dS of a block, its scaled scores, its rows) -> the scores' gradient``; None for the
    identity (no ``score_mod_bprop``: cuDNN then passes dS through unchanged)."""
    backward = mod.backward
    if backward is None:
        return None

    def evaluate(grad: torch.Tensor, scores: torch.Tensor, rows: range) -> torch.Tensor:
        evaluator = BlockEvaluator(inputs, rows, scores.dtype, {"score": scores, "grad": grad})
        return evaluator(backward)

    return evaluate
