"""Where a plan's cuDNN workspace comes from. No plan holds one for its life.

A workspace up to ``SHARED_LIMIT`` bytes comes from one buffer per device and stream, shared
by every plan run there (calls on one stream are ordered, so they never overlap) and grown to
the largest asked: the hot paths pay a dictionary lookup, and what stays allocated is bounded.
A larger one (a long packed backward's accumulators, gigabytes) is taken from torch's caching
allocator for the call and handed back right after it, stream-ordered, as torch's own cuDNN
attention does: once the call is done the caller's tensors can use those bytes.

Under CUDA-graph capture every workspace comes from the allocator, so the graph's private pool
owns it: a shared buffer baked into a graph could be written by eager calls while it replays.
"""

from __future__ import annotations

import torch

SHARED_LIMIT = 64 << 20  # bytes; decode, prefill and dense forwards stay under it
_shared: dict[tuple[int, int], torch.Tensor] = {}  # (device index, stream pointer) -> buffer


def workspace(size: int, device_index: int, stream_ptr: int, current_ptr: int) -> torch.Tensor:
    """A buffer of at least ``size`` bytes for one run on ``stream_ptr`` (torch's current stream
    on the device is ``current_ptr``). Valid until the next run on that stream is queued."""
    if size <= SHARED_LIMIT and not torch.cuda.is_current_stream_capturing():
        key = (device_index, stream_ptr)
        buffer = _shared.get(key)
        if buffer is None or buffer.numel() < size:
            _shared.pop(key, None)  # the smaller one goes back first: its bytes may serve this one
            buffer = _shared[key] = torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", device_index))
        return buffer
    buffer = torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", device_index))
    if stream_ptr != current_ptr:  # freed after the call, it must not be reused before that stream is past it
        buffer.record_stream(torch.cuda.ExternalStream(stream_ptr, device=buffer.device))
    return buffer


def held() -> int:
    """Bytes the shared buffers hold now."""
    return sum(buffer.numel() for buffer in _shared.values())


def release() -> None:
    """Give the shared buffers back to torch's allocator (the plan cache's ``clear`` does)."""
    _shared.clear()
