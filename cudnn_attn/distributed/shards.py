"""The two kinds of shards context parallelism runs over, and the attention calls each step makes.

``DenseShards``: ``[B, H, S_shard, D]`` shards of one sequence per batch row (``layout.py``);
a call selects rows and keys with slices (views, no copies). ``PackedShards``: ``[T_shard, H, D]``
shards of packed documents (``documents.py``), each document causal within itself; a call is a
packed (varlen) call over many documents' blocks (``packed_schedule.py``), its rows and keys
gathered by index where they are not the whole shard. ``ring.py`` and ``gather.py`` run either
through the same few methods: which calls a step makes, where their results go, and how the
whole sequence is put together from shards and cut back into them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..kernels.row_merge import add_rows, as_rows
from . import blocks, documents, packed_schedule, schedule
from . import layout as layouts
from .documents import Documents
from .partials import PartialGrads, PartialOutputs, layout_of
from .running_merge import RunningGrads, RunningOutput

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class DenseShards:
    """Dense shards of ``shard_len`` positions; ``left``: a causal window's left bound (None: none)."""

    layout: str
    is_causal: bool
    left: int | None
    rank: int
    world: int
    shard_len: int
    scale: float
    seq_dim = 2

    def ring_steps(self, device: torch.device) -> list[list[DenseCall]]:
        """The calls of each ring step, in the ring's order (at step i, the K/V of rank r - i)."""
        return [self.ring_calls((self.rank - i) % self.world) for i in range(self.world)]

    def ring_calls(self, src: int) -> list[DenseCall]:
        found = schedule.ring_blocks(self.layout, self.is_causal, self.rank, src, self.world, self.shard_len, self.left)
        return [DenseCall(block, self.scale) for block in found]

    def gathered_calls(self, device: torch.device) -> list[DenseCall]:
        found = schedule.all_gathered_blocks(
            self.layout, self.is_causal, self.rank, self.world, self.shard_len, self.left
        )
        return [DenseCall(block, self.scale) for block in found]

    def running_output(self, q: torch.Tensor, d_v: int, calls: Sequence[Any]) -> RunningOutput:
        """What the outputs of ``calls`` (every call to come, in order) merge into."""
        return RunningOutput(q.shape[:3], d_v, q.device)

    def query_grads(self, q: torch.Tensor, calls: Sequence[Any]) -> RunningGrads:
        """What the dQs of ``calls`` add up in."""
        return RunningGrads(q.shape, q.device)

    def row_stats(self, lse: torch.Tensor) -> Callable[[Any], torch.Tensor]:
        """The LSE of a slice of rows, contiguous as the backward graphs read it (each made once)."""
        made: dict[tuple, torch.Tensor] = {}

        def of(rows: slice) -> torch.Tensor:
            key = (rows.start, rows.stop)
            if key not in made:
                made[key] = lse if rows == schedule.ALL else lse[:, :, rows].contiguous()
            return made[key]

        return of

    def join(self, shards: list[torch.Tensor]) -> torch.Tensor:
        return layouts.join_shards(shards, self.layout, self.seq_dim)

    def shard_of(self, whole: torch.Tensor, rank: int) -> torch.Tensor:
        return layouts.shard_of(whole, self.layout, rank, self.world, self.seq_dim)

    def per_head(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (``[B, H, S, ·]``) as ``[B, H, S, ·]``: the layout the sink's terms are summed in."""
        return t


@dataclass(frozen=True)
class DenseCall:
    """One block of dense shards: rows and keys are slices along the sequence."""

    block: schedule.Block
    scale: float

    @property
    def rows(self) -> slice:
        return self.block.rows

    @property
    def every_key(self) -> bool:
        return self.block.keys == schedule.ALL

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(o, lse)`` of the block, in tensors of its own (``out``: None, see ``running_output``)."""
        b = self.block
        o, lse = blocks.forward(q[:, :, b.rows], k[:, :, b.keys], v[:, :, b.keys], self.scale, b.mask, b.window)
        return o, lse

    def backward(
        self, q, k, v, out, d_out, stats_of: Callable[[Any], torch.Tensor], d_q: torch.Tensor | None = None
    ) -> Grads:
        """``(dq, dk, dv)`` of the block, in tensors of their own (``d_q``: None, see ``query_grads``)."""
        b = self.block
        grad_q, d_k, d_v = blocks.backward(
            q[:, :, b.rows],
            k[:, :, b.keys],
            v[:, :, b.keys],
            out[:, :, b.rows],
            d_out[:, :, b.rows],
            stats_of(b.rows),
            self.scale,
            b.mask,
            b.window,
        )
        return grad_q, d_k, d_v

    def add_grads(self, d_k: torch.Tensor, d_v: torch.Tensor, grads: Grads, first: bool = False) -> None:
        """dK and dV into float32 ``d_k``/``d_v`` (written, not added, when ``first``)."""
        start = self.block.keys.indices(d_k.shape[2])[0]
        add_rows(d_k, grads[1], start, first)
        add_rows(d_v, grads[2], start, first)


@dataclass(frozen=True)
class PackedShards:
    """Shards of packed documents ``docs``, each document causal within itself when ``is_causal``."""

    docs: Documents
    is_causal: bool
    left: int | None
    rank: int
    scale: float
    seq_dim = 0

    @property
    def world(self) -> int:
        return self.docs.world

    def ring_steps(self, device: torch.device) -> list[list[PackedCall]]:
        """The calls of each ring step, in the ring's order (at step i, the K/V of rank r - i)."""
        steps = packed_schedule.ring_steps(self.docs, self.is_causal, self.rank, self.left, device)
        return [[PackedCall(call, self.scale) for call in found] for found in steps]

    def gathered_calls(self, device: torch.device) -> list[PackedCall]:
        found = packed_schedule.gathered_calls(self.docs, self.is_causal, self.rank, self.left, device)
        return [PackedCall(call, self.scale) for call in found]

    def running_output(self, q: torch.Tensor, d_v: int, calls: Sequence[Any]) -> PartialOutputs:
        """Where the outputs of ``calls`` (every call to come, in order) are kept until combined."""
        layout = layout_of([c.call for c in calls], q.shape[0], q.device)
        return PartialOutputs(layout, q.shape[1], d_v, q.dtype, q.device)

    def query_grads(self, q: torch.Tensor, calls: Sequence[Any]) -> PartialGrads:
        """Where the dQs of ``calls`` are kept until summed."""
        layout = layout_of([c.call for c in calls], q.shape[0], q.device)
        return PartialGrads(layout, q.shape[1], q.shape[2], q.dtype, q.device)

    def row_stats(self, lse: torch.Tensor) -> Callable[[Any], torch.Tensor]:
        return lambda rows: lse if isinstance(rows, slice) else lse.index_select(0, rows)

    def join(self, shards: list[torch.Tensor]) -> torch.Tensor:
        return documents.join_shards(shards, self.docs, self.seq_dim)

    def shard_of(self, whole: torch.Tensor, rank: int) -> torch.Tensor:
        return documents.shard_of(whole, self.docs, rank, self.seq_dim)

    def per_head(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (``[T, H, ·]``) as ``[1, H, T, ·]``: the layout the sink's terms are summed in."""
        return t.transpose(0, 1).unsqueeze(0)


@dataclass(frozen=True)
class PackedCall:
    """One packed call: its rows and keys are index tensors into the shard and the K/V (or all)."""

    call: packed_schedule.SegmentCall
    scale: float

    @property
    def rows(self) -> slice | torch.Tensor:
        return schedule.ALL if self.call.rows is None else self.call.rows

    @property
    def row_count(self) -> int:
        return self.call.row_count

    @property
    def every_key(self) -> bool:
        return self.call.keys is None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(o [M, H, D_v], lse [M, H, 1])`` of the call's M rows; ``o`` written into ``out`` if given."""
        c = self.call
        o, stats = blocks.packed_forward(
            _take(q, c.rows),
            _take(k, c.keys),
            _take(v, c.keys),
            c.lengths_q,
            c.lengths_k,
            c.max_q,
            c.max_k,
            self.scale,
            c.mask,
            c.window,
            out,
        )
        # stats [slots, H, max_q, 1] -> each row's [H, 1], in the call's row order
        return o, stats.squeeze(-1).permute(0, 2, 1)[c.sequence, c.position].unsqueeze(-1)

    def backward(
        self, q, k, v, out, d_out, stats_of: Callable[[Any], torch.Tensor], d_q: torch.Tensor | None = None
    ) -> Grads:
        """``(dq, dk, dv)`` of the call's rows and keys; dq written into ``d_q`` if given."""
        c = self.call
        rows_lse = stats_of(self.rows)
        stats = torch.zeros(c.lengths_q.shape[0], c.max_q, q.shape[1], dtype=torch.float32, device=q.device)
        stats[c.sequence, c.position] = rows_lse.squeeze(-1)
        stats = stats.permute(0, 2, 1).unsqueeze(-1).contiguous()
        return blocks.packed_backward(
            _take(q, c.rows),
            _take(k, c.keys),
            _take(v, c.keys),
            _take(out, c.rows),
            _take(d_out, c.rows),
            stats,
            c.lengths_q,
            c.lengths_k,
            c.max_q,
            c.max_k,
            self.scale,
            c.mask,
            c.window,
            d_q,
        )

    def add_grads(self, d_k: torch.Tensor, d_v: torch.Tensor, grads: Grads, first: bool = False) -> None:
        """dK and dV into float32 ``d_k``/``d_v`` (written, not added, when ``first``)."""
        c = self.call
        for target, grad in ((d_k, grads[1]), (d_v, grads[2])):
            if c.keys is None or c.keys_unique:  # one pass over the keys
                add_rows(as_rows(target), as_rows(grad), 0 if c.keys is None else c.keys, first)
            else:  # a document's chunk seen by two of its segments: index_add_ sums the repeats
                target.index_add_(0, c.keys, grad.to(target.dtype))


def _take(t: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """``t``'s rows at ``index`` (all: ``t`` itself), contiguous as the packed plans read them."""
    return t.contiguous() if index is None else t.index_select(0, index)
