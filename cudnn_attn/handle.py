"""Handles, in the frontend's spelling. The library makes and reuses its own lazily (one per
device and thread), so passing one is optional everywhere."""

from __future__ import annotations

from typing import Any


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
