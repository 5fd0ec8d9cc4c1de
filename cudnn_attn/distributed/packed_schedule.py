"""Which packed attention calls a rank makes: the dense schedule per document, in few calls.

Every document is sharded as one sequence is (``documents.py``), so its blocks at a ring step,
or against the gathered K/V, are the dense schedule's (``schedule.ring_blocks``,
``schedule.all_gathered_blocks``) over its own part of the shard. Each block becomes a segment,
a run of query rows against a run of keys; the segments of every document that share a mask
become the sequences of one packed (varlen) call, so a step costs a call or two whatever the
number of documents, and blocks a document never sees are not in it. A query row is in at most
one segment of a call (its partial results merge by row); a block of a row already taken opens
another call. A call whose rows (or keys) are all of them, in order, reads the tensors in place;
otherwise its rows and keys are gathered into compact copies.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..varlen import bucket
from . import schedule
from .documents import Documents

Segment = tuple[int, int, int, int]  # query rows [q0, q1), keys [k0, k1)


@dataclass(frozen=True, eq=False)
class SegmentCall:
    """One packed call: its sequences' rows (None: every row of the shard, in order) and keys
    (None: every token of the K/V), per-sequence lengths (int32 ``[slots, 1, 1, 1]``, bucketed
    slots), maxima (bucketed), its mask and window, and where each row's LSE sits in the call's
    stats ``[slots, H, max_q, 1]`` (``sequence``, ``position``); its ``segments`` (on the host,
    in the order of its rows) and whether each key is in it once (``keys_unique``)."""

    rows: torch.Tensor | None
    keys: torch.Tensor | None
    lengths_q: torch.Tensor
    lengths_k: torch.Tensor
    max_q: int
    max_k: int
    mask: str
    window: int | None
    sequence: torch.Tensor
    position: torch.Tensor
    segments: tuple[Segment, ...]
    keys_unique: bool

    @property
    def row_count(self) -> int:
        return sum(q1 - q0 for q0, q1, _, _ in self.segments)

    def row_index(self) -> torch.Tensor:
        """Its rows, on the host (int64), in the order the call reads them."""
        return torch.cat([torch.arange(q0, q1) for q0, q1, _, _ in self.segments])


def ring_steps(
    docs: Documents, is_causal: bool, rank: int, left: int | None, device: torch.device
) -> tuple[tuple[SegmentCall, ...], ...]:
    """Rank ``rank``'s calls at each ring step, in the order the ring visits them (at step i,
    the K/V of rank ``rank - i``)."""
    return tuple(ring_calls(docs, is_causal, rank, (rank - i) % docs.world, left, device) for i in range(docs.world))


def ring_calls(
    docs: Documents, is_causal: bool, rank: int, src: int, left: int | None, device: torch.device
) -> tuple[SegmentCall, ...]:
    """The calls of rank ``rank`` against the K/V shard of rank ``src``; () when it sees none.

    Example, each document causal over its own part at the rank's own step (one call)::

        (call,) = ring_calls(Documents((8, 4), 2, "zigzag"), True, 0, 0, None, torch.device("cpu"))
    """
    return _ring_calls(docs, is_causal, rank, src, left, str(device))


def gathered_calls(
    docs: Documents, is_causal: bool, rank: int, left: int | None, device: torch.device
) -> tuple[SegmentCall, ...]:
    """The calls of rank ``rank`` against the gathered K/V (the whole packed sequence, in order)."""
    return _gathered_calls(docs, is_causal, rank, left, str(device))


@functools.lru_cache(maxsize=256)
def _ring_calls(
    docs: Documents, is_causal: bool, rank: int, src: int, left: int | None, device: str
) -> tuple[SegmentCall, ...]:
    segments = []
    for local, n in zip(docs.local_starts, docs.local_lengths):
        for block in schedule.ring_blocks(docs.layout, is_causal, rank, src, docs.world, n, left):
            segments.append((block, local, local, n, n))
    tokens = sum(docs.local_lengths)
    return _calls(segments, tokens, tokens, device)


@functools.lru_cache(maxsize=64)
def _gathered_calls(
    docs: Documents, is_causal: bool, rank: int, left: int | None, device: str
) -> tuple[SegmentCall, ...]:
    segments = []
    for local, start, n in zip(docs.local_starts, docs.starts, docs.local_lengths):
        for block in schedule.all_gathered_blocks(docs.layout, is_causal, rank, docs.world, n, left):
            segments.append((block, local, start, n, n * docs.world))
    return _calls(segments, sum(docs.local_lengths), docs.tokens, device)


def _calls(
    blocks: list[tuple[schedule.Block, int, int, int, int]], rows: int, keys: int, device: str
) -> tuple[SegmentCall, ...]:
    """Blocks (with where their rows and keys start, and how many the document has of each)
    grouped into calls by mask, rows unique per call."""
    groups: dict[tuple[str, int | None], list[list[Segment]]] = {}
    for block, row_base, key_base, row_count, key_count in blocks:
        (q0, q1, _), (k0, k1, _) = block.rows.indices(row_count), block.keys.indices(key_count)
        q0, q1, k0, k1 = row_base + q0, row_base + q1, key_base + k0, key_base + k1
        if q1 <= q0 or k1 <= k0:
            continue
        calls = groups.setdefault((block.mask, block.window), [])
        for segments in calls:  # the first call with none of these rows
            if all(q1 <= s[0] or s[1] <= q0 for s in segments):
                segments.append((q0, q1, k0, k1))
                break
        else:
            calls.append([(q0, q1, k0, k1)])
    made = []
    for (mask, window), calls in groups.items():
        for segments in calls:
            made.append(_call(sorted(segments), rows, keys, mask, window, device))
    return tuple(made)


def _call(segments: list[Segment], rows: int, keys: int, mask: str, window: int | None, device: str) -> SegmentCall:
    lengths_q = [q1 - q0 for q0, q1, _, _ in segments]
    lengths_k = [k1 - k0 for _, _, k0, k1 in segments]
    row_index = torch.cat([torch.arange(q0, q1) for q0, q1, _, _ in segments])
    key_index = torch.cat([torch.arange(k0, k1) for _, _, k0, k1 in segments])
    sequence = torch.repeat_interleave(torch.arange(len(segments)), torch.tensor(lengths_q))
    starts = torch.tensor([0, *lengths_q[:-1]]).cumsum(0)
    position = torch.arange(row_index.numel()) - torch.repeat_interleave(starts, torch.tensor(lengths_q))
    slots = bucket(len(segments), 1)
    per_slot = [torch.tensor(n, dtype=torch.int32).view(-1) for n in (lengths_q, lengths_k)]
    lengths = [torch.zeros(slots, 1, 1, 1, dtype=torch.int32) for _ in per_slot]
    for out, values in zip(lengths, per_slot):
        out.view(-1)[: values.numel()] = values
    return SegmentCall(
        rows=None if _in_order(row_index, rows) else row_index.to(device),
        keys=None if _in_order(key_index, keys) else key_index.to(device),
        lengths_q=lengths[0].to(device),
        lengths_k=lengths[1].to(device),
        max_q=bucket(max(lengths_q)),
        max_k=bucket(max(lengths_k)),
        mask=mask,
        window=window,
        sequence=sequence.to(device),
        position=position.to(device),
        segments=tuple(segments),
        keys_unique=key_index.unique().numel() == key_index.numel(),
    )


def _in_order(index: torch.Tensor, count: int) -> bool:
    return index.numel() == count and bool(torch.equal(index, torch.arange(count)))
