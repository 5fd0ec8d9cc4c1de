"""``context_parallel_sdpa``: attention over a sequence sharded across the ranks of a process group.

Each rank passes its shard of q, k and v (``layout.shard``) and gets its shard of the output;
the result equals single-device attention over the whole sequence, and it is differentiable.
``mode="p2p"`` runs a ring (``ring.py``: K/V passed round while each rank attends, transfers
overlapped with attention); ``mode="all_gather"`` gathers K/V once (``gather.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..functional.arguments import materialised
from . import gather, ring
from .checks import CONTEXT, checked
from .exchange import Ring
from .packed_kv import PackedKV
from .process_group import Members, members


def context_parallel_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Any = None,
    is_causal: bool = False,
    scale: float | None = None,
    mode: str = "p2p",
    enable_gqa: bool = False,
    layout: str = "zigzag",
) -> torch.Tensor:
    """This rank's shard of ``softmax(q k^T * scale) v`` over the whole sharded sequence.

    q, k, v: this rank's shards ``[B, H, S_shard, D]`` (any strides, e.g. BSHD views), fp16 or
    bf16; every rank of ``group`` (a ``torch.distributed`` group, None for the default; NCCL for
    CUDA tensors, gloo for CPU ones) calls with equal shapes. ``layout`` says which positions
    a shard holds (``"zigzag"``: chunks r and 2W-1-r of 2W; ``"contiguous"``: chunk r of W) and
    matters only when causal. ``enable_gqa``: k/v may have fewer heads, dividing q's.
    Returns ``[B, H, S_shard, D_v]`` in q's dtype (contiguous). Arguments are checked across
    ranks the first time a call signature is seen: every rank raises alike, none is left waiting
    (ranks must change shapes together, as for any collective). Padded or packed (THD) shards
    raise ``UnsupportedError``.

    Example, on each of W ranks::

        q_local, k_local, v_local = (shard(t, seq_dim=2) for t in (q, k, v))
        out_local = context_parallel_sdpa(q_local, k_local, v_local, is_causal=True)
        out = unshard(out_local, seq_dim=2)   # == cudnn_attn.sdpa(q, k, v, is_causal=True)
    """
    m = members(group, CONTEXT)
    resolved = checked(q, k, v, m, is_causal, scale, mode, enable_gqa, layout)
    return attend(q, k, v, Setup(m, resolved, is_causal, mode, layout))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, setup: Setup) -> torch.Tensor:
    """``context_parallel_sdpa`` once its arguments are checked and resolved into ``setup``."""
    return _ContextParallel.apply(materialised(q), k, v, setup)


@dataclass(frozen=True)
class Setup:
    """One call's settings, as the autograd function carries them to the backward. ``ring_type``:
    the p2p exchange (a benchmark passes one that leaves the transfers out)."""

    members: Members
    scale: float
    is_causal: bool
    mode: str
    layout: str
    ring_type: type[Ring] = Ring

    def ring(self) -> Ring:
        return self.ring_type(self.members)


class _ContextParallel(torch.autograd.Function):
    """Forward keeps q, the packed local K/V, the output and its LSE; the backward runs the
    same mode again with them."""

    @staticmethod
    def forward(ctx, q, k, v, setup: Setup):  # type: ignore[override]
        packing = PackedKV.of(k, v)
        kv = packing.pack(k, v)
        if setup.mode == "p2p":
            out, lse = ring.forward(q, kv, packing, setup.ring(), setup.scale, setup.is_causal, setup.layout)
        else:
            out, lse = gather.forward(q, kv, packing, setup.members, setup.scale, setup.is_causal, setup.layout)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.setup, ctx.packing = setup, packing
        return out

    @staticmethod
    def backward(ctx, d_out):  # type: ignore[override]
        q, kv, out, lse = ctx.saved_tensors
        setup, packing = ctx.setup, ctx.packing
        d_out = d_out.contiguous()  # the backward graphs read dO in O's (contiguous) layout
        if setup.mode == "p2p":
            d_q, d_kv = ring.backward(q, kv, packing, out, d_out, lse, setup.ring(), setup.scale, setup.is_causal,
                                      setup.layout)  # fmt: skip
        else:
            d_q, d_kv = gather.backward(q, kv, packing, out, d_out, lse, setup.members, setup.scale,
                                        setup.is_causal, setup.layout)  # fmt: skip
        d_k, d_v = packing.views(d_kv)
        return d_q.to(q.dtype), d_k.to(q.dtype), d_v.to(q.dtype), None
