"""Comparing two tensors' strides where a kernel walks both with one set of them."""

from __future__ import annotations

import torch


def strides_alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have the same strides on every dimension either is longer than 1
    along. A dimension of size 1 in both is only ever indexed at 0, and torch gives its stride
    different values in tensors laid out alike (one K/V head: ``(P*D, P*D, D, 1)`` from
    ``torch.empty(N, 1, P, D)``, ``(P*D, D, D, 1)`` from a token-major ``[N, P, 1, D]`` tensor's
    transpose; torch calls both contiguous)."""
    strides = a.stride()
    if strides == b.stride():  # the common case, checked first: this runs on every eager decode step
        return True
    return a.dim() == b.dim() and all(
        sa == sb or na == nb == 1 for na, nb, sa, sb in zip(a.shape, b.shape, strides, b.stride())
    )


__all__ = ["strides_alike"]
