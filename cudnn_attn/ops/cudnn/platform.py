"""Where cuDNN runs: the GPU and library versions, one cuDNN handle per device and thread,
and the raw stream pointers plans are launched on."""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

from . import capabilities
from .frontend_internals import new_handle


@functools.cache
def platform(device_index: int) -> capabilities.Platform:
    """The GPU and versions of ``cuda:device_index`` (read once per device)."""
    import cudnn

    props = torch.cuda.get_device_properties(device_index)
    return capabilities.Platform(
        gpu=props.name, arch=(props.major, props.minor), cudnn=int(cudnn.backend_version()), frontend=cudnn.__version__
    )


def device_index(device: str) -> int:
    d = torch.device(device)
    return d.index if d.index is not None else torch.cuda.current_device()


class _Handles(threading.local):
    """One cuDNN handle per device and thread, made on first use."""

    def __init__(self) -> None:
        self.by_device: dict[int, Any] = {}


_handles = _Handles()


def cudnn_handle(device_index: int, user_handle: Any = None) -> Any:
    """The handle to run on: the caller's (ours or the frontend's), else this thread's own."""
    import cudnn

    if user_handle is not None:
        if isinstance(user_handle, cudnn.Handle):
            return user_handle
        native = getattr(user_handle, "native", None)
        if native is None:
            with torch.cuda.device(device_index):
                native = user_handle.native = new_handle(device_index)
        return native
    handle = _handles.by_device.get(device_index)
    if handle is None:
        with torch.cuda.device(device_index):
            handle = _handles.by_device[device_index] = new_handle(device_index)
    return handle


def current_stream(device_index: int) -> int:
    """The raw pointer of torch's current stream on the device (torch's cheap, private way to
    ask; ``torch.cuda.current_stream`` builds a Python object per call)."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def stream_pointer(stream: Any, device_index: int) -> int:
    if stream is None:
        return torch.cuda.current_stream(device_index).cuda_stream
    return int(getattr(stream, "cuda_stream", stream))
