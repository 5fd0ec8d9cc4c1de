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
"""

from __future__ import annotations

from dataclasses import dataclass

ALL = slice(None)


@dataclass(frozen=True)
class Block:
    """Query rows and key positions of one attention call, and its mask (``blocks.MASKS``)."""

    rows: slice
    keys: slice
    mask: str


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
