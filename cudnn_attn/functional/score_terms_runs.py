"""The prepared cuDNN (or reference) runs behind ``sdpa``'s score terms, by the call's geometry.

``forward`` and ``backward`` run one call (``score_terms``' whole call, or one part of a split
causal soft-capped call, ``softcap_split``), writing into the caller's output tensors where given.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..core.constructors import backward_problem, forward_problem
from ..core.mask import ScoreOptions
from ..core.problem import TensorSpec
from ..runtime import backend_choice
from ..runtime.interop import in_layout_of
from ..runtime.keyed import KeyedCache
from ..runtime.prepared import PreparedRun, prepare

MAX_RUNS = 256


def _sink_spec(q: torch.Tensor, sink: torch.Tensor) -> TensorSpec:
    """``sink_token``'s: ``[1, H, 1, 1]`` of the sink's dtype (float32; float64 beside float64 queries)."""
    return TensorSpec.contiguous((1, q.shape[1], 1, 1), sink.dtype, TensorSpec.of(q).device)


def _geometry(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


# Prepared runs by the call's tensor geometry, in front of ``prepare``'s table: a step's layers
# repeat one geometry, and building and hashing its problem costs several times the tuple.
_forward_runs = KeyedCache(MAX_RUNS)
_backward_runs = KeyedCache(MAX_RUNS)


def clear() -> None:
    _forward_runs.clear()
    _backward_runs.clear()


def _rng_specs(rng: tuple | None) -> tuple[TensorSpec | None, TensorSpec | None]:
    return (None, None) if rng is None else (TensorSpec.of(rng[0]), TensorSpec.of(rng[1]))


def forward_run(q, k, v, bias, sink, options: ScoreOptions, modifier, rng) -> PreparedRun:
    fast = (
        _geometry(q),
        _geometry(k),
        _geometry(v),
        _geometry(bias),
        None if sink is None else sink.dtype,
        options,
        modifier,
        backend_choice.chosen(),
    )
    run = _forward_runs.get(fast)
    if run is None:
        problem = forward_problem(
            TensorSpec.of(q),
            TensorSpec.of(k),
            TensorSpec.of(v),
            options,
            stats=True,
            bias=None if bias is None else TensorSpec.of(bias),
            sink_token=None if sink is None else _sink_spec(q, sink),
            score_mod=modifier,
            dropout_seed=_rng_specs(rng)[0],
            dropout_offset=_rng_specs(rng)[1],
        )
        run = _forward_runs.put(fast, prepare(problem, context="sdpa"))
    return run


def backward_run(
    options: ScoreOptions, modifier, grad_bias: bool, q, k, v, bias, sink, out, d_out, stats, rng
) -> PreparedRun:
    grad_bias = bias is not None and grad_bias
    fast = (
        *(_geometry(t) for t in (q, k, v, out, d_out, stats, bias)),
        grad_bias,
        None if sink is None else sink.dtype,
        options,
        modifier,
        backend_choice.chosen(),
    )
    run = _backward_runs.get(fast)
    if run is None:
        spec = TensorSpec.of
        problem = backward_problem(
            spec(q),
            spec(k),
            spec(v),
            spec(out),
            spec(d_out),
            spec(stats),
            options,
            bias=None if bias is None else spec(bias),
            grad_bias=grad_bias,
            sink_token=None if sink is None else _sink_spec(q, sink),
            score_mod=modifier,
            dropout_seed=_rng_specs(rng)[0],
            dropout_offset=_rng_specs(rng)[1],
        )
        run = _backward_runs.put(fast, prepare(problem, context="sdpa backward"))
    return run


def forward(
    q, k, v, bias, sink, options: ScoreOptions, modifier, rng, outputs: Mapping[str, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """O and stats of one call (``sink``: the ``[1, H, 1, 1]`` float32 logits, or None)."""
    run = forward_run(q, k, v, bias, sink, options, modifier, rng)
    inputs = {"q": q, "k": k, "v": v, **({"bias": bias} if bias is not None else {})}
    if sink is not None:
        inputs["sink_token"] = sink
    if rng is not None:
        inputs["dropout_seed"], inputs["dropout_offset"] = rng
    written = run.run(inputs, outputs)
    return written["o"], written["stats"]


def backward(
    options: ScoreOptions,
    modifier,
    grad_bias: bool,
    q,
    k,
    v,
    bias,
    sink,
    out,
    d_out,
    stats,
    rng,
    outputs: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """dQ, dK, dV (and dBias where ``grad_bias``, dSink where there is a sink) of one call."""
    d_out = in_layout_of(d_out, out)
    run = backward_run(options, modifier, grad_bias, q, k, v, bias, sink, out, d_out, stats, rng)
    inputs = {"q": q, "k": k, "v": v, "o": out, "grad_o": d_out, "stats": stats}
    if rng is not None:
        inputs["dropout_seed"], inputs["dropout_offset"] = rng
    if bias is not None:
        inputs["bias"] = bias
    if sink is not None:
        inputs["sink_token"] = sink
    return run.run(inputs, outputs)
