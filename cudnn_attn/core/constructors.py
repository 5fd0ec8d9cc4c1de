"""``AttentionProblem``s from their inputs' geometry: the defaults every entry point shares.

O is laid out like q with V's head dim; stats are float32 ``[B, H, S_q, 1]`` (for packed q,
``[B, H, S_max, 1]``: one row per position of the padded sequences); each gradient is laid
out like its input; dBias like the bias. ``Graph``'s assembly and the torch-facing doors build
problems through these, so a problem means the same wherever it was made.
"""

from __future__ import annotations

from typing import Any

import torch

from .mask import ScoreOptions
from .problem import AttentionProblem, KVCacheLayout, Op, TensorSpec, strides_like
from .score_mod import ScoreModifier


def like(spec: TensorSpec, last_dim: int | None = None, dtype: torch.dtype | None = None) -> TensorSpec:
    """A dense tensor with ``spec``'s layout (and optionally another last dim or dtype)."""
    shape = spec.shape if last_dim is None else tuple(spec.shape[:-1]) + (last_dim,)
    return TensorSpec(shape, strides_like(shape, spec.stride), dtype or spec.dtype, spec.device)


def default_o(q: TensorSpec, v: TensorSpec) -> TensorSpec:
    return like(q, last_dim=v.shape[-1] if v.shape else 1)


def default_stats(q: TensorSpec, seq_len_q: TensorSpec | None, max_seq_len_q: int | None) -> TensorSpec:
    if q.rank == 4:
        shape: tuple[int, ...] = (*q.shape[:3], 1)
    else:  # packed q: [B, H, S_max, 1]
        batch = seq_len_q.shape[0] if seq_len_q is not None and seq_len_q.shape else 1
        heads = q.shape[1] if q.rank == 3 else 1
        shape = (batch, heads, max_seq_len_q or (q.shape[0] if q.shape else 1), 1)
    # float64 keeps its log-sum-exp in float64: a float32 one would cap its gradients near 1e-7.
    return TensorSpec.contiguous(shape, torch.float64 if q.dtype == torch.float64 else torch.float32, q.device)


def forward_problem(
    q: TensorSpec,
    k: TensorSpec,
    v: TensorSpec,
    options: ScoreOptions,
    *,
    stats: bool = False,
    bias: TensorSpec | None = None,
    seq_len_q: TensorSpec | None = None,
    seq_len_kv: TensorSpec | None = None,
    max_seq_len_q: int | None = None,
    max_seq_len_kv: int | None = None,
    dropout_seed: TensorSpec | None = None,
    dropout_offset: TensorSpec | None = None,
    page_table_k: TensorSpec | None = None,
    page_table_v: TensorSpec | None = None,
    kv_cache_layout: KVCacheLayout | None = None,
    fp8: dict[str, TensorSpec] | None = None,
    o_dtype: torch.dtype | None = None,
    sink_token: TensorSpec | None = None,
    score_mod: ScoreModifier | None = None,
) -> AttentionProblem:
    """An sdpa forward; ``options.attn_scale`` is taken as given (resolve the default first).
    ``fp8``: the FP8 scale inputs and amax outputs by role (see ``roles.FP8_SCALES``)."""
    return AttentionProblem(
        op=Op.FORWARD,
        q=q,
        k=k,
        v=v,
        o=like(default_o(q, v), dtype=o_dtype) if o_dtype is not None else default_o(q, v),
        stats=default_stats(q, seq_len_q, max_seq_len_q) if stats else None,
        bias=bias,
        seq_len_q=seq_len_q,
        seq_len_kv=seq_len_kv,
        page_table_k=page_table_k,
        page_table_v=page_table_v,
        dropout_seed=dropout_seed,
        dropout_offset=dropout_offset,
        options=options,
        kv_cache_layout=kv_cache_layout,
        max_seq_len_q=max_seq_len_q,
        max_seq_len_kv=max_seq_len_kv,
        sink_token=sink_token,
        score_mod=score_mod,
        **_fp8_fields(fp8),
    )


def backward_problem(
    q: TensorSpec,
    k: TensorSpec,
    v: TensorSpec,
    o: TensorSpec,
    grad_o: TensorSpec,
    stats: TensorSpec,
    options: ScoreOptions,
    *,
    bias: TensorSpec | None = None,
    grad_bias: bool = False,
    seq_len_q: TensorSpec | None = None,
    seq_len_kv: TensorSpec | None = None,
    max_seq_len_q: int | None = None,
    max_seq_len_kv: int | None = None,
    dropout_seed: TensorSpec | None = None,
    dropout_offset: TensorSpec | None = None,
    deterministic: bool = False,
    fp8: dict[str, TensorSpec] | None = None,
    grad_dtype: torch.dtype | None = None,
    sink_token: TensorSpec | None = None,
    score_mod: ScoreModifier | None = None,
) -> AttentionProblem:
    """An sdpa backward: dQ, dK, dV (and dBias with ``grad_bias``) laid out like their inputs.
    ``fp8``: the FP8 scale inputs and amax outputs by role; ``grad_dtype``: the gradients' dtype
    where it is not their inputs' (FP8 gradients)."""
    grad_bias_spec = None
    if grad_bias:
        grad_bias_spec = (
            like(bias) if bias is not None else TensorSpec.contiguous((1, 1, 1, 1), torch.float32, q.device)
        )
    return AttentionProblem(
        op=Op.BACKWARD,
        q=q,
        k=k,
        v=v,
        o=o,
        grad_o=grad_o,
        stats=stats,
        grad_q=like(q, dtype=grad_dtype),
        grad_k=like(k, dtype=grad_dtype),
        grad_v=like(v, dtype=grad_dtype),
        bias=bias,
        grad_bias=grad_bias_spec,
        seq_len_q=seq_len_q,
        seq_len_kv=seq_len_kv,
        dropout_seed=dropout_seed,
        dropout_offset=dropout_offset,
        options=options,
        max_seq_len_q=max_seq_len_q,
        max_seq_len_kv=max_seq_len_kv,
        deterministic=deterministic,
        sink_token=sink_token,
        grad_sink=sink_token,
        score_mod=score_mod,
        **_fp8_fields(fp8),
    )


def _fp8_fields(fp8: dict[str, TensorSpec] | None) -> dict[str, Any]:
    return dict(fp8 or {})
