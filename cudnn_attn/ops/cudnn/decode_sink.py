"""Attention sinks at S_q = 1 (decode), which cuDNN's decode kernels refuse.

cuDNN 9.19 builds no forward graph with a ``sink_token`` and one query token ("decode only
mode ... not supported with sink_token"). The plan runs the graph without it, with its
log-sum-exp, and folds the sink in after, exactly (``core/sink_fold.py``). Dense and paged
tensors (4-D); a packed (THD) query keeps cuDNN's refusal, named in ``capabilities``.
"""

from __future__ import annotations

import torch

from ...core.problem import AttentionProblem


def applies(p: AttentionProblem) -> bool:
    """Whether ``p``'s sink is added after the run rather than inside cuDNN's graph."""
    return (
        p.sink_token is not None and p.is_forward and p.s_q == 1 and not p.is_fp8 and not p.is_thd
        and not p.offset_tensors
    )  # fmt: skip


def stats_scratch(p: AttentionProblem, device: torch.device) -> torch.Tensor:
    """Where the log-sum-exp goes when the caller asked for none: ``[B, H, 1, 1]`` float32."""
    return torch.empty((p.batch, p.h_q, 1, 1), dtype=torch.float32, device=device)
