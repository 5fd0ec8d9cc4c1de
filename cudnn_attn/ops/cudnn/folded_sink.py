"""Attention sinks run without cuDNN's sink: folded in after the forward, or derived in the backward.

Every backward with a sink, dense or packed (THD): cuDNN's sink backward runs its
``dot(dO, O)`` preprocessing 14x slower than without a sink (1.82 ms against 0.13 ms, gpt-oss's
B2 H64 d64 S8k on an H200: the whole training step 2.4x slower), a packed one needs cuDNN >= 9.26
(older versions read out of bounds, the frontend says), and with dropout cuDNN 9.19 returns
dSink scaled by (1 - p). A sink enters only the softmax's denominator, so given the forward's
stats (which hold it) the sink-less backward's dQ, dK and dV are exactly the sink's, and dSink
is one small reduction of O, dO and the stats (``sink_fold.sink_gradient``, per token for
packed rows), run on a side stream beside the backward (``plan.py``). Forward cases, measured
with cuDNN 9.19 on an H100:

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
upper bound of the exact one, as delayed scaling needs).

A tensor placed by the caller's ragged offsets keeps cuDNN's own sink: its rows are not where
the sequence lengths alone put them.
"""

from __future__ import annotations

import torch

from ...core.problem import AttentionProblem


def applies(p: AttentionProblem) -> bool:
    """Whether ``p``'s sink is added after the run rather than inside cuDNN's graph."""
    if p.sink_token is None or p.offset_tensors:
        return False
    if not p.is_forward:
        return True
    return not p.is_thd and (p.is_fp8 or p.s_q == 1)


def stats_scratch(p: AttentionProblem, device: torch.device) -> torch.Tensor:
    """Where the log-sum-exp goes when the caller asked for none: ``[B, H, S_q, 1]`` float32."""
    return torch.empty((p.batch, p.h_q, p.s_q, 1), dtype=torch.float32, device=device)
