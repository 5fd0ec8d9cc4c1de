"""Assembling a node's ``AttentionProblem`` at build time, from its input handles' geometry,
its parsed keywords and whatever its outputs' setters said."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..core.constructors import default_o, default_stats, like
from ..core.mask import default_scale
from ..core.problem import (
    AttentionProblem,
    KVCacheLayout,
    Op,
    TensorSpec,
    contiguous_strides,
    device_name,
    strides_like,
)
from ..core.roles import (
    BACKWARD_INPUTS,
    FP8_AMAXES,
    FP8_BACKWARD_AMAXES,
    FP8_BACKWARD_INPUTS,
    FP8_BACKWARD_SCALES,
    FP8_INPUTS,
    FP8_SCALES,
    SCORE_INPUTS,
    SDPA_INPUTS,
)
from .node import Node

# What each op cannot run without (anything else missing is optional or reported by validation).
REQUIRED = {
    (Op.FORWARD, False): ("q", "k", "v"),
    (Op.BACKWARD, False): ("q", "k", "v", "o", "grad_o", "stats"),
    (Op.FORWARD, True): ("q", "k", "v", *FP8_SCALES),
    (Op.BACKWARD, True): ("q", "k", "v", "o", "grad_o", "stats", *FP8_BACKWARD_SCALES),
}
# Each op's inputs as problem fields.
INPUTS = {
    (Op.FORWARD, False): SDPA_INPUTS,
    (Op.BACKWARD, False): BACKWARD_INPUTS,
    (Op.FORWARD, True): FP8_INPUTS,
    (Op.BACKWARD, True): FP8_BACKWARD_INPUTS,
}
_SCALAR = (1, 1, 1, 1)  # FP8 amaxes (and scales): float32 [1, 1, 1, 1]


def missing_inputs(node: Node) -> list[str]:
    """One line per required input the node was not given."""
    method = node.op.value.replace("sdpa", "sdpa_fp8", 1) if node.fp8 else node.op.value
    return [
        f"{node.argument(role)}: missing; {method} needs it (a tensor, not None)"
        for role in REQUIRED[node.op, node.fp8]
        if role not in node.inputs
    ]


def _amaxes(node: Node, roles: tuple[str, ...], device: str) -> dict[str, Any]:
    """The FP8 amax outputs asked for: one set to ``set_output(False)`` is not computed at all
    (the frontend notes that declaring Amax_S restricts cuDNN to fewer engines)."""
    default = TensorSpec.contiguous(_SCALAR, torch.float32, device)
    wanted = [role for role in roles if role in node.outputs and node.outputs[role].is_output]
    return {role: output_spec(node.outputs[role], default) for role in wanted}


def assemble_problem(
    node: Node, dtypes: dict[str, torch.dtype | None], *, frontend_rules: bool = False
) -> AttentionProblem | None:
    """The node's problem; None when an input's geometry is unknown (a required input missing,
    or an input coming from a node that failed). Validation judges the result. Under the
    ``frontend_rules`` an omitted attn_scale is 1, as the frontend's node multiplies by a scale
    only where one is given; else torch's ``1/sqrt(d)``."""
    specs: dict[str, TensorSpec] = {}
    for role, handle in node.inputs.items():
        if handle.spec is None:
            return None
        specs[role] = handle.spec
    if missing_inputs(node):
        return None
    q = specs["q"]
    for handle in node.outputs.values():
        if handle.receiver is not None and device_name(handle.receiver.device) != q.device:
            node.errors.append(
                f"{node.argument(handle.port)}: on {handle.receiver.device}; it receives an output on q's {q.device}"
            )
    parsed = node.parsed
    assert parsed is not None, "assembled after the node's keywords are parsed"
    options = parsed.options
    if not parsed.scale_given:
        scale = 1.0 if frontend_rules else default_scale(q.shape[-1] if q.shape else 1)
        options = dataclasses.replace(options, attn_scale=scale)
    common: dict[str, Any] = dict(
        io_dtype=dtypes["io_data_type"],
        intermediate_dtype=dtypes["intermediate_data_type"] or torch.float32,
        compute_dtype=dtypes["compute_data_type"] or torch.float32,
        options=options,
        max_seq_len_q=parsed.max_seq_len_q,
        max_seq_len_kv=parsed.max_seq_len_kv,
    )
    if parsed.score_mod is not None:  # its graph tensors' geometry joins it: roles score_input_0, ...
        read = tuple(specs.pop(role) for role in SCORE_INPUTS if role in specs)
        common["score_mod"] = dataclasses.replace(parsed.score_mod, inputs=read)
    if node.op is Op.FORWARD:
        if node.paged:
            common.update(
                kv_cache_layout=infer_cache_layout(specs["k"], q, node.kv_cache_layout, node.errors),
                options=dataclasses.replace(options, padding=True),  # caches are read through per-sequence lengths
            )
        o = output_spec(node.outputs["o"], default_o(q, specs["v"]))
        stats = None
        wanted = node.outputs.get("stats")
        if wanted is not None and (wanted.is_output or wanted.consumed):  # virtual stats are not computed
            stats = output_spec(node.outputs["stats"], default_stats(q, specs.get("seq_len_q"), parsed.max_seq_len_q))
        if "rng_dump" in node.outputs:
            dump = TensorSpec.contiguous(
                (*q.shape[:3], specs["k"].shape[2] if specs["k"].rank == 4 else 1), torch.float32, q.device
            )
            common["rng_dump"] = output_spec(node.outputs["rng_dump"], dump)
        inputs: dict[str, Any] = {role: spec for role, spec in specs.items() if role in INPUTS[Op.FORWARD, node.fp8]}
        amaxes = _amaxes(node, FP8_AMAXES, q.device)
        return AttentionProblem(op=Op.FORWARD, o=o, stats=stats, **inputs, **amaxes, **common)
    outs: dict[str, Any] = {
        role: output_spec(node.outputs[role], like(specs[source]))
        for role, source in (("grad_q", "q"), ("grad_k", "k"), ("grad_v", "v"))
    }
    if "grad_bias" in node.outputs:
        bias = specs.get("bias")
        default = like(bias) if bias is not None else TensorSpec.contiguous((1, 1, 1, 1), torch.float32, q.device)
        outs["grad_bias"] = output_spec(node.outputs["grad_bias"], default)
    if "grad_sink" in node.outputs:
        outs["grad_sink"] = output_spec(
            node.outputs["grad_sink"], TensorSpec.contiguous((1, q.shape[1], 1, 1), torch.float32, q.device)
        )
    outs.update(_amaxes(node, FP8_BACKWARD_AMAXES, q.device))
    inputs = {role: spec for role, spec in specs.items() if role in INPUTS[Op.BACKWARD, node.fp8]}
    return AttentionProblem(op=Op.BACKWARD, **inputs, **outs, **common, deterministic=node.deterministic)


