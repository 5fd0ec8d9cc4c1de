"""Whether two tensors share elements: what an output written in place may not do with a tensor
a graph still reads, or with another output."""

from __future__ import annotations

import torch


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t`` may address, ``[first, last + 1)`` (empty for an empty tensor)."""
    first = t.data_ptr()
    if t.numel() == 0:
        return first, first
    return first, first + (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (on one device) have an element at the same address.

    Byte ranges apart: no. Views of one dtype and one set of strides (the q, k and v of a packed
    QKV or dQKV, GQA's with their other head counts): exact where each stride spans the smaller
    ones (a layout without self-overlap, as outputs must have). Anything else whose byte ranges
    meet: yes, the conservative answer. Checked against every address on random layouts."""
    (a0, a1), (b0, b1) = byte_span(a), byte_span(b)
    if a1 <= b0 or b1 <= a0:
        return False
    if a.stride() != b.stride() or a.dtype != b.dtype:
        return True
    size = a.element_size()
    delta = b.data_ptr() - a.data_ptr()
    if delta % size:
        return True  # elements a fraction of one apart overlap bytewise
    # Element i of a and j of b coincide iff sum((i - j) * stride) == delta, with i - j in
    # [-(n_b - 1), n_a - 1] per dim; largest stride first, each digit floor or floor + 1.
    dims = sorted(
        ((s, na, nb) for s, na, nb in zip(a.stride(), a.shape, b.shape) if s and max(na, nb) > 1), reverse=True
    )
    reach_a = reach_b = 0
    for s, na, nb in reversed(dims):  # smallest stride first: the smaller dims must not reach s
        if reach_a >= s or reach_b >= s:
            return True  # not nested: the conservative answer
        reach_a, reach_b = reach_a + (na - 1) * s, reach_b + (nb - 1) * s
    return _reaches(delta // size, dims, 0)


def _reaches(rest: int, dims: list[tuple[int, int, int]], k: int) -> bool:
    if k == len(dims):
        return rest == 0
    s, na, nb = dims[k]
    low = rest // s
    return any(-(nb - 1) <= i <= na - 1 and _reaches(rest - i * s, dims, k + 1) for i in (low, low + 1))


__all__ = ["byte_span", "share_elements"]
