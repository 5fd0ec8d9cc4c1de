"""Whether two tensors share elements: what an output written in place may not do with a tensor
a graph still reads, or with another output."""

from __future__ import annotations

import torch


def share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have an element at the same address. Exact for the views that
    interleave in one buffer without sharing (a packed QKV's or dQKV's q, k and v: one geometry,
    offsets apart); for views of different geometries whose address ranges meet, yes (the cost of
    an exact answer there is not worth a case no caller has)."""
    if a.numel() == 0 or b.numel() == 0 or not torch._C._overlaps(a, b):  # address ranges apart
        return False
    if a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype:
        return True
    delta = abs(a.data_ptr() - b.data_ptr())
    size = a.element_size()
    if delta % size:
        return False  # offsets a fraction of an element apart: no element starts at the same address
    delta //= size
    # The offset as one element's index, largest stride first: found exactly where each stride
    # spans every smaller one (a layout without self-overlap, as outputs must have).
    for stride, extent in sorted(((s, n) for s, n in zip(a.stride(), a.shape) if n > 1), reverse=True):
        step = min(delta // stride, extent - 1)
        delta -= step * stride
    return delta == 0


__all__ = ["share_elements"]
