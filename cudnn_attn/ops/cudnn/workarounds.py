"""Known cuDNN bugs that lowering works around (docs/gpu_support.md keeps the table).

NaN gradients in the non-deterministic backward (seen with cuDNN 9.19 on H100 and H200;
public as torch issue #196678 and frontend issue #1072):

- S_kv = 64 (mod 128), no causal and no padding mask: dQ is NaN in every row whose log-sum-exp
  is low (below about -88.7 for bf16, about -11 - ln(1/(scale * |delta|)) for fp16): the
  kernel reads the zero-filled tail of the last key tile and exp(0 - lse) overflows.
- S_q = 1 with a low log-sum-exp: all of dK and dV are NaN.

A padding mask with every length full masks that tail and removes both, exactly (the scores
are unchanged); measured +5% to +34% backward time on the affected shapes only.
"""

from __future__ import annotations

from ...core.mask import Causal
from ...core.problem import AttentionProblem

TILE = 128  # the backward kernels' key tile


def full_lengths_reason(p: AttentionProblem) -> str | None:
    """Why ``p`` needs a padding mask with full lengths; None when it does not."""
    if p.is_forward or p.options.padding:
        return None
    return nan_backward_reason(p.s_q, p.s_kv, p.options.causal)


def nan_backward_reason(s_q: int, s_kv: int, causal: Causal) -> str | None:
    """Why cuDNN's backward of this geometry without a padding mask gives NaN; None if it does not."""
    if s_q == 1:
        return "backward with S_q = 1: NaN dK/dV on rows with a low log-sum-exp"
    if s_kv % TILE == TILE // 2 and causal is Causal.NONE:
        return f"backward with S_kv % {TILE} == {TILE // 2} and no causal mask: NaN dQ on rows with a low log-sum-exp"
    return None
