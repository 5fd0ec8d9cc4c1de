"""Assembling a node's ``AttentionProblem`` at build time, from its input handles' geometry,
its parsed options and whatever its outputs' setters said."""

from __future__ import annotations

import math
from typing import Any

import torch

from .node import BACKWARD_INPUTS, FORWARD_INPUTS, Node, like, output_spec
from .problem import AttentionProblem, Op, TensorSpec


def assemble_problem(node: Node, dtypes: dict[str, torch.dtype | None]) -> AttentionProblem | None:
    """The node's problem; None when an input's geometry is unknown (q, k or v missing, or
    an input coming from a node that failed). Validation judges the result."""
    specs: dict[str, TensorSpec] = {}
    for role, handle in node.inputs.items():
        if handle.spec is None:
            return None
        specs[role] = handle.spec
    q = specs.get("q")
    if q is None or "k" not in specs or "v" not in specs:
        return None
    d_qk = q.shape[-1] if q.shape else 1
    scale = node.scale if node.scale is not None else 1.0 / math.sqrt(max(d_qk, 1))
    common: dict[str, Any] = dict(
        io_dtype=dtypes["io_data_type"],
        intermediate_dtype=dtypes["intermediate_data_type"] or torch.float32,
        compute_dtype=dtypes["compute_data_type"] or torch.float32,
        attn_scale=scale,
        **node.options,
    )
    if node.op is Op.FORWARD:
        o_default = like(q, last_dim=specs["v"].shape[-1] if specs["v"].shape else 1)
        o = output_spec(node.outputs["o"], o_default)
        stats = None
        if "stats" in node.outputs:
            rows = q.shape[:3] if q.rank == 4 else None
            shape = (rows[0], rows[1], rows[2], 1) if rows else _thd_stats_shape(specs, node)
            stats = output_spec(node.outputs["stats"], TensorSpec.contiguous(shape, torch.float32, q.device))
        return AttentionProblem(
            op=Op.FORWARD, o=o, stats=stats, **_tensor_fields(specs, exclude=("o", "stats")), **common
        )
    outs: dict[str, Any] = {
        role: output_spec(node.outputs[role], like(specs[source]))
        for role, source in (("d_q", "q"), ("d_k", "k"), ("d_v", "v"))
    }
    if "d_bias" in node.outputs:
        bias = specs.get("bias")
        default = like(bias) if bias is not None else TensorSpec.contiguous((1, 1, 1, 1), torch.float32, q.device)
        outs["d_bias"] = output_spec(node.outputs["d_bias"], default)
    return AttentionProblem(op=Op.BACKWARD, **_tensor_fields(specs), **outs, **common)


def _tensor_fields(specs: dict[str, TensorSpec], exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    roles = set(FORWARD_INPUTS) | set(BACKWARD_INPUTS)
    return {role: spec for role, spec in specs.items() if role in roles and role not in exclude}


def _thd_stats_shape(specs: dict[str, TensorSpec], node: Node) -> tuple[int, ...]:
    """Stats of ragged q: [B, H, S_max, 1], one row per position of the padded sequences."""
    q = specs["q"]
    lengths = specs.get("seq_len_q")
    batch = lengths.shape[0] if lengths is not None and lengths.shape else 1
    heads = q.shape[1] if q.rank == 3 else 1
    s_max = node.options.get("max_seq_len_q") or (q.shape[0] if q.shape else 1)
    return (batch, heads, s_max, 1)
