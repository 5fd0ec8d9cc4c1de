"""The ranks' control messages: small rows of integers (and, after a failure, its text) that every
rank of a group exchanges to agree on a call's arguments and on how each call ended.

They travel on the CPU. For an NCCL group they go through a gloo group over the same ranks,
made once per group by its members alone: reading an answer then never waits for the GPU's
queued work, so a control exchange costs host microseconds, not a pipeline drain.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .process_group import Members

_channels: dict[Any, Any] = {}  # a group (the default one as torch's WORLD object) -> its gloo twin


def gather_rows(m: Members, row: list[int]) -> list[list[int]]:
    """Every rank's ``row`` (the same length on every rank), in rank order."""
    if m.world == 1:
        return [list(row)]
    mine = torch.tensor(row, dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(m.world)]
    dist.all_gather(rows, mine, group=_channel(m))
    return [r.tolist() for r in rows]


def gather_objects(m: Members, item: Any) -> list[Any]:
    """Every rank's ``item`` (picklable), in rank order: for the rare message that is text."""
    if m.world == 1:
        return [item]
    items: list[Any] = [None] * m.world
    dist.all_gather_object(items, item, group=_channel(m))
    return items


def _channel(m: Members) -> Any:
    if "gloo" in str(dist.get_backend(m.group)):
        return m.group
    key = m.group if m.group is not None else dist.group.WORLD  # a new WORLD after a re-initialisation
    channel = _channels.get(key)
    if channel is None:
        ranks = [m.global_rank(r) for r in range(m.world)]
        channel = _channels[key] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return channel
