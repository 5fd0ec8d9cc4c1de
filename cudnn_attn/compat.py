"""``cudnn_attn.compat``: frontend spellings with no behaviour of their own, accepted so drop-in code
runs unchanged.

``heur_mode``: the library always asks cuDNN for mode A with FALLBACK behind it; the modes a caller
passes to ``create_execution_plans`` are accepted and need not be changed. Handles: the library makes
and reuses its own lazily (one per device and thread), so passing one is optional everywhere.
"""

from __future__ import annotations

import enum
from typing import Any


class heur_mode(enum.Enum):  # noqa: N801 - the frontend's spelling
    A = "A"
    B = "B"
    FALLBACK = "FALLBACK"


class Handle:
    """A library handle: binds work to a device; the cuDNN backend attaches its cuDNN handle."""

    def __init__(self, device: Any = None):
        self.device = device
        self.native: Any = None  # the cuDNN handle, made on first use on a GPU

    def __repr__(self) -> str:
        return f"<cudnn_attn.Handle device={self.device}>"


def create_handle(device: Any = None) -> Handle:
    """A handle for ``device`` (the current one by default)."""
    return Handle(device)


def destroy_handle(handle: Handle) -> None:
    """Release ``handle``'s native resources (nothing to do where no GPU is involved)."""
    handle.native = None
