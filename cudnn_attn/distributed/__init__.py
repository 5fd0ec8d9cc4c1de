"""``cudnn_attn.distributed``: context parallelism, attention over a sequence sharded across ranks.

Each rank of a ``torch.distributed`` process group (NCCL on GPUs, gloo on CPUs) holds a shard
of the sequence; ``context_parallel_sdpa`` returns its shard of the attention output, equal
to single-device attention over the whole sequence, and differentiable. ``shard`` cuts a
full tensor into this rank's shard (local); ``unshard`` rejoins every rank's (a collective).

    import torch.distributed as dist
    from cudnn_attn.distributed import context_parallel_sdpa, shard, unshard

    dist.init_process_group("nccl")                       # one process per GPU
    q, k, v = (shard(t, seq_dim=2) for t in (q_full, k_full, v_full))   # zigzag by default
    out = context_parallel_sdpa(q, k, v, is_causal=True)  # mode="p2p": a ring, overlapped
    out_full = unshard(out, seq_dim=2)

Packed documents (THD, ``cu_seqlens``: each document causal within itself) are sharded per
document, each cut into 2W chunks as one sequence is, so every rank has the same work::

    q_local = shard(q_packed, cu_seqlens=cu)              # [T / W, H, D]
    out = context_parallel_sdpa(q_local, k_local, v_local, cu_seqlens=cu, is_causal=True)
    out_full = unshard(out, cu_seqlens=cu)

``window_size=(left, 0)`` (a causal sliding window) skips the blocks and ring steps it cannot
see; ``sinks`` (a logit per head) is one more term of the final merge. Padding masks, bias and
dropout are not supported.
"""

from __future__ import annotations

from .checks import MODES
from .context_parallel import context_parallel_sdpa
from .layout import LAYOUTS, shard, unshard

__all__ = ["LAYOUTS", "MODES", "context_parallel_sdpa", "shard", "unshard"]
