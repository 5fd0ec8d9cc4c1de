"""Validation: pure functions from a problem to the list of everything wrong with it.

``problems(p)`` checks geometry, dtypes and option combinations (the values of the small
integer inputs, which only exist where a tensor is at hand, are ``bounds.value_problems``).
It never raises: callers collect the lines and raise one ``ValidationError``. Each line names the argument, what was given and what is allowed.

These are the rules of the operation itself, the same on every backend (they mirror what
the cuDNN frontend documents as well formed). What a given GPU or cuDNN version can run is
the backends' business and raises ``UnsupportedError``.
"""

from __future__ import annotations

import functools
import math

import torch

from .dtypes import FLOATING_IO, FP8, dtype_name
from .mask import Causal
from .problem import AttentionProblem, KVCacheLayout, Op, TensorSpec
from .ragged import offset_problems
from .roles import (
    BACKWARD_OUTPUTS,
    FORWARD_OUTPUTS,
    FP8_AMAXES,
    FP8_BACKWARD_AMAXES,
    FP8_BACKWARD_SCALES,
    FP8_SCALES,
    user_name,
)
from .score_inputs import score_input_problems
from .tensor_checks import check_ranks, check_strides

OUTPUT_ROLES = {Op.FORWARD: FORWARD_OUTPUTS + FP8_AMAXES, Op.BACKWARD: BACKWARD_OUTPUTS + FP8_BACKWARD_AMAXES}
# cuDNN's head dims; the reference runs any (ops/cudnn/capabilities.py refuses the others by name).
HEAD_DIM_MULTIPLE = 8
# float64 is well formed (torch's SDPA takes it; the reference computes it in float64); cuDNN has
# no double-precision path and says so (capabilities).
WIDE_IO = (*FLOATING_IO, torch.float64)
SEQ_LEN_DTYPES = (torch.int32, torch.int64)  # int64 runs as int32 on cuDNN (bounds.clamped)
PAGE_TABLE_DTYPES = (torch.int32,)
RNG_DTYPES = (torch.int64, torch.int32)


def _dt(spec: TensorSpec) -> str:
    return dtype_name(spec.dtype)


def problems(p: AttentionProblem) -> list[str]:
    """Everything structurally wrong with ``p``; empty when it is well formed."""
    if torch.compiler.is_compiling():  # dynamo traces through the cache wrapper, and warns it did
        return list(_problems.__wrapped__(p))
    return list(_problems(p))


@functools.lru_cache(maxsize=4096)  # pure and hashable: a rebuilt graph pays a dict lookup
def _problems(p: AttentionProblem) -> tuple[str, ...]:
    found: list[str] = []
    ranks_ok = check_ranks(p, found)
    ranks_ok = check_strides(p, found, OUTPUT_ROLES[p.op]) and ranks_ok
    _check_dtypes(p, found)
    _check_devices(p, found)
    if not ranks_ok:
        return tuple(found)  # the geometry below needs the ranks to be right
    _check_geometry(p, found)
    _check_bias(p, found)
    _check_masks(p, found)
    _check_padding(p, found)
    found += offset_problems(p)
    found += score_input_problems(p)
    _check_dropout(p, found)
    _check_paging(p, found)
    _check_backward(p, found)
    if not math.isfinite(p.options.attn_scale):
        found.append(f"attn_scale: {p.options.attn_scale} is not finite; give a finite float")
    return tuple(found)


# ---- ranks, strides, dtypes, devices -----------------------------------------------------


