"""The process group a context-parallel call runs over: checked to exist before anything waits on it.

A collective on a group that was never initialised would not hang (torch raises), but its
message speaks of torch's default group; one on a group this process is not in would hang
or fail far from the call. Both are refused here, naming the argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..errors import ValidationError


@dataclass(frozen=True)
class Members:
    """A group resolved for one call: the group (the default group for None), this process's
    rank in it, its size and the global ranks of its ring neighbours."""

    group: Any
    rank: int
    world: int

    def global_rank(self, group_rank: int) -> int:
        """The global rank of ``group_rank`` (what ``isend``/``irecv`` take as a peer)."""
        if self.group is None or self.group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)


def members(group: Any, context: str) -> Members:
    """``group`` resolved, or a ``ValidationError`` naming ``group`` when torch.distributed is not
    initialised or this process is not a member.

    Example::

        m = members(None, "shard")  # the default group: m.rank, m.world
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValidationError(
            [
                "group: torch.distributed is not initialised; call torch.distributed.init_process_group(...) "
                "on every rank first (backend 'nccl' for CUDA tensors, 'gloo' for CPU tensors)"
            ],
            context=context,
        )
    try:
        rank = dist.get_rank(group)
        world = dist.get_world_size(group)
    except (RuntimeError, ValueError, TypeError) as error:
        raise ValidationError([f"group: {group!r} is not a usable process group ({error})"], context=context) from None
    if rank < 0:
        raise ValidationError(
            [f"group: this process (global rank {dist.get_rank()}) is not a member of the group"], context=context
        )
    return Members(group, rank, world)
