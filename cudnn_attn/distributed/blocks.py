"""Attention over one block of a sharded sequence, with its log-sum-exp, and the block's backward.

The library's own graphs do the work (cuDNN on CUDA, the reference backend on the CPU), built
once per block geometry in the shared keyed-graph cache. A flat key of shapes, strides,
dtypes and flags then leads straight to the built run, unchecked: the ring calls these a few
times per step, with views (half of the rows, half of the keys) whose geometry repeats.

``mask``: ``"none"``, ``"top_left"`` (causal, the diagonal at the block's first key) or
``"bottom_right"`` (causal, the diagonal at the block's last key: a query chunk against every
key up to and including its own chunk). Equivalent plain torch of ``forward``::

    s = (q @ k.transpose(-1, -2)) * scale            # GQA: k/v heads repeated
    o, lse = torch.softmax(s, -1) @ v, torch.logsumexp(s, -1, keepdim=True)
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..core.problem import TensorSpec
from ..functional import graphs as sdpa_graphs
from ..runtime import lifecycle
from ..runtime.runner import Runner

MASKS = ("none", "top_left", "bottom_right")
MAX_ENTRIES = 512
_runs: dict[tuple, Runner] = {}
_lock = threading.Lock()


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: str) -> list[torch.Tensor]:
    """``[o, stats]``: the block's output and its float32 ``[B, H, S_q, 1]`` natural-log LSE.

    Example::

        o, lse = forward(q[:, :, half:], k, v, scale, "none")
    """
    key = ("f", *_geometry(q), *_geometry(k), *_geometry(v), scale, mask)
    run = _runs.get(key)
    if run is None:
        run = _built(key, "forward", (q, k, v), scale, mask)
    return run.run_trusted((q, k, v))


def backward(q, k, v, out, d_out, stats, scale: float, mask: str) -> list[torch.Tensor]:
    """``[dq, dk, dv]`` of one block, given the whole row's ``out`` and ``stats`` (so the
    block's probabilities and ``rowsum(d_out * out)`` are the global ones, not the block's)."""
    d_out = sdpa_graphs.like(d_out, out)
    inputs = (q, k, v, out, d_out, stats)
    key = ("b", *(g for t in inputs for g in _geometry(t)), scale, mask)
    run = _runs.get(key)
    if run is None:
        run = _built(key, "backward", inputs, scale, mask)
    return run.run_trusted(inputs)


def _geometry(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device


def _built(key: tuple, op: str, inputs: tuple, scale: float, mask: str) -> Runner:
    options: dict[str, Any] = dict(
        attn_scale=scale, use_causal_mask=mask == "top_left", use_causal_mask_bottom_right=mask == "bottom_right"
    )
    graph_key = ("context_parallel", op, *map(TensorSpec.of, inputs), scale, mask)
    if op == "forward":
        graph = sdpa_graphs.graphs.get_or_build(graph_key, lambda g: g.sdpa(*inputs, generate_stats=True, **options))
    else:
        graph = sdpa_graphs.graphs.get_or_build(graph_key, lambda g: g.sdpa_backward(*inputs, **options))
    assert graph._runner is not None  # built just now
    with _lock:
        if len(_runs) >= MAX_ENTRIES:
            _runs.pop(next(iter(_runs)))  # the oldest geometry
        _runs[key] = graph._runner
    return graph._runner


@lifecycle.at_exit  # the runs hold native plans: release them while the frontend is whole
def clear() -> None:
    with _lock:
        _runs.clear()
