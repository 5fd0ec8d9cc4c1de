"""A backward node fed its own graph's forward O and Stats must form the scores as that forward did.

The backward recomputes the probabilities from q and k with its own options and normalises them
with the forward's Stats; with another mask, scale or modifier the two disagree and the
gradients are wrong with no error (the frontend computes them anyway). Both nodes are in one
graph, so the build compares what shapes the probabilities and refuses a difference by name.
Only the options that change the probabilities are compared: not the data types, geometry,
determinism, ragged offsets or which tensors hold the lengths or the dropout seed; a seed or
offset given as an int is known at build, and compared.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from ..core.mask import Causal
from ..core.problem import AttentionProblem, Op
from .handles import OutputHandle
from .node import Node


def _diagonal(p: AttentionProblem) -> int | None:
    """Where the diagonal bounds measure from (row i sees keys up to i + offset); None: no bound.
    Top-left and bottom-right alignment differ only where S_q != S_kv."""
    if not p.options.has_band:
        return None
    return p.s_kv - p.s_q if p.options.aligned_bottom_right else 0


def _scale(p: AttentionProblem) -> float | None:
    # A graph-tensor scale is read at each run: its value is not known at build.
    return None if p.scale_tensor is not None else p.options.attn_scale


# What shapes the probabilities, by the keyword that sets it.
COMPARED: dict[str, Callable[[AttentionProblem], Any]] = {
    "attn_scale": _scale,
    "use_causal_mask": lambda p: p.options.causal is not Causal.NONE,
    "diagonal_alignment": _diagonal,
    "sliding_window_length": lambda p: p.options.sliding_window,
    "diagonal_band_right_bound": lambda p: p.options.right_bound,
    "use_alibi_mask": lambda p: p.options.alibi,
    "use_padding_mask": lambda p: p.options.padding,
    "dropout": lambda p: p.options.dropout_p,
    "attn_bias": lambda p: p.bias is not None,
    "sink_token": lambda p: p.sink_token is not None,
    "score_mod": lambda p: p.score_mod.forward if p.score_mod is not None else None,
}


def _same(keyword: str, a: Any, b: Any) -> bool:
    if a is None or b is None:
        # A scale read at run time is not known here; a side with no diagonal bound is named by the mask keywords.
        return keyword in ("attn_scale", "diagonal_alignment") or a is b
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6)  # 1 / sqrt(d) written out equals the default scale
    return bool(a == b)


def _shown(keyword: str, value: Any) -> str:
    if keyword == "score_mod":
        return "a modifier" if value is not None else "none"
    if keyword == "diagonal_alignment":
        return f"keys up to row + {value}"
    if keyword in ("attn_bias", "sink_token"):
        return "given" if value else "none"
    return f"{value:g}" if isinstance(value, float) else repr(value)


def pairing_problems(node: Node, valid: Iterable[Node]) -> list[str]:
    """Each way ``node`` (a backward, its problem valid) forms its scores unlike the forward whose
    O or Stats it reads; only forwards in ``valid`` (their problems passed validation) are compared."""
    if node.op is not Op.BACKWARD or node.problem is None:
        return []
    checked = {id(n) for n in valid}
    forwards: dict[int, tuple[Node, list[str]]] = {}
    for role in ("o", "stats"):
        handle = node.inputs.get(role)
        if isinstance(handle, OutputHandle) and handle.node.op is Op.FORWARD and id(handle.node) in checked:
            forwards.setdefault(id(handle.node), (handle.node, []))[1].append(node.argument(role))
    found = []
    for forward, roles in forwards.values():
        mine, theirs = node.problem, forward.problem
        assert mine is not None and theirs is not None, "valid nodes have problems"
        differing = [
            f"{keyword} {_shown(keyword, f(theirs))} there, {_shown(keyword, f(mine))} here"
            for keyword, f in COMPARED.items()
            if not _same(keyword, f(theirs), f(mine))
        ]
        differing += [  # int seeds and offsets draw the dropout mask: another one drops other weights
            f"{role} {forward.runtime[role]} there, {node.runtime[role]} here"
            for role in ("dropout_seed", "dropout_offset")
            if role in forward.runtime and role in node.runtime and forward.runtime[role] != node.runtime[role]
        ]
        if differing:
            found.append(
                f"{' and '.join(roles)}: from {forward.name}, whose scores this backward forms otherwise "
                f"({'; '.join(differing)}); give the backward the forward's mask, scale, bias, sinks, dropout "
                "and score_mod, or its gradients do not match"
            )
    return found
