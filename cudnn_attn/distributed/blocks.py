"""Attention over one block of a sharded sequence, with its log-sum-exp, and the block's backward.

Prepared runs (``runtime.prepare``) do the work (cuDNN on CUDA, the reference backend on the
CPU), one per block geometry. A flat key of shapes, strides, dtypes and flags then leads
straight to the prepared run, unchecked: the ring calls these a few times per step, with
views (half of the rows, half of the keys) whose geometry repeats.

``mask``: ``"none"``, ``"top_left"`` (causal, the diagonal at the block's first key) or
``"bottom_right"`` (causal, the diagonal at the block's last key: a query chunk against every
key up to and including its own chunk); ``window``: also a left bound W, key j kept iff
j > d(i) - W on the mask's diagonal d(i) (the top-left one for ``"none"``). Equivalent plain
torch of ``forward``::

    s = (q @ k.transpose(-1, -2)) * scale            # GQA: k/v heads repeated; masked scores -inf
    o, lse = torch.softmax(s, -1) @ v, torch.logsumexp(s, -1, keepdim=True)

``packed_forward``/``packed_backward`` take packed (THD) blocks instead, ``[T, H, D]`` with
per-sequence lengths, every mask per sequence (the varlen form, ``cudnn_attn.varlen_sdpa``).
"""

from __future__ import annotations

import torch

from ..core.constructors import backward_problem, forward_problem
from ..core.mask import Causal, ScoreOptions
from ..core.problem import TensorSpec, token_bucket
from ..runtime.interop import in_layout_of
from ..runtime.keyed import KeyedCache
from ..runtime.prepared import PreparedRun, prepare
from .checks import CONTEXT

MASKS = ("none", "top_left", "bottom_right")
MAX_ENTRIES = 512
_runs = KeyedCache(MAX_ENTRIES)  # flat key -> PreparedRun


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: str, window: int | None = None
) -> list[torch.Tensor]:
    """``[o, stats]``: the block's output and its float32 ``[B, H, S_q, 1]`` natural-log LSE.

    Example::

        o, lse = forward(q[:, :, half:], k, v, scale, "none")
    """
    key = ("f", *_geometry(q), *_geometry(k), *_geometry(v), scale, mask, window)
    run = _runs.get(key)
    if run is None:
        specs = (TensorSpec.of(q), TensorSpec.of(k), TensorSpec.of(v))
        run = _runs.put(
            key, prepare(forward_problem(*specs, _options(scale, mask, window), stats=True), context=CONTEXT)
        )
    return run.run_ordered((q, k, v))


def backward(q, k, v, out, d_out, stats, scale: float, mask: str, window: int | None = None) -> list[torch.Tensor]:
    """``[dq, dk, dv]`` of one block, given the whole row's ``out`` and ``stats`` (so the
    block's probabilities and ``rowsum(d_out * out)`` are the global ones, not the block's)."""
    d_out = in_layout_of(d_out, out)
    inputs = (q, k, v, out, d_out, stats)
    key = ("b", *(g for t in inputs for g in _geometry(t)), scale, mask, window)
    run: PreparedRun | None = _runs.get(key)
    if run is None:
        q_, k_, v_, o_, d_o_, stats_ = (TensorSpec.of(t) for t in inputs)
        problem = backward_problem(q_, k_, v_, o_, d_o_, stats_, _options(scale, mask, window))
        run = _runs.put(key, prepare(problem, context=CONTEXT))
    return run.run_ordered(inputs)