def _check_dtypes(p: AttentionProblem, found: list[str]) -> None:
    q_dt = p.q.dtype
    if p.is_fp8:
        _check_fp8(p, found)
        return
    if q_dt in FP8:
        op = "sdpa_fp8" if p.is_forward else "sdpa_fp8_backward"
        found.append(f"q: dtype {_dt(p.q)}: FP8 attention needs its scale and descale tensors; use g.{op}(...)")
    elif q_dt not in WIDE_IO:
        allowed = ", ".join(dtype_name(d) for d in WIDE_IO)
        fp8 = " or ".join(dtype_name(d) for d in FP8)
        found.append(f"q: dtype {_dt(p.q)} is not supported; allowed: {allowed} ({fp8} through g.sdpa_fp8)")
    if p.io_dtype is not None and p.io_dtype != q_dt:
        found.append(
            f"io_data_type: {dtype_name(p.io_dtype)} but q is {_dt(p.q)}; they must agree (or leave io_data_type=None)"
        )
    for role in ("k", "v"):
        spec = getattr(p, role)
        if spec.dtype != q_dt:
            found.append(f"{role}: dtype {_dt(spec)} differs from q's {_dt(p.q)}; q, k and v must share one dtype")
    out_allowed = (q_dt,) + ((torch.float16, torch.bfloat16) if q_dt in FP8 else ())
    if p.o.dtype not in out_allowed:
        found.append(f"o: dtype {_dt(p.o)}; must be {', '.join(dtype_name(d) for d in out_allowed)}")
    for role in ("grad_o", "grad_q", "grad_k", "grad_v"):
        spec = getattr(p, role)
        if spec is not None and spec.dtype != q_dt:
            found.append(f"{_name(role)}: dtype {_dt(spec)} differs from q's {_dt(p.q)}; it must match")
    stats_dtypes = (torch.float32, torch.float64) if q_dt == torch.float64 else (torch.float32,)
    if p.stats is not None and p.stats.dtype not in stats_dtypes:
        found.append(f"stats: dtype {_dt(p.stats)}; stats are float32 (or float64 beside float64 q)")
    for role in ("bias", "grad_bias"):
        spec = getattr(p, role)
        if spec is not None and spec.dtype not in (q_dt, torch.float32):
            found.append(f"{_name(role)}: dtype {_dt(spec)}; must be q's dtype ({_dt(p.q)}) or float32")
    for role, int_dtypes in (
        ("seq_len_q", SEQ_LEN_DTYPES),
        ("seq_len_kv", SEQ_LEN_DTYPES),
        ("page_table_k", PAGE_TABLE_DTYPES),
        ("page_table_v", PAGE_TABLE_DTYPES),
        ("dropout_seed", RNG_DTYPES),
        ("dropout_offset", RNG_DTYPES),
    ):
        spec = getattr(p, role)
        if spec is not None and spec.dtype not in int_dtypes:
            found.append(f"{role}: dtype {_dt(spec)}; must be {' or '.join(dtype_name(d) for d in int_dtypes)}")
    for name, dtype in (("intermediate_data_type", p.intermediate_dtype), ("compute_data_type", p.compute_dtype)):
        if dtype != torch.float32:
            found.append(f"{name}: {dtype_name(dtype)}; attention accumulates in float32 (data_type.FLOAT)")


def _check_fp8(p: AttentionProblem, found: list[str]) -> None:
    """FP8 nodes: FP8 data, float32 [1, 1, 1, 1] scales and amaxes; outputs FP8 or 16-bit."""
    op = "sdpa_fp8" if p.is_forward else "sdpa_fp8_backward"
    fp8 = " or ".join(dtype_name(d) for d in FP8)
    wide = FP8 + (torch.float16, torch.bfloat16)
    if p.q.dtype not in FP8:
        found.append(f"q: dtype {_dt(p.q)}; {op} takes {fp8} (use sdpa for {_dt(p.q)})")
    for role in ("k", "v"):
        spec = getattr(p, role)
        if spec.dtype != p.q.dtype:
            found.append(f"{role}: dtype {_dt(spec)} differs from q's {_dt(p.q)}; q, k and v must share one dtype")
    for role, allowed in (("o", FP8 if not p.is_forward else wide), ("grad_o", FP8)):
        spec = getattr(p, role)
        if spec is not None and spec.dtype not in allowed:
            found.append(f"{_name(role)}: dtype {_dt(spec)}; must be {', '.join(dtype_name(d) for d in allowed)}")
    for role in ("grad_q", "grad_k", "grad_v"):
        spec = getattr(p, role)
        if spec is not None and spec.dtype not in wide:
            found.append(f"{_name(role)}: dtype {_dt(spec)}; must be {', '.join(dtype_name(d) for d in wide)}")
    if p.stats is not None and p.stats.dtype != torch.float32:
        found.append(f"stats: dtype {_dt(p.stats)}; stats are float32")
    # dict.fromkeys: the backward's scales repeat some of the forward's (descale_q, ...): one line each
    for role in dict.fromkeys((*FP8_SCALES, *FP8_BACKWARD_SCALES, *FP8_AMAXES, *FP8_BACKWARD_AMAXES)):
        spec = getattr(p, role)
        if spec is not None and (spec.dtype != torch.float32 or spec.shape != (1, 1, 1, 1)):
            found.append(
                f"{_name(role)}: dtype {_dt(spec)}, shape {list(spec.shape)}; FP8 scales and amaxes are "
                "float32 [1, 1, 1, 1] tensors"
            )
    for name, dtype in (("intermediate_data_type", p.intermediate_dtype), ("compute_data_type", p.compute_dtype)):
        if dtype != torch.float32:
            found.append(f"{name}: {dtype_name(dtype)}; attention accumulates in float32 (data_type.FLOAT)")


