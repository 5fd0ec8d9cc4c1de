"""Which attention blocks a rank computes: per ring step, and over the gathered sequence.

Ring (``mode="p2p"``), K/V of rank ``src`` visiting rank ``r`` (shard length S, half h = S/2):

- not causal: every query row against every key.
- ``"contiguous"`` (r holds chunk r of W): src < r every key, src == r causal (top-left),
  src > r nothing (all of its keys are later).
- ``"zigzag"`` (r holds chunks r and 2W-1-r of 2W): src == r causal over the whole shard
  (its second chunk follows its first, so one top-left diagonal is exact); src < r every
  row against the first half of the keys (chunk src precedes both of r's chunks; chunk
  2W-1-src follows both); src > r the second half of the rows against every key (chunk
  2W-1-r follows both of src's chunks; chunk r precedes both).

Gathered (``mode="all_gather"``), K/V of the whole sequence in order: each of r's chunks
against the keys up to the end of that chunk, causal aligned bottom-right.

A causal sliding window (``left``: query p keeps keys p - left .. p) cuts more: a query chunk a
against a key chunk b (both c long) sees nothing when b > a or when b's last key is more than
``left`` before a's first query (``pair_spans``); ring steps whose pairs see nothing compute
nothing. A pair it sees in part splits into rows that see every key (no mask) and a band, rows
against the keys from their window's start on: with both trimmed so that the band's first row
starts at its first key, key j' is kept iff j' >= i' (a left bound of 1 on the top-left
diagonal, no causal bound). Gathered, each chunk needs only the keys from ``left`` before its
first query: causal bottom-right with the window, exact.
"""

from __future__ import annotations

from dataclasses import dataclass

from .chunks import chunk_ids, chunks_per_rank

ALL = slice(None)


@dataclass(frozen=True)
class Block:
    """Query rows and key positions of one attention call, and its mask (``blocks.MASKS``);
    ``window``: also a left bound W (key j kept iff j > d(i) - W, d(i) the mask's diagonal)."""

    rows: slice
    keys: slice
    mask: str
    window: int | None = None


def ring_block(layout: str, is_causal: bool, rank: int, src: int, shard_len: int) -> Block | None:
    """The block rank ``rank`` computes with the K/V shard of rank ``src``; None: fully masked.

    Example, zigzag, rank 1 with rank 0's K/V: every row, the first half of the keys::

        ring_block("zigzag", True, 1, 0, 8) == Block(slice(None), slice(0, 4), "none")
    """
    if not is_causal:
        return Block(ALL, ALL, "none")
    if src == rank:
        return Block(ALL, ALL, "top_left")
    if layout == "contiguous":
        return Block(ALL, ALL, "none") if src < rank else None
    half = shard_len // 2
    if src < rank:
        return Block(ALL, slice(0, half), "none")
    return Block(slice(half, None), ALL, "none")


def gathered_blocks(layout: str, is_causal: bool, rank: int, world: int, shard_len: int) -> list[Block]:
    """The calls rank ``rank`` makes against the gathered, in-order K/V (length W * S).

    Example, zigzag over 2 ranks, rank 0 (chunks 0 and 3 of 4, S = 8)::

        [Block(slice(0, 4), slice(0, 4), "bottom_right"), Block(slice(4, 8), slice(0, 16), "bottom_right")]
    """
    if not is_causal:
        return [Block(ALL, ALL, "none")]
    if layout == "contiguous":
        return [Block(ALL, slice(0, (rank + 1) * shard_len), "bottom_right")]
    c = shard_len // 2
    return [
        Block(slice(0, c), slice(0, (rank + 1) * c), "bottom_right"),
        Block(slice(c, shard_len), slice(0, (2 * world - rank) * c), "bottom_right"),
    ]


def ring_blocks(
    layout: str, is_causal: bool, rank: int, src: int, world: int, shard_len: int, left: int | None = None
) -> list[Block]:
    """Every block rank ``rank`` computes with the K/V shard of rank ``src``; ``left``: a causal
    sliding window's left bound (None: none). Empty: the step computes nothing.

    Example, zigzag over 2 ranks, S = 8 (chunks of 4), a window of 2 on rank 1's own shard
    (chunks 1 and 2): each chunk causal with the window, and chunk 2's first rows against the
    last keys of chunk 1::

        ring_blocks("zigzag", True, 1, 1, 2, 8, left=2)
    """
    if left is None:
        block = ring_block(layout, is_causal, rank, src, shard_len)
        return [] if block is None else [block]
    c = shard_len // chunks_per_rank(layout)
    blocks = []
    for ia, a in enumerate(chunk_ids(layout, rank, world)):
        for ib, b in enumerate(chunk_ids(layout, src, world)):
            for rows, keys, mask, window in pair_spans(a, b, c, left):
                blocks.append(
                    Block(
                        slice(ia * c + rows[0], ia * c + rows[1]),
                        slice(ib * c + keys[0], ib * c + keys[1]),
                        mask,
                        window,
                    )
                )
    return blocks


def all_gathered_blocks(
    layout: str, is_causal: bool, rank: int, world: int, shard_len: int, left: int | None = None
) -> list[Block]:
    """``gathered_blocks`` with an optional causal sliding window ``left``: each of r's chunks
    against the keys from ``left`` before its first query to its last, bottom-right."""
    if left is None:
        return gathered_blocks(layout, is_causal, rank, world, shard_len)
    c = shard_len // chunks_per_rank(layout)
    return [
        Block(slice(i * c, (i + 1) * c), slice(max(0, a * c - left), (a + 1) * c), "bottom_right", left + 1)
        for i, a in enumerate(chunk_ids(layout, rank, world))
    ]


def pair_spans(a: int, b: int, c: int, left: int) -> list[tuple[tuple[int, int], tuple[int, int], str, int | None]]:
    """``(rows, keys, mask, window)`` of query chunk ``a`` against key chunk ``b`` (both ``c``
    long, positions relative to each chunk) under a causal window of ``left``; [] if none seen.

    Example, adjacent chunks of 4 and a window of 2: row 0 sees keys 2, 3; row 1 key 3::

        pair_spans(1, 0, 4, 2) == [((0, 2), (2, 4), "none", 1)]
    """
    if b > a:
        return []
    if a == b:
        return [((0, c), (0, c), "top_left", left + 1 if left + 1 < c else None)]
    e = (a - b) * c - left  # row i sees key j iff j >= i + e
    if e >= c:
        return []
    full = min(c, max(0, 1 - e))  # rows [0, full) see every key
    spans: list[tuple[tuple[int, int], tuple[int, int], str, int | None]] = []
    if full:
        spans.append(((0, full), (0, c), "none", None))
    stop = min(c, c - e)  # rows [full, stop) see keys [i + e, c): a band from the first row's first key
    if stop > full:
        spans.append(((full, stop), (full + e, c), "none", 1))
    return spans
