"""The tensor roles of an attention node: one table, read by every module that names a tensor.

A role is a tensor's place in a problem (``q``, ``grad_q``, ``seq_len_kv``, ...). The table
gives each role its fixed cuDNN uid (runs bind tensors by it), the name users know it by
(an op argument, or the frontend's output name) and, for tensors that can be ragged (THD),
the sequence-length input their offsets come from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Role:
    name: str  # the AttentionProblem field
    uid: int  # the cuDNN frontend uid
    user: str  # how errors and g.inputs spell it (an op argument)
    output: str | None = None  # the frontend's name when the role is an op output
    lengths: str | None = None  # ragged (THD) tensors: the seq_len input their offsets come from
    ragged_uid: int | None = None  # ... and the uid of those offsets
    offsets_of: str | None = None  # a caller's ragged offsets: the tensor role they address


ROLES: dict[str, Role] = {
    role.name: role
    for role in (
        Role("q", 1, "q", lengths="seq_len_q", ragged_uid=32),
        Role("k", 2, "k", lengths="seq_len_kv", ragged_uid=33),
        Role("v", 3, "v", lengths="seq_len_kv", ragged_uid=34),
        Role("o", 4, "o", output="O", lengths="seq_len_q", ragged_uid=35),
        Role("stats", 5, "stats", output="Stats"),
        Role("grad_o", 6, "dO", lengths="seq_len_q", ragged_uid=36),
        Role("grad_q", 7, "dQ", output="dQ", lengths="seq_len_q", ragged_uid=37),
        Role("grad_k", 8, "dK", output="dK", lengths="seq_len_kv", ragged_uid=38),
        Role("grad_v", 9, "dV", output="dV", lengths="seq_len_kv", ragged_uid=39),
        Role("bias", 10, "attn_bias"),
        Role("grad_bias", 11, "dBias", output="dBias"),
        Role("seq_len_q", 12, "seq_len_q"),
        Role("seq_len_kv", 13, "seq_len_kv"),
        Role("page_table_k", 14, "paged_attention_k_table"),
        Role("page_table_v", 15, "paged_attention_v_table"),
        Role("dropout_seed", 16, "dropout_seed"),
        Role("dropout_offset", 17, "dropout_offset"),
        Role("rng_dump", 18, "rng_dump", output="rng_dump"),
        Role("scale_tensor", 19, "attn_scale"),  # attn_scale given as a graph tensor: read at each run
        # Attention sinks: a float32 [1, H_q, 1, 1] logit per head in every softmax denominator, and its gradient.
        Role("sink_token", 20, "sink_token"),
        Role("grad_sink", 21, "dSink_token", output="dSink_token"),
        # The graph tensors a score modifier reads (core/score_mod.py), in the order it first reads them.
        *(Role(f"score_input_{i}", 70 + i, f"score_mod input {i}") for i in range(8)),
        # FP8 (sdpa_fp8, sdpa_fp8_backward): per-tensor scales in, amaxes out, float32 [1, 1, 1, 1].
        Role("descale_q", 50, "descale_q"),
        Role("descale_k", 51, "descale_k"),
        Role("descale_v", 52, "descale_v"),
        Role("descale_s", 53, "descale_s"),
        Role("scale_s", 54, "scale_s"),
        Role("scale_o", 55, "scale_o"),
        Role("amax_s", 56, "Amax_S", output="Amax_S"),
        Role("amax_o", 57, "Amax_O", output="Amax_O"),
        Role("descale_o", 58, "descale_o"),
        Role("descale_grad_o", 59, "descale_dO"),
        Role("descale_grad_p", 60, "descale_dP"),
        Role("scale_grad_q", 61, "scale_dQ"),
        Role("scale_grad_k", 62, "scale_dK"),
        Role("scale_grad_v", 63, "scale_dV"),
        Role("scale_grad_p", 64, "scale_dP"),
        Role("amax_grad_q", 65, "Amax_dQ", output="Amax_dQ"),
        Role("amax_grad_k", 66, "Amax_dK", output="Amax_dK"),
        Role("amax_grad_v", 67, "Amax_dV", output="Amax_dV"),
        Role("amax_grad_p", 68, "Amax_dP", output="Amax_dP"),
        # The frontend's ragged offsets given by the caller (``tensor.set_ragged_offset``): int32/int64
        # [B + 1, 1, 1, 1] element offsets of each sequence in a 4-D tensor. They take the uids a
        # packed [T, H, D] tensor's computed offsets use: a problem has one kind or the other.
        *(
            Role(f"{name}_offset", uid, f"{user}.ragged_offset", offsets_of=name)
            for name, uid, user in (
                ("q", 32, "q"),
                ("k", 33, "k"),
                ("v", 34, "v"),
                ("o", 35, "O"),
                ("grad_o", 36, "dO"),
                ("grad_q", 37, "dQ"),
                ("grad_k", 38, "dK"),
                ("grad_v", 39, "dV"),
                ("stats", 40, "Stats"),
                ("page_table_k", 41, "paged_attention_k_table"),
                ("page_table_v", 42, "paged_attention_v_table"),
            )
        ),
    )
}

UID = {name: role.uid for name, role in ROLES.items()}

# Each op's run-time inputs in the order of that method's own parameters: a graph's positional
# inputs are its distinct input tensors, node by node, each node's in this order.
SCORE_INPUTS = tuple(f"score_input_{i}" for i in range(8))
MASK_INPUTS = (
    "bias",
    "seq_len_q",
    "seq_len_kv",
    "dropout_seed",
    "dropout_offset",
    "scale_tensor",
    "sink_token",
    *SCORE_INPUTS,
)
# Ragged offsets come last: the tensors they address are set before them (set_ragged_offset).
FORWARD_OFFSETS = (
    "q_offset",
    "k_offset",
    "v_offset",
    "page_table_k_offset",
    "page_table_v_offset",
    "o_offset",
    "stats_offset",
)
BACKWARD_OFFSETS = (
    "q_offset",
    "k_offset",
    "v_offset",
    "o_offset",
    "grad_o_offset",
    "stats_offset",
    "grad_q_offset",
    "grad_k_offset",
    "grad_v_offset",
)
SDPA_INPUTS = ("q", "k", "v", *MASK_INPUTS, "page_table_k", "page_table_v", *FORWARD_OFFSETS)
PAGED_INPUTS = (
    "q",
    "k",
    "v",
    "page_table_k",
    "seq_len_q",
    "seq_len_kv",
    "page_table_v",
    "bias",
    "dropout_seed",
    "dropout_offset",
    "scale_tensor",
    "sink_token",
    *SCORE_INPUTS,
    *FORWARD_OFFSETS,
)
BACKWARD_INPUTS = ("q", "k", "v", "o", "grad_o", "stats", *MASK_INPUTS, *BACKWARD_OFFSETS)

FP8_SCALES = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
FP8_BACKWARD_SCALES = (
    "descale_q",
    "descale_k",
    "descale_v",
    "descale_o",
    "descale_grad_o",
    "descale_s",
    "descale_grad_p",
    "scale_s",
    "scale_grad_q",
    "scale_grad_k",
    "scale_grad_v",
    "scale_grad_p",
)
FP8_INPUTS = ("q", "k", "v", *FP8_SCALES, *MASK_INPUTS, *FORWARD_OFFSETS)
FP8_BACKWARD_INPUTS = ("q", "k", "v", "o", "grad_o", "stats", *FP8_BACKWARD_SCALES, *MASK_INPUTS, *BACKWARD_OFFSETS)

FORWARD_OUTPUTS = ("o", "stats", "rng_dump")
BACKWARD_OUTPUTS = ("grad_q", "grad_k", "grad_v", "grad_bias", "grad_sink")
FP8_AMAXES = ("amax_s", "amax_o")
FP8_BACKWARD_AMAXES = ("amax_grad_q", "amax_grad_k", "amax_grad_v", "amax_grad_p")


def user_name(role: str) -> str:
    """How a role is spelled to users: ``grad_o`` -> ``dO``, ``bias`` -> ``attn_bias``."""
    entry = ROLES.get(role)
    return entry.user if entry is not None else role


def offset_role(role: str) -> str:
    """The role of the caller's ragged offsets of tensor ``role``: ``q`` -> ``q_offset``."""
    return f"{role}_offset"


