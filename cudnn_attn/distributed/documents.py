"""Packed documents over a group: each document cut into chunks as ``layout.py`` cuts one sequence.

``cu_seqlens`` (int32 or int64 ``[N + 1]``, from 0) marks where each of N documents starts in
the whole packed sequence (``[T, H, D]``, documents back to back). Each document is cut into
equal chunks (``"zigzag"``: 2W, rank r holds chunks r and 2W-1-r of every document, so under a
per-document causal mask every rank has the same work; ``"contiguous"``: W, rank r chunk r).
A rank's shard holds its chunks of document 0, then of document 1, and so on (the order of
TransformerEngine's THD context parallelism), T / W tokens, document d's from ``cu[d] / W``.
Every document's length must divide into its chunks: pad each to a multiple of 2W (zigzag).
Equivalent plain torch of rank r's zigzag shard::

    docs = [x[s:e].chunk(2 * W) for s, e in zip(cu[:-1], cu[1:])]
    shard = torch.cat([d[i] for d in docs for i in (r, 2 * W - 1 - r)])

The lengths are read on the host once per ``cu_seqlens`` tensor and content (a device sync
when it is on a GPU): pass the same tensor to every layer of a step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ..core.derived import derived
from .chunks import chunk_ids, chunks_per_rank


@dataclass(frozen=True)
class Documents:
    """The lengths of the whole documents and how ``world`` ranks hold them under ``layout``.

    Example, two documents of 8 and 4 tokens over 2 ranks (zigzag: chunks of 2 and 1)::

        docs = Documents((8, 4), 2, "zigzag")
        docs.local_lengths == (4, 2); docs.positions(0) == [(0, 2), (6, 8), (8, 9), (11, 12)]
    """

    lengths: tuple[int, ...]
    world: int
    layout: str

    @property
    def starts(self) -> tuple[int, ...]:
        """Where each document starts in the whole sequence."""
        return _running(self.lengths)

    @property
    def local_lengths(self) -> tuple[int, ...]:
        return tuple(n // self.world for n in self.lengths)

    @property
    def local_starts(self) -> tuple[int, ...]:
        """Where each document's part starts in a shard (the same on every rank)."""
        return _running(self.local_lengths)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def positions(self, rank: int) -> list[tuple[int, int]]:
        """The ``[start, stop)`` ranges of the whole sequence that ``rank``'s shard holds, in order."""
        parts = chunks_per_rank(self.layout) * self.world
        ranges = []
        for start, n in zip(self.starts, self.lengths):
            c = n // parts
            ranges += [(start + i * c, start + (i + 1) * c) for i in chunk_ids(self.layout, rank, self.world)]
        return ranges


def host_lengths(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """Each document's length, read once per content of ``cu_seqlens``."""
    on_host = derived(cu_seqlens, _on_host)
    return tuple((on_host[1:] - on_host[:-1]).tolist())


def cu_problems(cu: Any, world: int, layout: str, tokens: int | None, max_seqlen: Any) -> list[str]:
    """What is wrong with ``cu_seqlens`` (and ``max_seqlen``) for shards of ``tokens`` tokens
    (None: unknown, the shards were refused), one line each."""
    if not isinstance(cu, torch.Tensor):
        return [f"cu_seqlens: {type(cu).__name__}; expected an int32 tensor [documents + 1]"]
    if cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1 or cu.shape[0] < 2:
        return [
            f"cu_seqlens: {str(cu.dtype).removeprefix('torch.')} {list(cu.shape)}; expected int32 or int64 "
            "[documents + 1] with at least one document"
        ]
    values = derived(cu, _on_host)
    lengths = values[1:] - values[:-1]
    problems = []
    if int(values[0]) != 0:
        problems.append(f"cu_seqlens: starts at {int(values[0])}; must start at 0")
    if (lengths < 0).any():
        at = int(torch.nonzero(lengths < 0)[0])
        problems.append(f"cu_seqlens: decreases at index {at + 1}; must not decrease")
    parts = chunks_per_rank(layout) * world
    if (lengths % parts).any():
        at = int(torch.nonzero(lengths % parts)[0])
        problems.append(
            f"cu_seqlens: document {at} has length {int(lengths[at])}, not a multiple of {parts} "
            f"({world} ranks, layout={layout!r}: every document is cut into {parts} equal chunks); "
            f"pad each document to a multiple of {parts}"
        )
    if tokens is not None and int(values[-1]) != tokens * world:
        problems.append(
            f"cu_seqlens: ends at {int(values[-1])}, but {world} shards of {tokens} tokens hold "
            f"{tokens * world}; cu_seqlens describes the whole packed sequence"
        )
    if max_seqlen is not None:
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 1:
            problems.append(f"max_seqlen: {max_seqlen!r}; expected an int >= 1 or None")
        elif lengths.numel() and int(lengths.max()) > max_seqlen:
            problems.append(
                f"max_seqlen: {max_seqlen}; document {int(torch.argmax(lengths))} has length {int(lengths.max())}"
            )
    return problems


def shard_index(docs: Documents, rank: int, device: torch.device | str) -> torch.Tensor:
    """The whole sequence's positions ``rank``'s shard holds, in shard order (int64)."""
    return _index(docs, rank, str(device))


def shard_of(x: torch.Tensor, docs: Documents, rank: int, dim: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the whole packed ``x`` along ``dim`` (a new tensor; no checks)."""
    return x.index_select(dim, shard_index(docs, rank, x.device))


def join_shards(shards: list[torch.Tensor], docs: Documents, dim: int) -> torch.Tensor:
    """The whole packed sequence from every rank's shard (rank order)."""
    index = torch.cat([shard_index(docs, rank, shards[0].device) for rank in range(len(shards))])
    stacked = torch.cat(shards, dim=dim)
    return torch.empty_like(stacked).index_copy_(dim, index, stacked)


@functools.lru_cache(maxsize=64)
def _index(docs: Documents, rank: int, device: str) -> torch.Tensor:
    ranges = docs.positions(rank)
    parts = [torch.arange(start, stop, dtype=torch.int64) for start, stop in ranges]
    return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)).to(device)


def _on_host(cu: torch.Tensor) -> torch.Tensor:
    return cu.to("cpu", torch.int64, copy=True)


def _running(lengths: tuple[int, ...]) -> tuple[int, ...]:
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += n
    return tuple(starts)
