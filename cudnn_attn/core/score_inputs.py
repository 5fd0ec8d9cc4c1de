"""The score's inputs besides Q and K: a graph-tensor ``attn_scale`` read at each run, attention
sinks (``sink_token``, a logit per query head in every softmax denominator, and the backward's
``dSink_token``) and a score modifier (``score_mod``) with the tensors it reads. What shape and
type each must have."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ValidationError
from .problem import AttentionProblem
from .score_mod import modifier_problems


def score_input_problems(p: AttentionProblem) -> list[str]:
    found = []
    if p.scale_tensor is not None and (p.scale_tensor.numel != 1 or p.scale_tensor.dtype != torch.float32):
        found.append(
            f"attn_scale: {p.scale_tensor.describe()}; a tensor scale is float32 with one value (shape [1, 1, 1, 1])"
        )
    want = (1, p.h_q, 1, 1)
    sink_dtypes = (torch.float32, sink_dtype(p.q.dtype))
    for role, name in (("sink_token", "sink_token"), ("grad_sink", "dSink_token")):
        spec = getattr(p, role)
        if spec is not None and (tuple(spec.shape) != want or spec.dtype not in sink_dtypes):
            found.append(
                f"{name}: {spec.describe()}; expected float32 {list(want)} (one logit per query head; float64 "
                "beside float64 queries)"
            )
    if p.grad_sink is not None and p.sink_token is None:
        found.append("dSink_token: given without sink_token")
    if p.score_mod is not None:
        found += modifier_problems(p.score_mod, forward=p.is_forward, scores=(p.batch, p.h_q, p.s_q, p.s_kv))
    return found


def check_sinks(sinks: Any, heads: int, device: torch.device, context: str | None = None) -> None:
    """The torch forms' ``sinks``: a real tensor of one logit per query head, ``[H]`` (gpt-oss's and
    FlashInfer's form) or ``[1, H, 1, 1]`` (the frontend's), beside q. ``ValidationError`` otherwise,
    prefixed with ``context`` (what was called) where given."""
    if not isinstance(sinks, torch.Tensor):
        raise ValidationError(
            [f"sinks: {type(sinks).__name__}; expected a tensor of one logit per query head"], context=context
        )
    if sinks.numel() != heads or sinks.dim() not in (1, 4) or not sinks.is_floating_point():
        raise ValidationError(
            [
                f"sinks: shape {list(sinks.shape)} dtype {sinks.dtype}; expected a real tensor of "
                f"[{heads}] or [1, {heads}, 1, 1] (one logit per query head)"
            ],
            context=context,
        )
    if sinks.device != device:
        raise ValidationError([f"sinks: on {sinks.device}; q is on {device}"], context=context)


def sink_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """The dtype sinks are bound in beside queries of ``q_dtype``: float32, cuDNN's; float64
    beside float64 queries, which only the reference backend runs, so that float64 attention
    keeps its precision."""
    return torch.float64 if q_dtype == torch.float64 else torch.float32


def sink_token(sinks: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """A checked ``sinks`` as the plans bind it beside queries ``q``: ``[1, H, 1, 1]`` of
    ``sink_dtype``, contiguous, detached (its gradient comes back through the caller's autograd
    function)."""
    return None if sinks is None else sinks.detach().reshape(1, -1, 1, 1).to(sink_dtype(q.dtype)).contiguous()