def _check_devices(p: AttentionProblem, found: list[str]) -> None:
    # Dropout seeds and offsets, a tensor scale and a score modifier's scalars may live on the host (by value).
    host = ("dropout_seed", "dropout_offset", "scale_tensor")
    specs = {
        role: spec
        for role, spec in p.tensor_specs().items()
        if not (spec.device == "cpu" and (role in host or role.startswith("score_input_") and spec.numel == 1))
    }
    if len({spec.device for spec in specs.values()}) > 1:
        where = ", ".join(
            f"{_name(role)} on {spec.device}" for role, spec in specs.items() if spec.device != p.q.device
        )
        found.append(f"device: tensors are on several devices (q on {p.q.device}; {where}); put them on one device")


# ---- geometry ------------------------------------------------------------------------------


def _check_geometry(p: AttentionProblem, found: list[str]) -> None:
    h_q, h_k, h_v = p.h_q, p.h_k, p.h_v
    for role, h in (("k", h_k), ("v", h_v)):
        if h_q % h != 0:
            found.append(
                f"{role}: {h} heads do not divide q's {h_q}; for GQA/MQA the K/V head count must divide the Q head count"
            )
    if p.k.shape[-1] != p.d_qk:
        found.append(f"k: head dim d_qk={p.k.shape[-1]} differs from q's {p.d_qk}; q and k must share d_qk")
    if not p.is_thd and not p.is_paged:
        b = p.q.shape[0]
        for role in ("k", "v"):
            if getattr(p, role).shape[0] != b:
                found.append(f"{role}: batch {getattr(p, role).shape[0]} differs from q's {b}")
        if p.k.shape[2] != p.v.shape[2]:
            found.append(f"v: sequence length {p.v.shape[2]} differs from k's {p.k.shape[2]}; k and v must share S_kv")
    if p.is_thd:
        if p.k.shape[0] != p.v.shape[0]:
            found.append(f"v: {p.v.shape[0]} tokens differ from k's {p.k.shape[0]}; packed k and v must share T_kv")
        # A maximum above the packed token count is allowed: plans are shared by every packing
        # of one batch geometry (AttentionProblem.for_plan), and the padding is never computed.
        for name, value in (("max_seq_len_q", p.max_seq_len_q), ("max_seq_len_kv", p.max_seq_len_kv)):
            if value is not None and value < 1:
                found.append(f"{name}: {value}; must be >= 1")
    elif p.max_seq_len_q is not None:
        found.append("max_seq_len_q: only meaningful for ragged (3-D THD) q; leave it None")
    expected_o = _out_shape(p, p.d_v)
    if tuple(p.o.shape) != expected_o:
        found.append(f"o: shape {list(p.o.shape)}; expected {list(expected_o)} (q's shape with v's head dim)")
    if p.stats is not None and tuple(p.stats.shape) != p.stats_shape:
        found.append(f"stats: shape {list(p.stats.shape)}; expected {list(p.stats_shape)} ([B, H_q, S_q, 1])")


def _out_shape(p: AttentionProblem, d: int) -> tuple[int, ...]:
    return tuple(p.q.shape[:-1]) + (d,)


