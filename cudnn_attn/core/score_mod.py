"""Score modifiers: a pointwise expression on the attention scores (the frontend's ``score_mod``
and ``score_mod_bprop``), as frozen, hashable problem data.

cuDNN forms the scores as ``s = (Q @ K^T) * attn_scale``, then applies the modifier, then adds
the bias, then takes the softmax. The backward forms ``dS`` (the gradient of the modified scores,
after the bias), applies ``score_mod_bprop`` to it (the identity when none is given) and scales by
``attn_scale``. A modifier is an expression tree over four kinds of leaves:

- ``score``: the scaled scores ``[B, H_q, S_q, S_kv]``;
- ``grad``: in ``score_mod_bprop`` only, ``dS``; the bprop may also use any node of the forward
  expression (soft-capping's backward reads the value before its ``tanh``);
- ``input``: a graph tensor read at each run, broadcast to the scores (a pass-by-value scalar on
  the host, or e.g. per-sequence lengths ``[B, 1, 1, 1]`` on the device): ``ScoreModifier.inputs``;
- ``constant``: a number fixed in the graph (``tensor_scalar``, or a Python number).

Every other node is one of the frontend's pointwise ops (``OPS``, with its parameter names).
The reference backend evaluates the tree in torch (``ops/reference/score_mod.py``); the cuDNN
backend replays it on the frontend's graph (``ops/cudnn/score_mod.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .problem import TensorSpec

LEAVES = ("score", "grad", "input", "constant")
_UNARY = (
    "neg",
    "abs",
    "exp",
    "log",
    "tanh",
    "sigmoid",
    "sqrt",
    "rsqrt",
    "reciprocal",
    "floor",
    "ceil",
    "identity",
    "sin",
    "cos",
    "erf",
    "softplus",
    "logical_not",
)
# Each op's parameters, as the frontend names them (its keyword arguments).
OPS: dict[str, tuple[str, ...]] = {
    **{name: ("input",) for name in _UNARY},
    **{name: ("a", "b") for name in ("add", "sub", "mul", "div", "logical_and", "logical_or")},
    **{name: ("input0", "input1") for name in ("max", "min", "pow", "mod")},
    **{name: ("input", "comparison") for name in ("cmp_eq", "cmp_neq", "cmp_lt", "cmp_le", "cmp_gt", "cmp_ge")},
    "scale": ("input", "scale"),
    "bias": ("input", "bias"),
    "tanh_backward": ("loss", "input"),
    "sigmoid_backward": ("loss", "input"),
    "binary_select": ("input0", "input1", "mask"),
    "gen_index": ("input",),  # the index along ``axis`` (Expr.value) of its input's dims
}
BOOLEAN_OPS = frozenset(
    ("logical_and", "logical_or", "logical_not", "cmp_eq", "cmp_neq", "cmp_lt", "cmp_le", "cmp_gt", "cmp_ge")
)
MAX_INPUTS = 8  # graph tensors one modifier reads (roles score_input_0 ...)
INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.bool)


@dataclass(frozen=True, eq=False)
class Expr:
    """One node of a modifier: a leaf (``LEAVES``) or a pointwise op (``OPS``) on ``args``."""

    op: str
    args: tuple[Expr, ...] = ()
    value: float | int | None = None  # constant: its value; input: its index; gen_index: the axis
    dtype: torch.dtype | None = None  # the data type the caller declared (set_data_type), if any
    compute: torch.dtype | None = None  # the op's compute_data_type, if given

    def __post_init__(self) -> None:  # trees are hashed with every problem and as table keys: once each
        object.__setattr__(self, "_hash", hash(self._identity()))

    def _identity(self) -> tuple:
        # A float value by its bits: -0.0 == 0.0 (and 1/-0.0 is -inf, not inf), and NaN != NaN.
        value = self.value.hex() if isinstance(self.value, float) else self.value
        return (self.op, self.args, value, self.dtype, self.compute)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Expr):
            return NotImplemented
        return self is other or (hash(self) == hash(other) and self._identity() == other._identity())

    def __hash__(self) -> int:
        return self.__dict__["_hash"]

    def __reduce__(self) -> tuple:  # rebuilt, so the hash is this process's (str hashes vary by process)
        return (Expr, (self.op, self.args, self.value, self.dtype, self.compute))

    def nodes(self) -> list[Expr]:
        """Every distinct node below and including this one, arguments before their users (kept:
        the reference evaluates a tree once per block of rows)."""
        cached = self.__dict__.get("_nodes")
        if cached is not None:
            return cached
        seen: dict[int, Expr] = {}

        def visit(e: Expr) -> None:
            if id(e) in seen:
                return
            for a in e.args:
                visit(a)
            seen[id(e)] = e

        visit(self)
        object.__setattr__(self, "_nodes", list(seen.values()))
        return self.__dict__["_nodes"]


SCORE = Expr("score")
GRAD = Expr("grad")


def constant(value: float) -> Expr:
    return Expr("constant", value=float(value))


def op(name: str, *args: Expr, value: float | int | None = None) -> Expr:
    return Expr(name, tuple(args), value=value)


@dataclass(frozen=True)
class ScoreModifier:
    """A problem's score modifier: the forward expression, the backward's (None: identity) and
    the geometry of the graph tensors it reads (``input`` leaves index them). A forward problem
    reads ``forward`` alone."""

    forward: Expr
    backward: Expr | None = None
    inputs: tuple[TensorSpec, ...] = ()
    name: str = "score_mod"  # how describe() and errors name it (softcap50, ...)
    # The expression masks every key past its row's sequence itself (a top-left causal mask over
    # self-attention's equal lengths): cuDNN applies no padding mask beside a modifier, and then
    # needs none (ops/cudnn/capabilities.py).
    keys_in_bounds: bool = False

    def leaves(self, kind: str) -> list[Expr]:
        roots = [self.forward] + ([self.backward] if self.backward is not None else [])
        return [e for root in roots for e in root.nodes() if e.op == kind]


def modifier_problems(mod: ScoreModifier, *, forward: bool, scores: tuple[int, int, int, int]) -> list[str]:
    """What is wrong with ``mod`` on scores of shape ``scores`` ([B, H_q, S_q, S_kv])."""
    found = expression_problems(mod)
    if found:
        return found  # the checks below read the tree's ops and leaves
    if any(e.op == "grad" for e in mod.forward.nodes()):
        found.append("score_mod: reads the gradient; only score_mod_bprop may")
    if not forward and mod.backward is not None and not any(e.op == "grad" for e in mod.backward.nodes()):
        found.append("score_mod_bprop: does not read its gradient argument; it must map dS to the score's gradient")
    for e in mod.leaves("gen_index"):
        if e.value not in (0, 1, 2, 3):
            found.append(f"gen_index: axis {e.value!r}; the scores have axes 0-3 (B, H, S_q, S_kv)")
    if len(mod.inputs) > MAX_INPUTS:
        found.append(f"score_mod: reads {len(mod.inputs)} graph tensors; at most {MAX_INPUTS} are supported")
    for i, spec in enumerate(mod.inputs):
        fits = spec.rank == 4 and all(size in (1, full) for size, full in zip(spec.shape, scores))
        if not fits:
            found.append(
                f"score_mod input {i}: {spec.describe()}; expected 4-D dims broadcastable to the scores "
                f"{list(scores)} (each dim 1 or the scores')"
            )
        if spec.dtype not in INPUT_DTYPES:
            found.append(
                f"score_mod input {i}: dtype {spec.dtype}; expected float32, float16, bfloat16, int32, int64 or bool"
            )
    return found


def expression_problems(mod: ScoreModifier) -> list[str]:
    """Each node of ``mod``'s trees that is not a leaf or an op with its parameters (a traced
    callback never makes one; a damaged serialized graph can)."""
    found = []
    roots = [("score_mod", mod.forward)] + ([("score_mod_bprop", mod.backward)] if mod.backward is not None else [])
    for name, root in roots:
        for e in root.nodes():
            number = isinstance(e.value, (int, float)) and not isinstance(e.value, bool)
            if e.op in LEAVES:
                wrong = bool(e.args) or (e.op == "constant" and not number)
                if e.op == "input":
                    wrong = wrong or not number or e.value not in range(len(mod.inputs))
                if wrong:
                    found.append(f"{name}: a {e.op} leaf with arguments {len(e.args)} and value {e.value!r}")
            elif e.op not in OPS:
                found.append(f"{name}: {e.op!r} is not an op a score modifier may use")
            elif len(e.args) != len(OPS[e.op]):
                params = ", ".join(OPS[e.op])
                found.append(f"{name}: {e.op} takes {len(OPS[e.op])} arguments ({params}); got {len(e.args)}")
    return found


def softcap(cap: float, mask: Expr | None = None, keys_in_bounds: bool = False) -> ScoreModifier:
    """FlashAttention's and Gemma-2's logit soft-capping, ``cap * tanh(s / cap)``, and its gradient
    ``dS * (1 - tanh(s / cap)^2)`` (the frontend's ``Softcap`` modifier). ``mask``: a boolean
    expression of the positions kept (the others get -inf after capping), e.g. ``band_mask``."""
    cap_value = constant(cap)
    before_tanh = op("div", SCORE, cap_value)
    capped = op("mul", op("tanh", before_tanh), cap_value)
    if mask is not None:
        capped = op("binary_select", capped, constant(float("-inf")), mask)
    backward = op("div", op("tanh_backward", op("mul", GRAD, cap_value), before_tanh), cap_value)
    return ScoreModifier(forward=capped, backward=backward, name=f"softcap{cap:g}", keys_in_bounds=keys_in_bounds)


def diagonal_of(row: Expr, offset: int | Expr) -> Expr:
    """The key column on row ``row``'s diagonal: ``row + offset``."""
    if isinstance(offset, Expr):
        return op("add", row, offset)
    return op("add", row, constant(offset)) if offset else row


def band_mask(*, causal: bool, window: int | None, offset: int | Expr) -> Expr | None:
    """The positions a causal mask and/or a sliding window keep, as a boolean expression of the
    row and column indices: key j is kept for query i iff ``j <= i + offset`` (causal) and
    ``j > i + offset - window``; ``offset`` is 0 top-left, ``S_kv - S_q`` bottom-right, or an
    expression (each packed sequence's own ``S_kv - S_q``, read from an input)."""
    if not causal and window is None:
        return None
    row, col = op("gen_index", SCORE, value=2), op("gen_index", SCORE, value=3)
    diagonal = diagonal_of(row, offset)
    kept: Expr | None = op("cmp_le", col, diagonal) if causal else None
    if window is not None:
        inside = op("cmp_gt", col, op("sub", diagonal, constant(window)))
        kept = inside if kept is None else op("logical_and", kept, inside)
    return kept
