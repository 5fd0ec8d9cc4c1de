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
    """One int scalar copied from the device behind an event: ``start`` it, ``read`` it later."""

    def __init__(self) -> None:
        self._pinned: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        self._pending = False

    def start(self, value: torch.Tensor) -> None:
        """Copy the 0-d CUDA tensor ``value`` to the host behind an event on the current stream;
        nothing (``read`` answers None) while a CUDA graph is being captured."""
        self._pending = False
        if torch.cuda.is_current_stream_capturing():
            return
        if self._pinned is None or self._pinned.dtype != value.dtype:
            self._pinned = torch.empty((), dtype=value.dtype, pin_memory=True)
            self._event = torch.cuda.Event()
        assert self._event is not None
        self._pinned.copy_(value, non_blocking=True)
        self._event.record()
        self._pending = True

    def read(self) -> int | None:
        """The value, where its copy has landed; None while it has not (or none was started)."""
        if not self._pending or self._event is None or not self._event.query():
            return None
        assert self._pinned is not None
        return int(self._pinned)
