"""An attention sink folded into a result computed without it, from its log-sum-exp.

A sink is one more term of each softmax denominator that weighs no value (gpt-oss's learned
per-head logit), so a sink-less result ``O`` with log-sum-exp ``L`` becomes, exactly::

    L' = logaddexp(L, sink);   O' = O * exp(L - L')

A row that sees no key (``L = -inf``, ``O = 0``) keeps ``O = 0`` and gets ``L' = sink``, as the
reference backend gives. Where a kernel cannot take the sink itself (cuDNN's decode kernels,
paged decode after a split-KV merge), this runs after it: a few elementwise ops on the device,
no host sync, safe inside a CUDA graph.
"""

from __future__ import annotations

import torch


def add_sink(o: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> None:
    """Fold ``sink`` into ``o`` and ``lse``, in place. ``o``: ``[..., H, S, D]`` (any strides,
    any float dtype); ``lse``: float32 of ``o``'s shape with a last dim of 1; ``sink``: float32,
    broadcasting to ``lse`` (``[1, H, 1, 1]``)."""
    merged = torch.logaddexp(lse, sink)
    weight = torch.exp(lse - merged)  # exp(-inf) = 0 where no key is seen: O stays 0
    o.copy_(o.float() * weight)
    lse.copy_(merged)
