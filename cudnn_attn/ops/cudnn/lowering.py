"""Lowering: one ``AttentionProblem`` to one cuDNN frontend graph, tensors bound by fixed uids.

Works without a GPU (the frontend builds and validates graphs on the host), which is how
the CPU tests check it. Layout translations:

- THD ``[T, H, D]`` with token stride ``st`` becomes ``[B, H, S_max, D]`` with strides
  ``[S_max*st, sh, st, 1]`` plus a ragged offset per tensor: ``cumsum(seq_len) * st``;
- paged caches become the frontend's ``[num_pages, H_kv, page_size, D]`` containers;
- a page table ``[B, n]`` becomes ``[B, 1, n, 1]``; sequence lengths ``[B]`` become ``[B, 1, 1, 1]``;
- a 4-D tensor with the caller's ragged offsets (``core/ragged.py``) keeps its dims and strides and
  takes those offsets, bound as int64 under the role's offset uid.

FP8 problems (``p.is_fp8``) lower to ``sdpa_fp8`` / ``sdpa_fp8_backward``: the same tensors and
masks, plus the float32 ``[1, 1, 1, 1]`` scale inputs and amax outputs, each under its role's
uid. Those ops spell the diagonal band ``left_bound`` / ``right_bound`` and take no bias (nor,
backward, ALiBi): ``capabilities`` refuses such problems before they get here.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ...core.mask import Causal
from ...core.problem import AttentionProblem, KVCacheLayout, TensorSpec
from ...core.roles import FP8_AMAXES, FP8_BACKWARD_AMAXES, FP8_BACKWARD_SCALES, FP8_SCALES, ROLES, UID, offset_role
from . import folded_sink
from .dtypes import cudnn_dtype
from .score_mod import callbacks
from .workarounds import full_lengths_reason

# Raised whenever the graph built for a problem changes (a sink folded outside cuDNN's graph
# from revision 2 on): the plan store keeps plans per revision, so a stored plan is never run
# with another graph's tensors.
GRAPH_REVISION = 2


@dataclass
class Lowered:
    """A frontend graph and what running it needs beyond the caller's tensors."""

    graph: Any
    ragged: dict[int, tuple[str, int]] = field(default_factory=dict)  # uid -> (lengths role, token stride)
    # Sequence lengths the plan binds itself, as constants: role -> length of every batch.
    constant_lengths: dict[str, int] = field(default_factory=dict)
    rng_dump: bool = False


def dims_and_strides(role: str, spec: TensorSpec, p: AttentionProblem) -> tuple[list[int], list[int]]:
    """The frontend's logical [B, H, S, D]-style geometry for a tensor of the problem."""
    shape, stride = list(spec.shape), list(spec.stride)
    lengths = ROLES[role].lengths
    if lengths is not None and spec.rank == 3:  # THD
        s_max = p.s_q if lengths == "seq_len_q" else p.s_kv
        token, head = stride[0], stride[1]
        return [p.batch, shape[1], s_max, shape[2]], [s_max * token, head, token, 1]
    if role in ("k", "v") and p.kv_cache_layout is KVCacheLayout.NPHD:  # [N, P, H, D] -> [N, H, P, D]
        return [shape[0], shape[2], shape[1], shape[3]], [stride[0], stride[2], stride[1], stride[3]]
    if role in ("seq_len_q", "seq_len_kv"):
        return [shape[0], 1, 1, 1], [1, 1, 1, 1]
    if role in ("page_table_k", "page_table_v"):
        # cuDNN takes exactly ceil(max_seq_len_kv / page_size) columns: a wider table is read
        # through a narrower window of the same memory (its leading columns, its own strides).
        if spec.rank == 2:
            columns = _table_columns(shape[1], p)
            return [shape[0], 1, columns, 1], [stride[0], stride[1] * columns, stride[1], 1]
        return [*shape[:2], _table_columns(shape[2], p), *shape[3:]], stride
    if role in ("dropout_seed", "dropout_offset"):
        return [1, 1, 1, 1], [1, 1, 1, 1]
    return shape, stride