def _check_bias(p: AttentionProblem, found: list[str]) -> None:
    if p.bias is None:
        if p.grad_bias is not None:
            found.append("dBias: requested without attn_bias; a bias gradient needs a bias")
        return
    full = (p.batch, p.h_q, p.s_q, p.s_kv)
    names = ("B", "H", "S_q", "S_kv")
    allowed = [(1, full[0]), (1, full[1]), (1, full[2]), (full[3],)]  # keys are never broadcast
    bad = [
        f"{n}={given} (allowed {' or '.join(map(str, ok))})"
        for n, given, ok in zip(names, p.bias.shape, allowed)
        if given not in ok
    ]
    if bad:
        found.append(
            f"attn_bias: shape {list(p.bias.shape)} does not broadcast to [B, H, S_q, S_kv]={list(full)}: {', '.join(bad)}"
        )
    if p.grad_bias is not None and tuple(p.grad_bias.shape) != tuple(p.bias.shape):
        found.append(f"dBias: shape {list(p.grad_bias.shape)} differs from attn_bias's {list(p.bias.shape)}")


def _check_masks(p: AttentionProblem, found: list[str]) -> None:
    # ALiBi without top-left causal and bottom-right causal with a bias, ALiBi or dropout are well
    # formed: the reference runs them, cuDNN refuses them (ops/cudnn/capabilities.py).
    if p.options.right_bound is not None and (p.options.right_bound < 1 or p.options.causal is not Causal.NONE):
        found.append(
            f"diagonal_band_right_bound: {p.options.right_bound}; a bound past the diagonal is >= 1, "
            "without a causal mask (causal is a right bound of 0)"
        )
    if p.options.sliding_window is not None:
        if p.options.sliding_window < 1:
            found.append(f"sliding_window_length: {p.options.sliding_window}; must be >= 1")


def unrunnable(p: AttentionProblem) -> list[str]:
    """Well-formed problems no backend runs, as the frontend refuses them (not supported, not
    invalid): a bottom-right diagonal that leaves the first query rows without keys. (A sliding
    window with S_q > S_kv runs on the reference, rows without keys giving 0 as torch's
    fully masked rows do; cuDNN refuses it in its capabilities.)"""
    if p.score_mod is not None and p.is_fp8 and not p.is_forward:
        return ["score_mod: the FP8 backward takes no score modifier (the frontend's sdpa_fp8_backward has none)"]
    s_q, s_kv = p.s_q, p.s_kv
    if s_q <= s_kv or p.options.padding:
        return []
    found = []
    if p.options.causal is Causal.BOTTOM_RIGHT:
        found.append(
            f"use_causal_mask_bottom_right: S_q={s_q} > S_kv={s_kv}; bottom-right causal needs S_q <= S_kv "
            "(or a padding mask with per-batch lengths)"
        )
    elif p.options.bottom_right and p.options.right_bound is not None:  # the same band, shifted right
        found.append(
            f"diagonal_band_right_bound: on the bottom-right diagonal with S_q={s_q} > S_kv={s_kv}; it needs "
            "S_q <= S_kv (or a padding mask with per-batch lengths), as bottom-right causal does"
        )
    return found


def _check_padding(p: AttentionProblem, found: list[str]) -> None:
    if p.is_thd and not p.options.padding:
        found.append("use_padding_mask: ragged (THD) inputs need the padding mask with seq_len_q and seq_len_kv")
    if p.options.padding:
        for role in ("seq_len_q", "seq_len_kv"):
            if getattr(p, role) is None and not (role == "seq_len_q" and p.is_paged):
                found.append(
                    f"{role}: missing; use_padding_mask=True needs seq_len_q and seq_len_kv tensors of shape [B]"
                )
    else:
        for role in ("seq_len_q", "seq_len_kv"):
            if getattr(p, role) is not None:
                found.append(f"{role}: given without use_padding_mask=True; set use_padding_mask=True or drop it")
    b = p.batch
    for role in ("seq_len_q", "seq_len_kv"):
        spec = getattr(p, role)
        if spec is not None and tuple(spec.shape) not in ((b,), (b, 1, 1, 1)):
            found.append(f"{role}: shape {list(spec.shape)}; expected [{b}] or [{b}, 1, 1, 1] (one length per batch)")


