"""The score's tensor inputs besides Q and K: a graph-tensor ``attn_scale`` read at each run, and
attention sinks (``sink_token``, a logit per query head in every softmax denominator, and the
backward's ``dSink_token``). What shape and type each must have."""

from __future__ import annotations

import torch

from .problem import AttentionProblem


def score_input_problems(p: AttentionProblem) -> list[str]:
    found = []
    if p.scale_tensor is not None and (p.scale_tensor.numel != 1 or p.scale_tensor.dtype != torch.float32):
        found.append(f"attn_scale: {p.scale_tensor.describe()}; a tensor scale is float32 with one value "
                     "(shape [1, 1, 1, 1])")  # fmt: skip
    want = (1, p.h_q, 1, 1)
    for role, name in (("sink_token", "sink_token"), ("grad_sink", "dSink_token")):
        spec = getattr(p, role)
        if spec is not None and (tuple(spec.shape) != want or spec.dtype != torch.float32):
            found.append(f"{name}: {spec.describe()}; expected float32 {list(want)} (one logit per query head)")
    if p.grad_sink is not None and p.sink_token is None:
        found.append("dSink_token: given without sink_token")
    return found
