"""Packed shards' partial results kept where each call writes them, combined once at the end.

A rank's packed calls (``packed_schedule``) each give a partial result for some of its rows:
an output and its LSE in the forward, a dQ in the backward. Every call of a context-parallel
call is known before the first runs (the ring's steps, or the calls against the gathered K/V),
so each gets its own rows of one buffer (``PartsLayout``): the attention call writes its output
(or dQ) there directly, in q's dtype, and one pass at the end combines every row's partials
into the answer in its final dtype (``kernels.row_combine``). The forward and the backward make
the same calls in the same order, so they share a layout.

Dense shards merge as they go instead (``running_merge``): their blocks are views, few, and
already large.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..kernels.row_combine import combine_rows, where_of
from .packed_schedule import SegmentCall


@dataclass(frozen=True, eq=False)
class PartsLayout:
    """Where each call's rows sit in the parts buffer (``starts``, ``counts``, in the order the
    calls run), ``parts`` rows in all, and ``where`` (int32 ``[T, K]`` on the device): the part
    rows of each of the T result rows, -1 past its last."""

    starts: tuple[int, ...]
    counts: tuple[int, ...]
    parts: int
    where: torch.Tensor


def layout_of(calls: Sequence[SegmentCall], tokens: int, device: torch.device) -> PartsLayout:
    """The layout of ``calls`` (in the order they run) over a shard of ``tokens`` rows.

    Example, the ring's calls::

        layout = layout_of([c for step in packed_schedule.ring_steps(...) for c in step], t, device)
    """
    return _layout(tuple(calls), tokens, str(device))


@functools.lru_cache(maxsize=64)
def _layout(calls: tuple[SegmentCall, ...], tokens: int, device: str) -> PartsLayout:
    counts = tuple(call.row_count for call in calls)
    starts = tuple(int(s) for s in torch.tensor([0, *counts[:-1]], dtype=torch.int64).cumsum(0))
    rows = torch.cat([call.row_index() for call in calls]) if calls else torch.zeros(0, dtype=torch.int64)
    where = where_of(rows, tokens)
    return PartsLayout(starts, counts, rows.numel(), where.to(device))


class _Parts:
    """The parts buffer's rows, handed to the calls in order; their results are added in the
    same order (a step may place every call before adding any)."""

    def __init__(self, layout: PartsLayout, heads: int, dim: int, dtype: torch.dtype, device: torch.device):
        self.layout = layout
        self.parts = torch.empty(layout.parts, heads, dim, dtype=dtype, device=device)
        self._next = 0
        self._placed: collections.deque[slice] = collections.deque()
        self._span = slice(0, 0)

    def place(self, call: Any) -> torch.Tensor:
        """The rows the next call (a ``SegmentCall`` or a call wrapping one, with its
        ``row_count``) writes its result into."""
        i, layout = self._next, self.layout
        if i >= len(layout.counts) or layout.counts[i] != call.row_count:
            raise RuntimeError(f"packed call {i} does not match the layout its results were laid out for")
        self._next += 1
        span = slice(layout.starts[i], layout.starts[i] + layout.counts[i])
        self._placed.append(span)
        return self.parts[span]

    def keep(self, value: torch.Tensor) -> None:
        """The result of the first placed call not yet kept, unless it wrote it in place."""
        self._span = self._placed.popleft()
        target = self.parts[self._span]
        if value.data_ptr() != target.data_ptr():
            target.copy_(value)


class PartialOutputs(_Parts):
    """A packed shard's partial outputs and their LSEs; ``result`` combines them.

    Example::

        acc = PartialOutputs(layout, q.shape[1], d_v, q.dtype, q.device)
        for call in calls:
            o, lse = call.forward(q, k, v, out=acc.place(call))
            acc.add(call.rows, o, lse)
        out, lse = acc.result(q.dtype)
    """

    def __init__(self, layout: PartsLayout, heads: int, dim: int, dtype: torch.dtype, device: torch.device):
        super().__init__(layout, heads, dim, dtype, device)
        self.parts_lse = torch.empty(layout.parts, heads, dtype=torch.float32, device=device)

    def add(self, rows: object, o: torch.Tensor, lse: torch.Tensor) -> None:
        """The placed call's output ``o`` ``[M, H, D]`` and LSE ``[M, H, 1]``."""
        self.keep(o)
        self.parts_lse[self._span].copy_(lse.view(self.parts_lse[self._span].shape))

    def result(self, dtype: torch.dtype, sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [T, H, D] in dtype, lse float32 [T, H, 1])``; ``sink`` (float32, one value per
        head) one more term of every row's denominator."""
        tokens, heads = self.layout.where.shape[0], self.parts.shape[1]
        out = torch.empty(tokens, heads, self.parts.shape[2], dtype=dtype, device=self.parts.device)
        lse = torch.empty(tokens, heads, 1, dtype=torch.float32, device=self.parts.device)
        flat_sink = None if sink is None else sink.reshape(-1).float().contiguous()
        combine_rows(out, self.parts, self.layout.where, lse.view(tokens, heads), self.parts_lse, flat_sink)
        return out, lse


class PartialGrads(_Parts):
    """A packed shard's partial dQs; ``result`` sums them.

    Example::

        d_q = PartialGrads(layout, q.shape[1], q.shape[2], q.dtype, q.device)
        grads = call.backward(..., d_q=d_q.place(call))
        d_q.add(call.rows, grads[0])
        total = d_q.result(q.dtype)
    """

    def add(self, rows: object, grad: torch.Tensor) -> None:
        self.keep(grad)

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        tokens, (_, heads, dim) = self.layout.where.shape[0], self.parts.shape
        out = torch.empty(tokens, heads, dim, dtype=dtype, device=self.parts.device)
        combine_rows(out, self.parts, self.layout.where)
        return out