def _check_dropout(p: AttentionProblem, found: list[str]) -> None:
    if not 0.0 <= p.options.dropout_p < 1.0 or math.isnan(p.options.dropout_p):
        found.append(f"dropout: probability {p.options.dropout_p}; allowed 0 <= p < 1")
    for role in ("dropout_seed", "dropout_offset"):
        spec = getattr(p, role)
        if spec is not None and spec.numel != 1:
            found.append(f"{role}: shape {list(spec.shape)}; must hold one value (shape [1] or [1, 1, 1, 1])")


def _check_paging(p: AttentionProblem, found: list[str]) -> None:
    if not p.is_paged:
        for role in ("page_table_k", "page_table_v"):
            if getattr(p, role) is not None:
                found.append(f"{role}: given but k/v are not paged caches")
        return
    if not p.is_forward:
        found.append(
            "paged_attention_k_table: paged K/V caches are forward-only (inference); sdpa_backward takes dense K/V"
        )
    if p.seq_len_kv is None:
        found.append("seq_len_kv: paged caches need seq_len_kv (the valid length of each sequence's cache)")
    if p.is_thd and p.seq_len_q is None:
        found.append("seq_len_q: missing; a ragged q [T, H, D] over paged caches needs seq_len_q [B] (chunked prefill)")
        return
    b = p.batch  # a ragged q (chunked prefill): one page-table row per seq_len_q entry
    page_size = p.page_size or 0
    pages = None
    for role in ("page_table_k", "page_table_v"):
        spec = getattr(p, role)
        if spec is None:
            found.append(f"{role}: missing; a paged cache needs a page table [B, pages_per_seq] int32")
            continue
        shape = tuple(spec.shape)
        if len(shape) == 2 and shape[0] == b:
            n = shape[1]
        elif len(shape) == 4 and shape[0] == b and shape[1] == 1 and shape[3] == 1:
            n = shape[2]
        else:
            found.append(f"{role}: shape {list(shape)}; expected [{b}, pages_per_seq] or [{b}, 1, pages_per_seq, 1]")
            continue
        pages = n if pages is None else min(pages, n)
    # V's cache has pages, heads and a head dim of its own (its own page table reads it); one page size.
    v_page = p.v.shape[1] if p.kv_cache_layout is KVCacheLayout.NPHD else p.v.shape[2]
    if p.v.rank == 4 and v_page != page_size:
        found.append(f"v: cache shape {list(p.v.shape)} has page size {v_page}; k's cache has {page_size}")
    if pages is not None and p.max_seq_len_kv is not None and p.max_seq_len_kv > pages * page_size:
        found.append(
            f"paged_attention_max_seq_len_kv: {p.max_seq_len_kv} exceeds pages_per_seq*page_size={pages * page_size}"
        )
    if p.max_seq_len_kv is not None and p.max_seq_len_kv < 1:
        found.append(f"paged_attention_max_seq_len_kv: {p.max_seq_len_kv}; must be >= 1")
    if p.kv_cache_layout not in (KVCacheLayout.NPHD, KVCacheLayout.NHPD):
        found.append(f"kv_cache_layout: {p.kv_cache_layout}; allowed NPHD or NHPD")


def _check_backward(p: AttentionProblem, found: list[str]) -> None:
    if p.is_forward:
        return
    if p.stats is None:
        found.append("stats: sdpa_backward needs the forward's stats (run the forward with generate_stats=True)")
    for role, like in (("grad_o", p.o), ("grad_q", p.q), ("grad_k", p.k), ("grad_v", p.v)):
        spec = getattr(p, role)
        if spec is None:
            continue
        if tuple(spec.shape) != tuple(like.shape):
            source = {"grad_o": "o", "grad_q": "q", "grad_k": "k", "grad_v": "v"}[role]
            found.append(f"{_name(role)}: shape {list(spec.shape)} differs from {source}'s {list(like.shape)}")


# ---- naming helpers --------------------------------------------------------------------------


def _name(role: str) -> str:
    return user_name(role)
