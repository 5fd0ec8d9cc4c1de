"""``context_parallel_sdpa``: attention over a sequence sharded across the ranks of a process group.

Each rank passes its shard of q, k and v (``layout.shard``) and gets its shard of the output;
the result equals single-device attention over the whole sequence, and it is differentiable.
``mode="p2p"`` runs a ring (``ring.py``: K/V passed round while each rank attends, transfers
overlapped with attention); ``mode="all_gather"`` gathers K/V once (``gather.py``). Shards are
dense (one sequence per batch row) or packed documents (``cu_seqlens``, ``documents.py``); a
causal sliding window skips the blocks it cannot see; sinks fold into the final merge once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..core.score_inputs import sink_token
from ..core.sink_fold import sink_gradient
from ..functional.arguments import materialised
from ..runtime import backend_choice
from . import gather, ring
from .checks import CONTEXT, checked
from .exchange import Ring
from .packed_kv import PackedKV
from .process_group import Members, members
from .ring import Shards
from .shards import DenseShards, PackedShards


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
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    window_size: tuple[int, int] = (-1, -1),
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's shard of ``softmax(q k^T * scale) v`` over the whole sharded sequence.

    Every rank of ``group`` calls it with its own shards and equal shapes; the result equals
    single-device attention over the whole sequence, and it is differentiable. Arguments are
    checked across ranks the first time a call signature is seen: every rank raises alike, none
    is left waiting (ranks change shapes together, as for any collective).

    Args:
        q: this rank's query shard ``[B, H, S_shard, D]`` (any strides, e.g. BSHD views), fp16,
            bf16 or float32; with ``cu_seqlens``, ``[T_shard, H, D]`` of packed documents.
        k: the key shard, ``q``'s layout with ``H_kv`` heads (``H_kv`` divides ``H`` with
            ``enable_gqa``).
        v: the value shard, as ``k`` with head dim ``D_v``.
        group: a ``torch.distributed`` group, None for the default (NCCL for CUDA tensors, gloo
            for CPU ones).
        is_causal: causal attention (over packed documents: each document causal within itself).
        scale: the scores' scale; None: ``1 / sqrt(D)``.
        mode: ``"p2p"`` (a ring: K/V passed round while each rank attends, transfers overlapped)
            or ``"all_gather"`` (K/V gathered once).
        enable_gqa: k/v may have fewer heads, dividing q's.
        layout: which positions a shard holds: ``"zigzag"`` (chunks r and 2W-1-r of 2W, the same
            causal work on every rank) or ``"contiguous"`` (chunk r of W); as ``shard`` cut them.
        cu_seqlens: packed documents: int32/int64 ``[N + 1]``, the whole packed sequence's
            offsets, the same tensor on every rank; each document is cut as one sequence is, so
            every document's length is a multiple of 2W (zigzag) or W (contiguous).
        max_seqlen: optional, the longest document (checked against ``cu_seqlens``).
        window_size: ``(left, 0)``: a causal sliding window, query p keeps keys p - left .. p
            (as ``cudnn_attn.sdpa``); blocks and ring steps the window cannot see are skipped.
        sinks: attention sinks, a logit per query head (``[H]``), learnable; its gradient on
            each rank is this rank's rows' share (summed over the group, as data- and
            context-parallel gradient reduction forms it, it is the whole gradient).

    Returns:
        This rank's output shard: q's layout with V's head dim, in q's dtype (contiguous).

    Raises:
        ValidationError: malformed shards or arguments on any rank (every rank raises, naming
            the rank that refused its own), or a process group that is not initialised.
        UnsupportedError: what the ranks' backend cannot run (right window bounds, ...).

    Example:
        ```python
        # on each of W ranks, after torch.distributed.init_process_group(...)
        q_local, k_local, v_local = (shard(t, seq_dim=2) for t in (q, k, v))
        out_local = context_parallel_sdpa(q_local, k_local, v_local, is_causal=True)
        out = unshard(out_local, seq_dim=2)  # == cudnn_attn.sdpa(q, k, v, is_causal=True)

        q_local, k_local, v_local = (shard(t, cu_seqlens=cu) for t in (q_packed, k_packed, v_packed))
        out_local = context_parallel_sdpa(q_local, k_local, v_local, cu_seqlens=cu, is_causal=True)
        ```
    """
    m = members(group, CONTEXT)
    c = checked(
        q,
        k,
        v,
        m,
        is_causal,
        scale,
        mode,
        enable_gqa,
        layout,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        window_size=window_size,
        sinks=sinks,
    )
    return attend(q, k, v, Setup(m, c.scale, c.is_causal, mode, layout, left=c.left, documents=c.documents), sinks)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, setup: Setup, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """``context_parallel_sdpa`` once its arguments are checked and resolved into ``setup``."""
    if setup.documents is not None:  # packed plans read contiguous tokens
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _ContextParallel.apply(materialised(q), k, v, sinks, setup)


