"""A device value read on the host once the GPU has produced it, never waiting for it.

An eager decode layer on cuDNN fills the output rows of empty sequences after each call (cuDNN
leaves them unwritten), unless the host knows that no sequence is empty. A step planned from
lengths on the GPU cannot know it at ``plan`` without a sync; but ``plan`` can start a copy of the
shortest length into pinned host memory, and the step's first layer reads it if the copy has
landed by then (an event's query, no wait). A host that runs ahead of the GPU finds it not yet
there and keeps the fill; an idle GPU, where the host bounds a step, has it done in microseconds.
"""

from __future__ import annotations

import torch


class LateValue:
    """One scalar of a CUDA tensor, copied to the host behind an event on its device's current
    stream. Each value has its own pinned memory and event (torch's pinned allocator recycles
    them), so values started on other streams or devices never overwrite one another."""

    def __init__(self, value: torch.Tensor):
        """Start the copy of the 0-d CUDA tensor ``value`` (its device's current stream)."""
        with torch.cuda.device(value.device):
            stream = torch.cuda.current_stream()
            self._pinned = torch.empty((), dtype=value.dtype, pin_memory=True)
            self._pinned.copy_(value, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(stream)

    def read(self) -> int | None:
        """The value, where its copy has landed; None while it has not."""
        return int(self._pinned) if self._event.query() else None


def capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a CUDA graph."""
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()
