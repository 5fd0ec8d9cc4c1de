"""The functional form's problems: a call's tensors and options as one ``AttentionProblem``, and its
prepared run (``runtime.prepare``).

Shared by the eager path (``eager.py``), the custom ops ``torch.compile`` sees
(``compiled.py``) and context parallelism's blocks. Runs take their tensors in the problem's
role order: ``forward_inputs``/``backward_inputs`` give that order for a call. ``check_as_graph``
checks a call torch's kernel runs in the graphs' place as the graphs would.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core import validation
from ..core.constructors import backward_problem, forward_problem
from ..core.mask import Causal, ScoreOptions
from ..core.problem import TensorSpec
from ..errors import ValidationError
from ..runtime.prepared import PreparedRun, prepare
from .arguments import ARGUMENT_NAMES, batched


def _spec(t: torch.Tensor | None) -> TensorSpec | None:
    return None if t is None else TensorSpec.of(t)


def _options(scale: float, causal: Causal | str, dropout_p: float) -> ScoreOptions:
    return ScoreOptions(attn_scale=scale, causal=Causal(causal), dropout_p=dropout_p)


def forward_inputs(q, k, v, bias, dropout_p, seed, offset) -> list[Any]:
    return [t for t in (q, k, v, bias) if t is not None] + ([seed, offset] if dropout_p > 0 else [])


def forward_run(
    q,
    k,
    v,
    bias,
    scale: float,
    causal: Causal | str,
    dropout_p: float,
    seed,
    offset,
    train: bool,
    backend: str = "auto",
) -> PreparedRun:
    """The prepared forward of this call (O, plus stats when ``train``) on ``backend``'s graphs;
    inputs as ``forward_inputs``."""
    seed, offset = (seed, offset) if dropout_p > 0 else (None, None)
    problem = forward_problem(
        TensorSpec.of(q),
        TensorSpec.of(k),
        TensorSpec.of(v),
        _options(scale, causal, dropout_p),
        stats=train,
        bias=_spec(bias),
        dropout_seed=_spec(seed),
        dropout_offset=_spec(offset),
    )
    return prepare(problem, backend=backend, context="sdpa")


def backward_inputs(q, k, v, out, d_out, stats, bias, dropout_p, seed, offset) -> list[Any]:
    inputs: list[Any] = [q, k, v, out, d_out, stats] + ([bias] if bias is not None else [])
    return inputs + ([seed, offset] if dropout_p > 0 else [])


def backward_run(
    q,
    k,
    v,
    out,
    d_out,
    stats,
    bias,
    scale: float,
    causal: Causal | str,
    dropout_p: float,
    seed,
    offset,
    bias_grad: bool,
    backend: str = "auto",
) -> PreparedRun:
    """The prepared backward of this call (dQ, dK, dV, plus dBias when ``bias_grad``); inputs as
    ``backward_inputs``. ``d_out`` must have ``out``'s strides (see ``like``)."""
    seed, offset = (seed, offset) if dropout_p > 0 else (None, None)
    q_, k_, v_, o_, d_o_, stats_ = (TensorSpec.of(t) for t in (q, k, v, out, d_out, stats))
    problem = backward_problem(
        q_,
        k_,
        v_,
        o_,
        d_o_,
        stats_,
        _options(scale, causal, dropout_p),
        bias=_spec(bias),
        grad_bias=bias_grad,
        dropout_seed=_spec(seed),
        dropout_offset=_spec(offset),
    )
    return prepare(problem, backend=backend, context="sdpa")


def check_as_graph(query, key, value, attn_mask, dropout_p: float, causal: Causal, scale, train: bool) -> None:
    """Refuse a call torch's kernel runs in the graphs' place that the graphs would refuse (a head
    dim not a multiple of 8, ...), so code that runs on the CPU runs unchanged on a GPU:
    validation is the same whatever runs it."""
    q, k, v, bias, scale, _ = batched(query, key, value, attn_mask, scale)
    seed = torch.zeros(1, dtype=torch.int64) if dropout_p else None
    problem = forward_problem(
        TensorSpec.of(q),
        TensorSpec.of(k),
        TensorSpec.of(v),
        ScoreOptions(attn_scale=scale, causal=causal, dropout_p=float(dropout_p)),
        stats=train,
        bias=_spec(bias),
        dropout_seed=_spec(seed),
        dropout_offset=_spec(seed),
    )
    lines = validation.problems(problem)
    if lines:
        raise ValidationError(lines, context="sdpa").renamed(ARGUMENT_NAMES, context="sdpa")
