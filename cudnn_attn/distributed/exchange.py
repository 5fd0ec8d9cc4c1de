"""The ring's communication: pass a buffer to the next rank, receive the previous rank's.

``Ring.shift`` posts the send and the receive and returns at once; ``Pending.wait`` hands
over the received buffer. Work done between the two overlaps the transfer. With NCCL the
transfer runs on the process group's own CUDA stream, ordered after the work already queued
on the current stream, and ``wait`` makes the current stream (not the host) wait for it, so
attention kernels queued in between run beside it. With gloo, background threads move the
bytes while the host computes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .process_group import Members


class Pending:
    """A posted shift: ``wait()`` returns the received buffer."""

    def __init__(self, requests: list, received: torch.Tensor):
        self._requests, self._received = requests, received

    def wait(self) -> torch.Tensor:
        for request in self._requests:
            request.wait()
        self._requests = []
        return self._received


class Ring:
    """Neighbours on a ring over the group: send to rank r+1, receive from rank r-1.

    Example::

        ring = Ring(members(None, "example"))
        pending = ring.shift(kv, tag=0)     # kv goes to r+1; r-1's arrives
        ...                                 # compute on kv meanwhile
        kv = pending.wait()
    """

    def __init__(self, m: Members):
        self.members = m
        self.rank, self.world, self.group = m.rank, m.world, m.group
        self._next = m.global_rank((m.rank + 1) % m.world)
        self._previous = m.global_rank((m.rank - 1) % m.world)

    def shift(self, buffer: torch.Tensor, tag: int, into: torch.Tensor | None = None) -> Pending:
        """Post sending ``buffer`` to the next rank and receiving one like it from the previous,
        into ``into`` (allocated before the call's first transfer) or a new buffer.
        ``buffer`` must stay unchanged until ``wait``; ``tag`` keeps two shifts in flight apart
        (gloo matches by tag; NCCL matches by order, the same on every rank)."""
        received = torch.empty_like(buffer) if into is None else into
        requests = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, buffer, self._next, self.group, tag),
                dist.P2POp(dist.irecv, received, self._previous, self.group, tag),
            ]
        )
        return Pending(list(requests or []), received)