def packed_forward(
    q,
    k,
    v,
    lengths_q,
    lengths_k,
    max_q: int,
    max_k: int,
    scale: float,
    mask: str,
    window: int | None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [T_q, H, D_v], stats float32 [B, H, max_q, 1])`` of packed sequences: ``q``
    ``[T_q, H, D]``, ``k``/``v`` ``[T_k, H_kv, D]``, contiguous, ``lengths_*`` int32 ``[B, 1, 1, 1]``
    summing to the token counts; ``max_*``: bounds on the lengths (plan buckets); ``out``: where
    to write ``o`` (contiguous), None: a new tensor."""
    inputs = {"q": q, "k": k, "v": v, "seq_len_q": lengths_q, "seq_len_kv": lengths_k}
    run = _packed_run("pf", inputs, max_q, max_k, scale, mask, window)
    o = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device) if out is None else out
    stats = torch.empty(lengths_q.shape[0], q.shape[1], max_q, 1, dtype=torch.float32, device=q.device)
    run.run(inputs, {"o": o, "stats": stats})
    return o, stats


def packed_backward(
    q,
    k,
    v,
    out,
    d_out,
    stats,
    lengths_q,
    lengths_k,
    max_q: int,
    max_k: int,
    scale: float,
    mask: str,
    window: int | None,
    d_q: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of packed sequences, laid out as q, k, v; ``out``, ``d_out`` and
    ``stats`` are the whole rows' (as ``backward``), ``out``/``d_out`` contiguous like q; ``d_q``:
    where to write dq (contiguous, q's dtype), None: a new tensor."""
    inputs = {
        "q": q,
        "k": k,
        "v": v,
        "o": out,
        "grad_o": d_out,
        "stats": stats,
        "seq_len_q": lengths_q,
        "seq_len_kv": lengths_k,
    }
    run = _packed_run("pb", inputs, max_q, max_k, scale, mask, window)
    grad_q = torch.empty_like(q) if d_q is None else d_q
    grads = {"grad_q": grad_q, "grad_k": torch.empty_like(k), "grad_v": torch.empty_like(v)}
    written = run.run(inputs, grads)
    return written["grad_q"], written["grad_k"], written["grad_v"]


def _packed_run(
    op: str, inputs: dict[str, torch.Tensor], max_q: int, max_k: int, scale: float, mask: str, window: int | None
) -> PreparedRun:
    """The run of a packed block's plan: keyed without the token counts, which the plan reads
    from its inputs (``AttentionProblem.for_plan``), so one run serves every packing; a
    backward's by their buckets, which size its workspace."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    tokens = (token_bucket(q.shape[0]), token_bucket(k.shape[0])) if op == "pb" else None
    key = (
        op,
        q.shape[1:],
        k.shape[1:],
        v.shape[1:],
        q.stride(),
        k.stride(),
        v.stride(),
        q.dtype,
        q.device,
        inputs["seq_len_q"].shape,
        max_q,
        max_k,
        scale,
        mask,
        window,
        tokens,
    )
    run = _runs.get(key)
    if run is None:
        specs = {role: TensorSpec.of(t) for role, t in inputs.items()}
        options = _options(scale, mask, window, padding=True)
        len_q, len_k = specs["seq_len_q"], specs["seq_len_kv"]
        if op == "pf":
            problem = forward_problem(
                specs["q"],
                specs["k"],
                specs["v"],
                options,
                stats=True,
                seq_len_q=len_q,
                seq_len_kv=len_k,
                max_seq_len_q=max_q,
                max_seq_len_kv=max_k,
            )
        else:
            problem = backward_problem(
                specs["q"],
                specs["k"],
                specs["v"],
                specs["o"],
                specs["grad_o"],
                specs["stats"],
                options,
                seq_len_q=len_q,
                seq_len_kv=len_k,
                max_seq_len_q=max_q,
                max_seq_len_kv=max_k,
            )
        values = {"seq_len_q": inputs["seq_len_q"], "seq_len_kv": inputs["seq_len_kv"]}
        run = _runs.put(key, prepare(problem, values=values, context=CONTEXT))
    return run


def _options(scale: float, mask: str, window: int | None, padding: bool = False) -> ScoreOptions:
    return ScoreOptions(attn_scale=scale, causal=Causal(mask), sliding_window=window, padding=padding)


def _geometry(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device
