"""``cudnn_attn.sdpa(..., sinks=)``: attention sinks in the torch form, differentiable.

``sinks`` is a logit per query head (``[H_q]``, gpt-oss's ``module.sinks``, FlashInfer's
``sinks``; or ``[1, H_q, 1, 1]``, the frontend's ``sink_token``) added to every softmax
denominator and weighing no value. Calls with sinks take this path: the forward problem with
its stats and the backward problem with ``dSink_token``, each prepared once per geometry
(``runtime.prepare``), through one autograd function. Dropout with sinks is not run yet.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.constructors import backward_problem, forward_problem
from ..core.mask import Causal, ScoreOptions
from ..core.problem import TensorSpec
from ..core.score_inputs import check_sinks
from ..errors import ShapeMismatchError, UnsupportedError, ValidationError
from ..runtime.interop import in_layout_of
from ..runtime.prepared import prepare
from .arguments import ARGUMENT_NAMES, batched, causal_kind, check_arguments


def sdpa_with_sinks(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, sinks) -> torch.Tensor:
    """``cudnn_attn.sdpa``'s call with ``sinks`` (its other arguments as there)."""
    check_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    query, key, value, bias, scale, squeeze = batched(query, key, value, attn_mask, scale)
    try:
        out = sink_sdpa(query, key, value, bias, scale, causal_kind(is_causal), float(dropout_p), sinks)
    except (ValidationError, UnsupportedError, ShapeMismatchError) as error:
        raise error.renamed(ARGUMENT_NAMES, context="sdpa") from None
    return out.squeeze(0) if squeeze else out


def sink_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float,
              causal: Causal, dropout_p: float, sinks: Any) -> torch.Tensor:  # fmt: skip
    """Attention of ``[B, H, S, D]`` tensors with ``sinks`` (checked here, by name)."""
    check_sinks(sinks, q.shape[1], q.device)
    if dropout_p:
        raise UnsupportedError(["dropout_p with sinks: not supported yet"], context="sdpa")
    return _SinkAttention.apply(q, k, v, bias, sinks, ScoreOptions(attn_scale=scale, causal=causal))


def _sink_spec(q: torch.Tensor) -> TensorSpec:
    return TensorSpec.contiguous((1, q.shape[1], 1, 1), torch.float32, TensorSpec.of(q).device)


class _SinkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, sinks, options: ScoreOptions):  # type: ignore[override]
        sink = sinks.detach().reshape(1, -1, 1, 1).to(torch.float32).contiguous()
        problem = forward_problem(TensorSpec.of(q), TensorSpec.of(k), TensorSpec.of(v), options, stats=True,
                                  bias=None if bias is None else TensorSpec.of(bias), sink_token=_sink_spec(q))  # fmt: skip
        run = prepare(problem, context="sdpa")
        inputs = {"q": q, "k": k, "v": v, "sink_token": sink, **({"bias": bias} if bias is not None else {})}
        outputs = run.run(inputs)
        ctx.save_for_backward(q, k, v, bias, sink, outputs["o"], outputs["stats"])
        ctx.options, ctx.sink_meta = options, (sinks.shape, sinks.dtype)
        return outputs["o"]

    @staticmethod
    def backward(ctx, d_out):  # type: ignore[override]
        q, k, v, bias, sink, out, stats = ctx.saved_tensors
        d_out = in_layout_of(d_out, out)
        specs = [TensorSpec.of(t) for t in (q, k, v, out, d_out, stats)]
        problem = backward_problem(*specs, ctx.options, bias=None if bias is None else TensorSpec.of(bias),
                                   grad_bias=bias is not None and ctx.needs_input_grad[3],
                                   sink_token=_sink_spec(q))  # fmt: skip
        run = prepare(problem, context="sdpa backward")
        inputs = {"q": q, "k": k, "v": v, "o": out, "grad_o": d_out, "stats": stats, "sink_token": sink}
        if bias is not None:
            inputs["bias"] = bias
        grads = run.run(inputs)
        shape, dtype = ctx.sink_meta
        d_sink = grads["grad_sink"].reshape(shape).to(dtype)
        return grads["grad_q"], grads["grad_k"], grads["grad_v"], grads.get("grad_bias"), d_sink, None
