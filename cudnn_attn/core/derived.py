"""Tensors derived from run-time integer inputs (clamped lengths and page tables, THD sequence
offsets), computed once per content version of the input instead of once per call.

Decode passes the same lengths and page tables to every layer, each a graph call; deriving
them again per layer costs kernel launches and bandwidth. A derived tensor is reused while
the caller passes the same tensor object with the same ``_version`` (torch's in-place write
counter, shared by every view of the storage), ``data_ptr()`` and shape, on the same stream.

What torch cannot see, the cache cannot see: writes through ``.data``, NumPy or DLPack views,
raw (Triton, CUDA) kernels, and CUDA graph replays do not bump ``_version``. A pipeline that
writes lengths or page tables that way turns the cache off: ``set_enabled(False)`` or
``CUDNN_ATTN_DERIVED_CACHE=0``. Inference tensors have no version counter: always derived
afresh. While the current stream is capturing a CUDA graph nothing is reused or stored: the
graph's replays must re-derive from whatever the inputs then hold.

Derived tensors are shared between calls and plans: read them, never write them.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

ENV = "CUDNN_ATTN_DERIVED_CACHE"
MAX_ENTRIES = 64  # a few tensors per distinct input; old entries are cheap to derive again

# (id(source), compute, params, stream) -> (weakref to source, _version, data_ptr, shape, derived)
_entries: dict[tuple, tuple[weakref.ref, int, int, torch.Size, torch.Tensor]] = {}
_lock = threading.Lock()  # for stores and evictions; a lookup is one atomic dict.get


def _enabled_from_env() -> bool:
    return os.environ.get(ENV, "").strip().lower() not in ("0", "false", "no", "off")


_enabled = _enabled_from_env()


def set_enabled(enabled: bool | None) -> None:
    """Turn reuse on or off (``None``: back to ``CUDNN_ATTN_DERIVED_CACHE``, on unless ``0``).
    Turning it off also drops what is held."""
    global _enabled
    _enabled = _enabled_from_env() if enabled is None else bool(enabled)
    if not _enabled:
        clear()


def enabled() -> bool:
    return _enabled


def clear() -> None:
    """Drop every derived tensor held (they are re-derived on next use)."""
    with _lock:
        _entries.clear()


def size() -> int:
    """How many derived tensors are held."""
    return len(_entries)


def derived(source: torch.Tensor, compute: Callable[..., torch.Tensor], *params: Any) -> torch.Tensor:
    """``compute(source, *params)``, reused from an earlier call on the same content of
    ``source``. ``compute`` must be a module-level function (it is part of the key), pure, and
    return a new tensor, not a view of ``source`` (that would keep ``source`` alive); ``params``
    must be hashable."""
    if not _enabled or torch.compiler.is_compiling():
        return compute(source, *params)
    try:
        version = source._version
    except RuntimeError:  # an inference tensor: no version counter, so its writes are invisible
        return compute(source, *params)
    device = _cuda_index(source)
    if device >= 0 and _capturing(device):
        return compute(source, *params)  # what a replay reads must be derived in the graph
    key = (id(source), compute, params, None if device < 0 else _current_stream(device))
    entry = _entries.get(key)
    if (
        entry is not None
        and entry[0]() is source  # not a new tensor that took a dead one's id
        and entry[1] == version
        and entry[2] == source.data_ptr()
        and entry[3] == source.shape
    ):
        return entry[4]
    if torch.is_inference_mode_enabled():
        # A result made here would be an inference tensor: no version counter, so nothing
        # derived from it in turn (THD offsets from clamped lengths) could be reused.
        with torch.inference_mode(False):
            result = compute(source, *params)
    else:
        result = compute(source, *params)
    _store(key, (weakref.ref(source), version, source.data_ptr(), source.shape, result))
    return result


def _store(key: tuple, entry: tuple) -> None:
    """Newest last; the oldest dropped beyond ``MAX_ENTRIES``. Holds ``source`` weakly only."""
    with _lock:
        _entries.pop(key, None)  # a stale version of the same source: replaced, moved to newest
        _entries[key] = entry
        while len(_entries) > MAX_ENTRIES:
            del _entries[next(iter(_entries))]


# ---- the device, where it is CUDA (separate functions so CPU tests can stand in for them) ----


def _cuda_index(tensor: torch.Tensor) -> int:
    """The CUDA device index of ``tensor``; -1 for any other device (no stream, no capture)."""
    return tensor.get_device() if tensor.is_cuda else -1


def _current_stream(device: int) -> int:
    """The raw pointer of the device's current stream: where the derived work runs and is
    ordered; torch's cheap private form (``torch.cuda.current_stream`` builds an object)."""
    return torch._C._cuda_getCurrentRawStream(device)


def _capturing(device: int) -> bool:
    """Whether the device's current stream is capturing a CUDA graph."""
    if torch.cuda.current_device() == device:
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()
