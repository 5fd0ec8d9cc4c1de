"""The chunks a sequence is cut into over the ranks of a group, and which a rank holds.

``"contiguous"``: W chunks, rank r holds chunk r. ``"zigzag"``: 2W chunks, rank r holds chunks
r and 2W-1-r, so under a causal mask every rank has the same work (an early chunk sees few
keys, its partner many). Dense shards cut the sequence so (``layout.py``), packed ones each
document (``documents.py``).
"""

from __future__ import annotations

from typing import Any

from ..errors import shown

LAYOUTS = ("zigzag", "contiguous")


def chunks_per_rank(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def chunk_ids(layout: str, rank: int, world: int) -> tuple[int, ...]:
    """The chunks of the full sequence ``rank`` holds, in the order its shard holds them."""
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


def layout_problems(layout: Any) -> list[str]:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        return [f"layout: {shown(layout)}; expected one of {', '.join(map(repr, LAYOUTS))}"]
    return []
