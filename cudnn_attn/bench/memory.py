"""Device memory of one training step: what it needs beyond its tensors, and what it leaves behind.

``step_memory`` runs ``attend`` forward and backward once on fresh leaves and reads torch's
allocator: ``io_bytes`` are the step's own tensors (inputs, output, ``d_out`` and the gradients),
``peak_extra`` the most bytes allocated beyond them at any moment (saved statistics, workspaces,
temporaries), ``held_after`` what stays allocated once every one of those tensors is freed
(cached workspaces or buffers). Bytes are torch's allocated bytes, not its reserved (cached)
ones: those it hands to the next tensors.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import torch


def step_memory(
    attend: Callable[..., torch.Tensor], make: Callable[[], Sequence[torch.Tensor]], device: torch.device
) -> dict[str, int]:
    """Memory of one forward + backward of ``attend(q, k, v)``; ``make()`` returns ``(q, k, v, d_out)``."""
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    *inputs, d_out = make()
    leaves = [t.detach().requires_grad_() for t in inputs]
    del inputs
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = attend(*leaves)
    out.backward(d_out)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    produced = [out, *(leaf.grad for leaf in leaves if leaf.grad is not None)]
    produced_bytes = sum(_nbytes(t) for t in produced)
    io_bytes = base - start + produced_bytes
    del out, produced, leaves, d_out
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device) - start
    return {"io_bytes": io_bytes, "peak_extra": peak - base - produced_bytes, "held_after": held}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def document_lengths(total: int, unit: int, median: int = 3712, sigma: float = 1.0, seed: int = 0) -> list[int]:
    """Document lengths summing to ``total``: lognormal (``median``, ``sigma``), seeded, each a
    multiple of ``unit`` (at least one); the last one cut to fit. The training packs the
    memory and context-parallel benchmarks share: most documents a few thousand tokens, a few
    tens of thousands.

    Example::

        document_lengths(131072, 64 * 4)   # about 20 documents, the longest over 30k tokens
    """
    rng = random.Random(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        n = max(unit, round(rng.lognormvariate(math.log(median), sigma) / unit) * unit)
        lengths.append(min(n, total - sum(lengths)))
    return lengths
