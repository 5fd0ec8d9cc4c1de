"""The functional form's problems: a call's tensors and options as one ``AttentionProblem``, and its
prepared run (``runtime.prepare``).

Shared by the eager path (``eager.py``), the custom ops ``torch.compile`` sees
(``compiled.py``) and context parallelism's blocks. Runs take their tensors in the problem's
role order: ``forward_inputs``/``backward_inputs`` give that order for a call.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.constructors import backward_problem, forward_problem
from ..core.mask import Causal, ScoreOptions
from ..core.problem import TensorSpec
from ..runtime.prepared import PreparedRun, prepare


def _spec(t: torch.Tensor | None) -> TensorSpec | None:
    return None if t is None else TensorSpec.of(t)


def _options(scale: float, causal: Causal | str, dropout_p: float) -> ScoreOptions:
    return ScoreOptions(attn_scale=scale, causal=Causal(causal), dropout_p=dropout_p)


def forward_inputs(q, k, v, bias, dropout_p, seed, offset) -> list[Any]:
    return [t for t in (q, k, v, bias) if t is not None] + ([seed, offset] if dropout_p > 0 else [])


def forward_run(q, k, v, bias, scale: float, causal: Causal | str, dropout_p: float, seed, offset,
                train: bool) -> PreparedRun:  # fmt: skip
    """The prepared forward of this call (O, plus stats when ``train``); inputs as ``forward_inputs``."""
    seed, offset = (seed, offset) if dropout_p > 0 else (None, None)
    problem = forward_problem(TensorSpec.of(q), TensorSpec.of(k), TensorSpec.of(v), _options(scale, causal, dropout_p), stats=train,
                              bias=_spec(bias), dropout_seed=_spec(seed), dropout_offset=_spec(offset))  # fmt: skip
    return prepare(problem, context="sdpa")


def backward_inputs(q, k, v, out, d_out, stats, bias, dropout_p, seed, offset) -> list[Any]:
    inputs: list[Any] = [q, k, v, out, d_out, stats] + ([bias] if bias is not None else [])
    return inputs + ([seed, offset] if dropout_p > 0 else [])


def backward_run(q, k, v, out, d_out, stats, bias, scale: float, causal: Causal | str, dropout_p: float, seed,
                 offset, bias_grad: bool) -> PreparedRun:  # fmt: skip
    """The prepared backward of this call (dQ, dK, dV, plus dBias when ``bias_grad``); inputs as
    ``backward_inputs``. ``d_out`` must have ``out``'s strides (see ``like``)."""
    seed, offset = (seed, offset) if dropout_p > 0 else (None, None)
    q_, k_, v_, o_, d_o_, stats_ = (TensorSpec.of(t) for t in (q, k, v, out, d_out, stats))
    problem = backward_problem(q_, k_, v_, o_, d_o_, stats_,
                               _options(scale, causal, dropout_p), bias=_spec(bias), grad_bias=bias_grad,
                               dropout_seed=_spec(seed), dropout_offset=_spec(offset))  # fmt: skip
    return prepare(problem, context="sdpa")