def output_spec(handle: Any, default: TensorSpec) -> TensorSpec:
    """An output's geometry: its defaults, then whatever set_dim/set_stride/set_data_type said.
    Validation checks that the result is a layout an output can have. In the frontend's graphs
    an output whose layout is not set is packed row-major (BHSD for O and the gradients), as the
    frontend materializes it, whatever q's layout; a ragged one keeps q's (THD) layout, which its
    offsets place."""
    if handle.recording.frontend_rules and handle.ragged_offset is None:
        default = TensorSpec.contiguous(default.shape, default.dtype, default.device)
    shape = handle.dim if handle.dim is not None else default.shape
    if handle.stride is not None:
        stride = handle.stride
    elif handle.dim is not None and len(shape) == len(default.stride):
        stride = strides_like(shape, default.stride)
    elif handle.dim is not None:
        stride = contiguous_strides(shape)
    else:
        stride = default.stride
    return TensorSpec(tuple(shape), tuple(stride), handle.dtype or default.dtype, default.device)


def infer_cache_layout(k: TensorSpec, q: TensorSpec, explicit: Any, errors: list[str]) -> KVCacheLayout | None:
    """Which of [num_pages, page_size, H_kv, D] / [num_pages, H_kv, page_size, D] the cache is."""
    if explicit is not None:
        try:
            return KVCacheLayout(str(getattr(explicit, "value", explicit)).upper())
        except ValueError:
            errors.append(f"kv_cache_layout: {explicit!r}; allowed 'NPHD' ([pages, page_size, H_kv, D]) or 'NHPD'")
            return KVCacheLayout.NPHD
    if k.rank != 4 or q.rank != 4:
        return KVCacheLayout.NPHD  # validation reports the ranks
    h_q = q.shape[1]
    fits = [
        layout
        for layout, heads in ((KVCacheLayout.NPHD, k.shape[2]), (KVCacheLayout.NHPD, k.shape[1]))
        if heads > 0 and h_q % heads == 0
    ]
    if len(fits) == 1:
        return fits[0]
    if not fits:
        errors.append(
            f"k: paged cache shape {list(k.shape)}: neither dim 1 ({k.shape[1]}) nor dim 2 ({k.shape[2]}) "
            f"is a K/V head count dividing q's {h_q} heads"
        )
        return KVCacheLayout.NPHD
    if k.shape[1] == k.shape[2] == 1:
        return KVCacheLayout.NPHD  # one token of one head per page: both readings are the same
    # Both readings fit (page_size == H_kv > 1 included: the two still gather differently).
    errors.append(
        f"k: paged cache shape {list(k.shape)} reads as [num_pages, page_size={k.shape[1]}, H_kv={k.shape[2]}, D] "
        f"or as [num_pages, H_kv={k.shape[1]}, page_size={k.shape[2]}, D]; pass kv_cache_layout='NPHD' or 'NHPD'"
    )
    return KVCacheLayout.NPHD
