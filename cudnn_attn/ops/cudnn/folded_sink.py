"""Attention sinks cuDNN's kernels do not take: run without the sink, fold it in after.

Two cases, measured with cuDNN 9.19 on an H100:

- S_q = 1 (decode): no forward graph builds with a ``sink_token`` and one query token ("decode
  only mode ... not supported with sink_token"). Dense and paged tensors (4-D); a packed (THD)
  query keeps cuDNN's refusal, named in ``capabilities``.
- FP8: ``sdpa_fp8`` with a ``sink_token`` fails to compile its kernel (NVRTC,
  ``CUDNN_STATUS_INTERNAL_ERROR_COMPILATION_FAILED``) for every shape tried, causal or not;
  ``sdpa_fp8_backward`` with one builds but its run faults (illegal memory access).

Forward, the plan runs the graph without the sink, with its log-sum-exp (``stats_scratch`` when
the caller asked for none), and folds the sink in (``core/sink_fold.py``): exactly for 16-bit O;
for FP8 O by re-quantising ``O * exp(L - L')`` (one more rounding of each element, within the
FP8 tolerance; Amax_O is that result's, Amax_S the sink-less one times the largest factor: an
upper bound of the exact one, as delayed scaling needs). Backward needs no fold: given the
forward's stats (which hold the sink), the sink-less graph's dQ, dK, dV are the sink's, and
dSink comes from O, dO and the stats (``sink_fold.sink_gradient``).
"""

from __future__ import annotations

import torch

from ...core.problem import AttentionProblem


def applies(p: AttentionProblem) -> bool:
    """Whether ``p``'s sink is added after the run rather than inside cuDNN's graph."""
    if p.sink_token is None or p.is_thd or p.offset_tensors:
        return False
    return p.is_fp8 or (p.is_forward and p.s_q == 1)


def stats_scratch(p: AttentionProblem, device: torch.device) -> torch.Tensor:
    """Where the log-sum-exp goes when the caller asked for none: ``[B, H, S_q, 1]`` float32."""
    return torch.empty((p.batch, p.h_q, p.s_q, 1), dtype=torch.float32, device=device)