def _table_columns(width: int, p: AttentionProblem) -> int:
    page = p.page_size or 1
    return min(width, -(-p.s_kv // page))


def lower(p: AttentionProblem, *, rng_dump: bool = False, handle: Any = None) -> Lowered:
    """Build (but do not plan) the frontend graph for ``p``.

    ``handle``: the ``cudnn.Handle`` the frontend lowers and plans with; without one it makes
    (on a GPU, when the graph is planned) a default handle of its own beside the library's.
    """
    import cudnn

    graph = cudnn.pygraph(
        io_data_type=cudnn_dtype(p.q.dtype),
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
        **({"handle": handle} if handle is not None else {}),
    )
    lowered = Lowered(graph=graph, rng_dump=rng_dump)

    def tensor(role: str, spec: TensorSpec | None, **extra: Any) -> Any:
        assert spec is not None, f"{role} is required here (validation guarantees it)"
        dim, stride = dims_and_strides(role, spec, p)
        dtype = torch.int32 if role.startswith("seq_len") else spec.dtype  # int64 lengths are bound as int32
        if role in p.offset_tensors:
            extra["ragged_offset"] = caller_offsets(role)
        return graph.tensor(name=role, dim=dim, stride=stride, data_type=cudnn_dtype(dtype), uid=UID[role], **extra)

    def caller_offsets(role: str) -> Any:
        """The caller's ragged offsets of ``role``: bound as int64 (core/ragged.clamp_offsets)."""
        name = offset_role(role)
        return graph.tensor(
            name=name, dim=[p.batch + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT64, uid=UID[name]
        )

    def ragged(role: str, spec: TensorSpec) -> dict[str, Any]:
        if not p.is_thd or spec.rank != 3:  # paged caches beside a ragged q are not ragged
            return {}
        entry = ROLES[role]
        uid = entry.ragged_uid
        assert uid is not None and entry.lengths is not None, f"{role} cannot be ragged"
        lowered.ragged[uid] = (entry.lengths, spec.stride[0])
        offsets = graph.tensor(
            name=f"ragged_{role}",
            dim=[p.batch + 1, 1, 1, 1],
            stride=[1, 1, 1, 1],
            data_type=cudnn.data_type.INT64,
            uid=uid,
        )
        return {"ragged_offset": offsets}

    def output(handle: Any, role: str, spec: TensorSpec) -> None:
        dim, stride = dims_and_strides(role, spec, p)
        handle.set_output(True).set_dim(dim).set_stride(stride).set_data_type(cudnn_dtype(spec.dtype)).set_uid(
            UID[role]
        )
        if p.is_thd and ROLES[role].lengths is not None:
            handle.set_ragged_offset(ragged(role, spec)["ragged_offset"])
        elif role in p.offset_tensors:
            handle.set_ragged_offset(caller_offsets(role))

    inputs = {role: tensor(role, getattr(p, role), **ragged(role, getattr(p, role))) for role in ("q", "k", "v")}
    options = _mask_options(p, graph, tensor, lowered)
    if p.is_forward:
        if p.is_paged:
            options.update(
                paged_attention_k_table=tensor("page_table_k", p.page_table_k),
                paged_attention_v_table=tensor("page_table_v", p.page_table_v),
                paged_attention_max_seq_len_kv=p.s_kv,
            )
        if rng_dump or p.rng_dump is not None:
            stride = (
                p.rng_dump.stride if p.rng_dump is not None else [p.h_q * p.s_q * p.s_kv, p.s_q * p.s_kv, p.s_kv, 1]
            )
            options["rng_dump"] = graph.tensor(
                name="rng_dump",
                dim=[p.batch, p.h_q, p.s_q, p.s_kv],
                stride=list(stride),
                data_type=cudnn.data_type.FLOAT,
                uid=UID["rng_dump"],
            )
        amaxes: dict[str, Any] = {}
        sink_after = folded_sink.applies(p)  # the plan folds the sink in after the run, from the stats
        if p.is_fp8:
            if "score_mod" in options:  # sdpa_fp8's name for it
                options["fn"] = options.pop("score_mod")
            o, stats, *amax_handles = graph.sdpa_fp8(
                inputs["q"],
                inputs["k"],
                inputs["v"],
                generate_stats=p.generates_stats or sink_after,
                name="sdpa_fp8",
                **_scales(FP8_SCALES, tensor, p),
                **options,
            )
            amaxes = dict(zip(FP8_AMAXES, amax_handles))  # Amax_S, Amax_O
        else:
            if p.q.dtype == torch.float32:  # float32 I/O is served by the composite implementation alone
                options["implementation"] = cudnn.attention_implementation.COMPOSITE
            o, stats = graph.sdpa(
                inputs["q"],
                inputs["k"],
                inputs["v"],
                generate_stats=p.generates_stats or sink_after,
                name="sdpa",
                **options,
            )
        output(o, "o", p.o)
        if p.stats is not None:
            output(stats, "stats", p.stats)
        elif sink_after:  # the log-sum-exp the sink is added from, in the plan's scratch buffer
            stats.set_output(True).set_dim([p.batch, p.h_q, p.s_q, 1]).set_stride(
                [p.h_q * p.s_q, p.s_q, 1, 1]
            ).set_data_type(cudnn.data_type.FLOAT).set_uid(UID["stats"])
        _amax_outputs(amaxes, output, p)
        return lowered
    extra = {role: tensor(role, getattr(p, role), **ragged(role, getattr(p, role))) for role in ("o", "grad_o")}
    stats = tensor("stats", p.stats)
    if p.grad_bias is not None:
        d_bias = graph.tensor(
            name="grad_bias",
            dim=list(p.grad_bias.shape),
            stride=list(p.grad_bias.stride),
            data_type=cudnn_dtype(p.grad_bias.dtype),
            uid=UID["grad_bias"],
        )
        options["dBias"] = d_bias
    if p.grad_sink is not None and not folded_sink.applies(p):  # else the plan makes dSink after the run
        options["dSink_token"] = graph.tensor(
            name="grad_sink",
            dim=list(p.grad_sink.shape),
            stride=list(p.grad_sink.stride),
            data_type=cudnn.data_type.FLOAT,
            uid=UID["grad_sink"],
        )
    if p.is_fp8:
        d_q, d_k, d_v, *amax_handles = graph.sdpa_fp8_backward(
            inputs["q"],
            inputs["k"],
            inputs["v"],
            extra["o"],
            extra["grad_o"],
            stats,
            use_deterministic_algorithm=p.deterministic,
            name="sdpa_fp8_backward",
            **_scales(FP8_BACKWARD_SCALES, tensor, p),
            **options,
        )
        amaxes = dict(zip(FP8_BACKWARD_AMAXES, amax_handles))  # Amax_dQ, Amax_dK, Amax_dV, Amax_dP
    else:
        d_q, d_k, d_v = graph.sdpa_backward(
            inputs["q"],
            inputs["k"],
            inputs["v"],
            extra["o"],
            extra["grad_o"],
            stats,
            use_deterministic_algorithm=p.deterministic,
            name="sdpa_backward",
            **options,
            **_token_totals(p),
        )
        amaxes = {}
    for handle, role in ((d_q, "grad_q"), (d_k, "grad_k"), (d_v, "grad_v")):
        output(handle, role, getattr(p, role))
    _amax_outputs(amaxes, output, p)
    return lowered


def _token_totals(p: AttentionProblem) -> dict[str, int]:
    """A packed backward's token counts: cuDNN then sizes its float32 dQ (and, for GQA, dK/dV)
    accumulators by the tokens rather than by batch x longest sequence, which at 128k tokens of
    long-tailed documents is 6 GB against over 60 GB. The counts are the packed tensors' rows
    (``for_plan`` rounds them up to a bucket), which bound every packing the plan runs."""
    if not p.is_thd:
        return {}
    return {"max_total_seq_len_q": p.q.shape[0], "max_total_seq_len_kv": p.k.shape[0]}


def _scales(roles: tuple[str, ...], tensor: Any, p: AttentionProblem) -> dict[str, Any]:
    """The FP8 op's scale and descale inputs, by the frontend's keyword (``descale_dO``, ...)."""
    return {ROLES[role].user: tensor(role, getattr(p, role)) for role in roles}


def _amax_outputs(handles: dict[str, Any], output: Any, p: AttentionProblem) -> None:
    """The amaxes the problem asks for become outputs; the others stay virtual (the frontend
    calls a declared Amax_S deprecated: only the backend's engines write it)."""
    for role, handle in handles.items():
        spec = getattr(p, role)
        if spec is not None:
            output(handle, role, spec)


def _mask_options(p: AttentionProblem, graph: Any, tensor: Any, lowered: Lowered) -> dict[str, Any]:
    import cudnn

    options: dict[str, Any] = {"attn_scale": p.options.attn_scale}
    if p.scale_tensor is not None:  # read at each run: on the host it is passed by value
        options["attn_scale"] = graph.tensor(
            name="attn_scale",
            dim=[1, 1, 1, 1],
            stride=[1, 1, 1, 1],
            data_type=cudnn.data_type.FLOAT,
            uid=UID["scale_tensor"],
            is_pass_by_value=p.scale_tensor.device == "cpu",
        )
    # sdpa / sdpa_backward: diagonal_band_{left,right}_bound; sdpa_fp8 / sdpa_fp8_backward: {left,right}_bound.
    left, right = (
        ("left_bound", "right_bound") if p.is_fp8 else ("diagonal_band_left_bound", "diagonal_band_right_bound")
    )
    if p.options.has_band:
        bottom = p.options.aligned_bottom_right
        options["diagonal_alignment"] = (
            cudnn.diagonal_alignment.BOTTOM_RIGHT if bottom else cudnn.diagonal_alignment.TOP_LEFT
        )
        if p.options.causal is not Causal.NONE:
            options[right] = 0
        elif p.options.right_bound is not None:
            options[right] = p.options.right_bound
        if p.options.sliding_window is not None:
            options[left] = p.options.sliding_window
    if p.is_fp8 and (p.bias is not None or p.options.alibi):
        # The frontend rejects a bias with FP8 and sdpa_fp8_backward has no ALiBi: capabilities refuse both.
        raise ValueError(f"{p.describe()}: FP8 attention takes no attn_bias or ALiBi")
    if p.bias is not None:
        options["bias"] = tensor("bias", p.bias)
    if p.score_mod is not None:
        inputs = [
            graph.tensor(
                name=f"score_input_{i}",
                dim=list(spec.shape),
                stride=list(spec.stride),
                data_type=cudnn_dtype(spec.dtype),
                uid=UID[f"score_input_{i}"],
                is_pass_by_value=spec.device == "cpu",
            )
            for i, spec in enumerate(p.score_mod.inputs)
        ]
        modifier = callbacks(p.score_mod, inputs)
        options["score_mod"] = modifier.forward
        if modifier.bprop is not None and not p.is_forward:  # sdpa takes no bprop
            options["score_mod_bprop"] = modifier.bprop
        # On the frontend graph, not on `lowered`: a caller may keep the graph alone (lower(p).graph).
        weakref.finalize(graph, modifier.release)
    if p.sink_token is not None and not folded_sink.applies(p):
        options["sink_token"] = tensor("sink_token", p.sink_token)
    if p.options.alibi:
        options["use_alibi_mask"] = True
    # Full lengths work around NaNs seen in the fp16/bf16 backward kernels (workarounds.py); the FP8
    # kernels are others, never measured with it, so FP8 graphs keep exactly the masks asked for.
    constants = (
        {"seq_len_q": p.s_q, "seq_len_kv": p.s_kv}
        if full_lengths_reason(p) and not p.is_fp8 and p.score_mod is None
        else {}
    )
    if p.options.padding or constants:
        # With a score modifier cuDNN takes the lengths (its matmuls stop at them) but no padding
        # mask: the modifier is the only mask it applies.
        if p.score_mod is None:
            options["use_padding_mask"] = True
        for role in ("seq_len_q", "seq_len_kv"):
            spec = getattr(p, role)
            if spec is not None:
                options[role] = tensor(role, spec)
                continue
            # Paged without per-sequence query lengths, or a workaround: the plan binds full lengths.
            lowered.constant_lengths[role] = constants.get(role, p.s_q)
            options[role] = graph.tensor(
                name=role, dim=[p.batch, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32, uid=UID[role]
            )
    if p.has_dropout:
        rng = []
        for role in ("dropout_seed", "dropout_offset"):
            spec = getattr(p, role)
            on_host = spec is None or spec.device == "cpu"
            dtype = cudnn_dtype(spec.dtype) if spec is not None else cudnn.data_type.INT64
            rng.append(
                graph.tensor(
                    name=role,
                    dim=[1, 1, 1, 1],
                    stride=[1, 1, 1, 1],
                    data_type=dtype,
                    uid=UID[role],
                    is_pass_by_value=on_host,
                )
            )
        options["dropout"] = (p.options.dropout_p, rng[0], rng[1])
    return options