@dataclass(frozen=True)
class Setup:
    """One call's settings, as the autograd function carries them to the backward. ``left``:
    a causal window's left bound; ``documents``: packed shards' documents (None: dense);
    ``ring_type``: the p2p exchange (a benchmark passes one that leaves the transfers out)."""

    members: Members
    scale: float
    is_causal: bool
    mode: str
    layout: str
    ring_type: type[Ring] = Ring
    left: int | None = None
    documents: Any = None

    def ring(self) -> Ring:
        return self.ring_type(self.members)

    def shards(self, q: torch.Tensor) -> Shards:
        m = self.members
        if self.documents is not None:
            return PackedShards(self.documents, self.is_causal, self.left, m.rank, self.scale)
        return DenseShards(self.layout, self.is_causal, self.left, m.rank, m.world, q.shape[2], self.scale)


@backend_choice.kept_for_backward
class _ContextParallel(torch.autograd.Function):
    """Forward keeps q, the packed local K/V, the output and its LSE; the backward runs the
    same mode again with them, and gives the sinks the gradient of their column."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, setup: Setup):  # type: ignore[override]
        packing = PackedKV.of(k, v)
        kv = packing.pack(k, v)
        shards = setup.shards(q)
        token = sink_token(sinks, q)
        sink = None if token is None else _sink_like(shards, token)
        if setup.mode == "p2p":
            out, lse = ring.forward(q, kv, packing, setup.ring(), shards, sink)
        else:
            out, lse = gather.forward(q, kv, packing, setup.members, shards, sink)
        ctx.save_for_backward(q, kv, out, lse, sink)
        ctx.setup, ctx.packing, ctx.shards = setup, packing, shards
        ctx.sink_meta = None if sinks is None else (sinks.shape, sinks.dtype)
        return out

    @staticmethod
    def backward(ctx, d_out):  # type: ignore[override]
        q, kv, out, lse, sink = ctx.saved_tensors
        setup, packing, shards = ctx.setup, ctx.packing, ctx.shards
        d_out = d_out.contiguous()  # the backward graphs read dO in O's (contiguous) layout
        if setup.mode == "p2p":
            d_q, d_kv = ring.backward(q, kv, packing, out, d_out, lse, setup.ring(), shards)
        else:
            d_q, d_kv = gather.backward(q, kv, packing, out, d_out, lse, setup.members, shards)
        d_k, d_v = packing.views(d_kv)
        d_sink = None
        if sink is not None:  # this rank's rows' share (see context_parallel_sdpa)
            per_head = [shards.per_head(t) for t in (out, d_out, lse, sink)]
            shape, dtype = ctx.sink_meta
            d_sink = sink_gradient(*per_head).reshape(shape).to(dtype)
        return d_q.to(q.dtype), d_k.to(q.dtype), d_v.to(q.dtype), d_sink, None


def _sink_like(shards: Shards, sink: torch.Tensor) -> torch.Tensor:
    """The float32 ``[1, H, 1, 1]`` sink as it broadcasts to the shards' LSE (packed: ``[1, H, 1]``)."""
    return sink if isinstance(shards, DenseShards) else sink.view(1, -1, 1)