def offset_roles() -> tuple[str, ...]:
    return tuple(name for name, role in ROLES.items() if role.offsets_of is not None)


def sequence_lengths(role: str) -> str:
    """The seq_len input that says how many rows of tensor ``role`` each sequence has."""
    return "seq_len_q" if role in ("q", "o", "grad_o", "grad_q", "stats") else "seq_len_kv"


def ragged_roles() -> tuple[str, ...]:
    return tuple(name for name, role in ROLES.items() if role.lengths is not None)


def problem_inputs(problem: Any) -> tuple[str, ...]:
    """The run-time inputs ``problem`` has, in its op's parameter order (a prepared run's order)."""
    order: tuple[str, ...]
    if problem.is_forward:
        order = FP8_INPUTS if problem.is_fp8 else SDPA_INPUTS
    else:
        order = FP8_BACKWARD_INPUTS if problem.is_fp8 else BACKWARD_INPUTS
    return tuple(role for role in order if getattr(problem, role) is not None)


def problem_outputs(problem: Any) -> tuple[str, ...]:
    """The outputs ``problem`` computes, in its op's order (FP8 amaxes after the tensors)."""
    order: tuple[str, ...]
    if problem.is_forward:
        order = (*FORWARD_OUTPUTS, *FP8_AMAXES)
    else:
        order = (*BACKWARD_OUTPUTS, *FP8_BACKWARD_AMAXES)
    return tuple(role for role in order if getattr(problem, role) is not None)
