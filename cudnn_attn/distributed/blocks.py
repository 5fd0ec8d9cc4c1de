"""Attention over one block of a sharded sequence, with its log-sum-exp, and the block's backward.

The functional form's prepared runs do the work (cuDNN on CUDA, the reference backend on the
CPU), one per block geometry. A flat key of shapes, strides, dtypes and flags then leads
straight to the prepared run, unchecked: the ring calls these a few times per step, with
views (half of the rows, half of the keys) whose geometry repeats.

``mask``: ``"none"``, ``"top_left"`` (causal, the diagonal at the block's first key) or
``"bottom_right"`` (causal, the diagonal at the block's last key: a query chunk against every
key up to and including its own chunk). Equivalent plain torch of ``forward``::

    s = (q @ k.transpose(-1, -2)) * scale            # GQA: k/v heads repeated
    o, lse = torch.softmax(s, -1) @ v, torch.logsumexp(s, -1, keepdim=True)
"""

from __future__ import annotations

import torch

from ..functional import problems
from ..runtime.interop import in_layout_of
from ..runtime.keyed import KeyedCache
from ..runtime.prepared import PreparedRun

MASKS = ("none", "top_left", "bottom_right")
MAX_ENTRIES = 512
_runs = KeyedCache(MAX_ENTRIES)  # flat key -> PreparedRun


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: str) -> list[torch.Tensor]:
    """``[o, stats]``: the block's output and its float32 ``[B, H, S_q, 1]`` natural-log LSE.

    Example::

        o, lse = forward(q[:, :, half:], k, v, scale, "none")
    """
    key = ("f", *_geometry(q), *_geometry(k), *_geometry(v), scale, mask)
    run = _runs.get(key)
    if run is None:
        run = _runs.put(key, problems.forward_run(q, k, v, None, scale, mask, 0.0, None, None, train=True))
    return run.run_ordered((q, k, v))


def backward(q, k, v, out, d_out, stats, scale: float, mask: str) -> list[torch.Tensor]:
    """``[dq, dk, dv]`` of one block, given the whole row's ``out`` and ``stats`` (so the
    block's probabilities and ``rowsum(d_out * out)`` are the global ones, not the block's)."""
    d_out = in_layout_of(d_out, out)
    inputs = (q, k, v, out, d_out, stats)
    key = ("b", *(g for t in inputs for g in _geometry(t)), scale, mask)
    run: PreparedRun | None = _runs.get(key)
    if run is None:
        run = _runs.put(key, problems.backward_run(*inputs, None, scale, mask, 0.0, None, None, bias_grad=False))
    return run.run_ordered(inputs)


def _geometry(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device
