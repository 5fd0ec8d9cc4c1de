"""What cuDNN can run, by GPU architecture and cuDNN version: checked before cuDNN sees a problem.

Each rule is a plain condition with its reason, phrased as the failing condition. Sources:
the cuDNN frontend's attention support matrix and the cuDNN backend release notes (known
issues); rules marked "refused" guard shapes known to fail or to give wrong results.

FP8 (``sdpa_fp8`` / ``sdpa_fp8_backward``) has rules of its own (``_fp8_reasons``), from the
frontend 1.32 checks (``include/cudnn_frontend/node/sdpa_support_surface.h`` for the forward,
``node/sdpa_fp8_bwd.h`` for the backward), TransformerEngine's choice of cuDNN's FP8 backend
(``nvte_get_fused_attn_backend`` in ``common/fused_attn/fused_attn.cpp`` and
``get_attention_backend`` in ``pytorch/attention/dot_product_attention/utils.py``) and frontend
issues where cuDNN gave wrong output or hung instead of declining.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...core import validation
from ...core.dtypes import FP8
from ...core.mask import Causal
from ...core.problem import AttentionProblem
from ...core.roles import user_name
from . import folded_sink


@dataclass(frozen=True)
class Platform:
    """The GPU and library versions a plan is built for (part of every plan's cache key)."""

    gpu: str
    arch: tuple[int, int]  # compute capability
    cudnn: int  # cudnn backend version, e.g. 91900 for 9.19.0
    frontend: str

    @property
    def sm(self) -> int:
        return self.arch[0] * 10 + self.arch[1]

    def describe(self) -> str:
        major, rest = divmod(self.cudnn, 10000)
        minor, patch = divmod(rest, 100)
        return f"{self.gpu} (sm{self.sm}), cuDNN {major}.{minor}.{patch}, frontend {self.frontend}"


MIN_ARCH = (8, 0)
MIN_CUDNN = 90000
PAGED_MIN_CUDNN = 90500
BOTTOM_RIGHT_MIN_CUDNN = 90300
SLIDING_WINDOW_MIN_CUDNN = 90200
RAGGED_INT64_MIN_CUDNN = 90600  # ragged offsets are passed as int64
SINK_MIN_CUDNN = 91300  # sink_token / dSink_token
RAGGED_SINK_BACKWARD_MIN_CUDNN = 92600  # the frontend: an out-of-bounds read in older compute_dot_do_o pre-passes
SCORE_MOD_MIN_CUDNN = 90600  # score_mod / score_mod_bprop (the frontend's flexible-graph tests)
# FP8: the frontend accepts cuDNN >= 9.1, but TransformerEngine uses cuDNN's FP8 attention for
# any sequence length, head dims that are multiples of 16 and padding masks only from 9.7 on
# (9.2.1 covered d = 128 with S % 128 == 0 and no padding). Both skip 9.10.0 (known bugs).
FP8_MIN_ARCH = (9, 0)
FP8_MIN_CUDNN = 90700
FP8_BAD_CUDNN = (91000,)
FP8_HALF_OUTPUT_MIN_CUDNN = 91300  # fp16/bf16 O (dQ, dK, dV) from fp8 inputs, Blackwell only
FP8_MAX_HEAD_DIM = 128  # d_v, and d_qk in the backward
# The forward's d_qk up to 192 (DeepSeek's 192/128): the frontend's own FP8 tests run 144 and 192
# with d_v <= 128 on an H100 and check them; d = 256 returned wrong output (frontend issue #981).
FP8_MAX_HEAD_DIM_QK_FORWARD = 192
# Decode (S_q = 1) with a causal mask and GQA: a known wrong result in older releases; right in
# 9.19 on an H100 (17 of 17 GPU fuzz requests, with this rule off).
DECODE_GQA_FIXED = 91900


def _ver(v: int) -> str:
    major, rest = divmod(v, 10000)
    return f"{major}.{rest // 100}"


def unsupported_reasons(p: AttentionProblem, platform: Platform) -> list[str]:
    """Why cuDNN on ``platform`` cannot run ``p``; empty when it can."""
    return list(_reasons(p, platform))


@functools.lru_cache(maxsize=4096)  # pure: a rebuilt graph pays a lookup
def _reasons(p: AttentionProblem, platform: Platform) -> tuple[str, ...]:
    reasons: list[str] = validation.unrunnable(p)
    if not p.device.startswith("cuda"):
        return (f"device={p.device}: cuDNN runs on CUDA tensors",)
    reasons += _reference_only_reasons(p)
    if platform.arch < MIN_ARCH:
        reasons.append(
            f"compute capability {platform.arch[0]}.{platform.arch[1]} < 8.0: fused attention needs Ampere or newer"
        )
    if platform.cudnn < MIN_CUDNN:
        reasons.append(f"cuDNN {_ver(platform.cudnn)} < 9.0: this library lowers to the cuDNN 9 attention graph")
    if p.is_fp8:
        reasons += _fp8_reasons(p, platform)
    elif p.q.dtype in FP8:
        reasons.append(
            f"dtype={p.q.dtype} without descale_q/scale_o...: fp8 data runs through sdpa_fp8 or sdpa_fp8_backward, "
            "which take its descale and scale tensors"
        )
    else:
        reasons += _head_dim_reasons(p, platform)
        if p.q.dtype == torch.float32:
            reasons += _float32_reasons(p, platform)
    reasons += _mask_reasons(p)
    if p.is_paged and platform.cudnn < PAGED_MIN_CUDNN:
        reasons.append(f"paged K/V caches need cuDNN >= 9.5 (have {_ver(platform.cudnn)})")
    if p.options.has_band and p.options.aligned_bottom_right and platform.cudnn < BOTTOM_RIGHT_MIN_CUDNN:
        reasons.append(f"bottom-right causal masks need cuDNN >= 9.3 (have {_ver(platform.cudnn)})")
    if (p.options.sliding_window is not None or p.options.right_bound is not None) and (
        platform.cudnn < SLIDING_WINDOW_MIN_CUDNN
    ):
        reasons.append(f"sliding windows need cuDNN >= 9.2 (have {_ver(platform.cudnn)})")
    if (p.is_thd or p.offset_tensors) and platform.cudnn < RAGGED_INT64_MIN_CUDNN:
        reasons.append(f"ragged (THD) inputs need cuDNN >= 9.6 (have {_ver(platform.cudnn)})")
    if p.sink_token is not None:
        if platform.cudnn < SINK_MIN_CUDNN:
            reasons.append(f"attention sinks need cuDNN >= 9.13 (have {_ver(platform.cudnn)})")
        if p.is_forward and p.s_q == 1 and not folded_sink.applies(p):
            # cuDNN 9.19: "decode only mode ... not supported with sink_token"; dense and paged
            # decode add the sink after the run (folded_sink.py), a packed query cannot.
            reasons.append(
                "sink_token with S_q = 1 and a packed (THD) or offset query: cuDNN's decode kernels take no sink"
            )
        if not p.is_forward and p.grad_sink is not None and p.has_dropout and not folded_sink.applies(p):
            # Measured on an H100 with cuDNN 9.19: dSink comes back scaled by (1 - dropout_p), exactly
            # (dQ, dK, dV right); the gradient is -P_sink * rowsum(dO * O), dropout already inside O.
            reasons.append(
                "dSink_token with dropout: cuDNN 9.19 returns dSink scaled by (1 - dropout) (measured "
                "on an H100); refused"
            )
        if (
            not p.is_forward
            and (p.is_thd or p.offset_tensors)
            and not folded_sink.applies(p)
            and platform.cudnn < RAGGED_SINK_BACKWARD_MIN_CUDNN
        ):
            reasons.append(
                f"sink_token in a ragged (THD) backward needs cuDNN >= 9.26 (have {_ver(platform.cudnn)}; "
                "older versions read out of bounds, the frontend says)"
            )
    if p.score_mod is not None:
        reasons += _score_mod_reasons(p, platform)
    if not p.is_forward and p.s_q == 1 and p.s_kv == 1:
        # cuDNN release notes, known issue: "bprop is not supported when both key/value have sequence length of 1".
        reasons.append("sdpa_backward with S_q = S_kv = 1: refused (cuDNN does not support this backward shape)")
    scale = p.options.attn_scale
    if isinstance(scale, (int, float)) and scale <= 0:
        # Seen on an H100 with cuDNN 9.19 (GPU fuzz campaign): NaN in O and dQ for any scale below 0,
        # and for 0 at most lengths.
        reasons.append(
            f"attn_scale={scale:g}: cuDNN's kernels give NaN for a scale <= 0; pass -q with scale={-scale:g} "
            "(the same scores), or backend='reference'"
        )
    if p.is_paged and p.page_size and p.page_size & (p.page_size - 1):
        reasons.append(f"page_size={p.page_size}: cuDNN's paged K/V load takes power-of-two page sizes")
    if p.s_q == 1 and p.options.causal is not Causal.NONE and p.h_k != p.h_q and platform.cudnn < DECODE_GQA_FIXED:
        # cuDNN release notes, known issue: decode with causal masking and H_q != H_kv gives wrong results.
        reasons.append(
            "S_q = 1 (decode) with a causal mask and GQA/MQA: refused (known wrong results in cuDNN); "
            "drop the causal mask, a single query row already sees only the cache"
        )
    if not p.is_forward and p.bias is not None and p.bias.shape[2] == 1 and p.s_q > 1:
        # Seen on an H200 with cuDNN 9.19: dQ off by ~90% when the bias broadcasts over S_q.
        reasons.append(
            "sdpa_backward with attn_bias broadcast over S_q (shape [.., .., 1, S_kv]): refused (wrong dQ from cuDNN); "
            "pass bias.expand(-1, -1, S_q, -1).contiguous()"
        )
    reasons += _stride_reasons(p)
    return tuple(reasons)


def _mask_reasons(p: AttentionProblem) -> list[str]:
    """Masks cuDNN's attention does not combine (the frontend's support surface refuses them too)."""
    reasons = []
    if p.options.alibi and p.options.causal is not Causal.TOP_LEFT:
        reasons.append(
            f"use_alibi_mask without top-left causal (given causal={p.options.causal.value}): cuDNN applies "
            "ALiBi only with diagonal_band_right_bound=0 on the top-left diagonal"
        )
    # The frontend counts any right bound on the bottom-right diagonal as its bottom-right causal mask.
    right_bound = p.options.causal is not Causal.NONE or p.options.right_bound is not None
    if right_bound and p.options.aligned_bottom_right:
        for flag, name in (
            (p.bias is not None, "attn_bias"),
            (p.options.alibi, "use_alibi_mask"),
            (p.has_dropout, "dropout"),
        ):
            if flag:
                reasons.append(
                    f"use_causal_mask_bottom_right with {name}: cuDNN's bottom-right causal mask (a right "
                    "bound on the bottom-right diagonal) takes no bias, ALiBi or dropout"
                )
    return reasons


def _fp8_reasons(p: AttentionProblem, platform: Platform) -> list[str]:
    """Why cuDNN cannot run this FP8 problem (``sdpa_fp8`` / ``sdpa_fp8_backward``) on ``platform``."""
    reasons = []
    op = "sdpa_fp8" if p.is_forward else "sdpa_fp8_backward"
    if platform.arch < FP8_MIN_ARCH:
        reasons.append(
            f"{op} on compute capability {platform.arch[0]}.{platform.arch[1]}: cuDNN's FP8 attention needs Hopper "
            "(sm90) or newer; use sdpa/sdpa_backward with fp16 or bf16 tensors here"
        )
    elif platform.arch[0] == 12:
        # TransformerEngine get_attention_backend: "FP8 is not supported for compute capability = sm120".
        reasons.append(f"{op} on sm{platform.sm}: refused (FP8 attention is not supported on sm12x); use fp16 or bf16")
    if platform.cudnn < FP8_MIN_CUDNN:
        reasons.append(f"{op} needs cuDNN >= {_ver(FP8_MIN_CUDNN)} (have {_ver(platform.cudnn)})")
    elif platform.cudnn in FP8_BAD_CUDNN:
        reasons.append(f"{op} on cuDNN 9.10.0: refused (known bugs in its FP8 attention); use 9.10.2 or newer")
    hopper = platform.arch < (10, 0)
    d_qk, d_v = p.d_qk, p.d_v
    qk_limit = FP8_MAX_HEAD_DIM_QK_FORWARD if p.is_forward else FP8_MAX_HEAD_DIM
    if d_v > FP8_MAX_HEAD_DIM or d_qk > qk_limit:
        # cudnn-frontend issue #981: sdpa_fp8 at d = 256 returned wrong output instead of declining.
        reasons.append(
            f"{op} with head_dim={d_qk}/{d_v}: refused above {qk_limit}/{FP8_MAX_HEAD_DIM} (FP8 attention gave wrong "
            "results at 256; larger dims are unverified); use fp16 or bf16 attention for larger heads"
        )
    elif not p.is_forward and hopper and (d_qk, d_v) != (128, 128):
        reasons.append(
            f"sdpa_fp8_backward on Hopper with head_dim={d_qk}/{d_v}: needs exactly 128 for both Q/K and V; "
            "use sdpa_backward with fp16 or bf16 tensors"
        )
    elif d_qk % 16 or d_v % 16:
        reasons.append(f"{op} with head_dim={d_qk}/{d_v}: FP8 head dims must be multiples of 16")
    if p.is_thd or p.offset_tensors:
        # sdpa_fp8_backward: "with THD is not supported on Hopper"; TransformerEngine runs FP8 on BSHD/SBHD only.
        reasons.append(f"{op} with THD (ragged) tensors: not supported for FP8; pad to [B, H, S, D] with seq_len_q/kv")
    if p.is_paged:
        # TransformerEngine get_attention_backend: "Disabling FusedAttention for FP8 KV caching".
        reasons.append(f"{op} with paged K/V caches: not supported for FP8; gather the pages into a dense K/V")
    if p.bias is not None:
        # Frontend sdpa_support_surface.h: "SDPA FP8 does not support bias" (sdpa_fp8_backward takes none).
        reasons.append(f"{op} with attn_bias: cuDNN's FP8 attention takes no bias; use fp16 or bf16 attention")
    if p.options.alibi:
        # sdpa_fp8_backward has no use_alibi_mask; TransformerEngine's FP8 backend requires no bias (ALiBi is one).
        reasons.append(
            f"{op} with use_alibi_mask: not supported for FP8 (sdpa_fp8_backward has no ALiBi); "
            "use fp16 or bf16 attention"
        )
    if p.options.aligned_bottom_right and hopper:
        # Frontend sdpa_support_surface.h and sdpa_fp8_bwd.h: FP8 bottom-right causal needs Blackwell.
        reasons.append(
            f"{op} with a bottom-right causal mask on sm{platform.sm}: FP8 bottom-right masks need Blackwell "
            "(sm100) or newer; use use_causal_mask (top-left) or fp16/bf16 attention"
        )
    if p.options.sliding_window is not None and p.options.padding and hopper:
        # cudnn-frontend issue #1009 / PR #1069: the sm90 FP8 forward kernel never finishes when a query
        # tile sees no key, as a padding mask with a left bound allows.
        reasons.append(
            f"{op} with a sliding window and a padding mask on sm{platform.sm}: refused (the Hopper FP8 kernel "
            "can hang); drop one of the two or use fp16/bf16 attention"
        )
    elif p.options.padding and p.is_forward and hopper and not (p.is_thd or p.is_paged):  # those: refused above
        # cudnn-frontend issue #1009: the sm90 FP8 forward can hang when a sequence has seq_len_kv = 0
        # and seq_len_q > 0. Lengths are run-time values (on the device, never read on the host), so
        # no plan-time check can keep a zero out: padding masks are refused with FP8 there.
        reasons.append(
            f"{op} with a padding mask (seq_len_q/seq_len_kv) on sm{platform.sm}: refused (the Hopper FP8 kernel "
            "can hang on a sequence with no keys); pad to full lengths or use fp16/bf16 attention"
        )
    if not p.is_forward and p.has_dropout and not hopper:
        # sdpa_fp8_bwd.h: Blackwell routes the FP8 backward (d <= 128) to its deterministic kernel,
        # which has no dropout.
        reasons.append(f"sdpa_fp8_backward with dropout on sm{platform.sm}: not supported by the FP8 backward there")
    outputs = ("o",) if p.is_forward else ("grad_q", "grad_k", "grad_v")
    for role in outputs:
        spec = getattr(p, role)
        if spec is not None and spec.dtype in (torch.float16, torch.bfloat16):
            if hopper or platform.cudnn < FP8_HALF_OUTPUT_MIN_CUDNN:
                reasons.append(
                    f"{op} with {user_name(role)} in {str(spec.dtype).removeprefix('torch.')}: fp16/bf16 outputs "
                    "from FP8 attention need Blackwell (sm100) and cuDNN >= 9.13; write it in fp8"
                )
            break
    return reasons


# float32 I/O runs on cuDNN's composite implementation. Measured on an H100 (sm90) with cuDNN 9.19
# against the reference backend: the forward is exact (rel. error < 2e-6) for every mask, bias,
# padding, GQA, THD and paged case tried, with d_qk up to 256; these are what it lacks or gets wrong.
FLOAT32_MAX_HEAD_DIM_V = 128  # d_v of 160-256 gave O off by 1.1-3.6x, or unwritten (1e19)


def _float32_reasons(p: AttentionProblem, platform: Platform) -> list[str]:
    reasons = []
    seen = f"cuDNN {_ver(platform.cudnn)}'s float32 path was seen giving wrong O"
    if not p.is_forward:
        reasons.append("sdpa_backward in float32: cuDNN proposes no float32 backward engine; train in bf16/fp16")
    if p.has_dropout:
        reasons.append("dropout in float32: cuDNN builds no float32 plan with dropout")
    if p.d_v > FLOAT32_MAX_HEAD_DIM_V:
        reasons.append(f"head_dim d_v={p.d_v} in float32: refused above {FLOAT32_MAX_HEAD_DIM_V} ({seen})")
    if p.s_q == 1 and p.h_k != p.h_q and not p.is_paged:
        reasons.append(
            f"S_q = 1 (decode) with GQA/MQA in float32: refused ({seen}; S_q >= 2 and paged caches are right)"
        )
    return reasons


def _reference_only_reasons(p: AttentionProblem) -> list[str]:
    """Well formed, run by the reference backend, refused by cuDNN (its graphs take none of them)."""
    reasons = []
    if p.q.dtype == torch.float64:
        reasons.append("dtype=float64: cuDNN attention has no double-precision path")
    if p.d_qk % validation.HEAD_DIM_MULTIPLE or p.d_v % validation.HEAD_DIM_MULTIPLE:
        multiple = validation.HEAD_DIM_MULTIPLE
        reasons.append(f"head dims d_qk={p.d_qk}, d_v={p.d_v}: cuDNN takes multiples of {multiple}")
    if any(n == 0 for spec in p.tensor_specs().values() for n in spec.shape):
        reasons.append("an empty batch or sequence (B, S_q or S_kv = 0): cuDNN's graphs take no empty dimension")
    if p.options.sliding_window is not None and p.s_q > p.s_kv and not p.options.padding:
        reasons.append(
            f"sliding_window_length: S_q={p.s_q} > S_kv={p.s_kv}; cuDNN's sliding windows need S_q <= S_kv "
            "(or a padding mask with per-batch lengths)"
        )
    return reasons


def _head_dim_reasons(p: AttentionProblem, platform: Platform) -> list[str]:
    d = max(p.d_qk, p.d_v)
    if platform.arch >= (9, 0) and p.is_forward:
        # Past 256 cuDNN's own forward engines serve larger heads (d = 264..520 checked against the
        # reference on an H100, cuDNN 9.19); where they do not, planning says why (UnsupportedError).
        return []
    if platform.arch >= (10, 0):
        return []  # the frontend's own backward engines for large heads run on sm100-103; planning decides
    if platform.arch >= (9, 0):
        limit, where = 256, "Hopper backward (cuDNN's engines and the frontend's decline larger heads)"
    elif not p.is_forward:
        limit, where = 128, "backward on Ampere/Ada"
    elif p.s_q == 1:
        limit, where = 128, "decode (S_q = 1) on Ampere/Ada"
    else:
        limit, where = 256, "Ampere/Ada"
    if d > limit:
        return [f"head_dim={d} > {limit}: the limit for {where}"]
    return []


def _stride_reasons(p: AttentionProblem) -> list[str]:
    reasons = []
    for role in ("q", "k", "v", "o", "grad_o", "grad_q", "grad_k", "grad_v"):
        spec = getattr(p, role)
        if spec is None:
            continue
        if any(stride == 0 and size > 1 for stride, size in zip(spec.stride, spec.shape)):
            # A broadcast (expanded) view: cuDNN's kernels reject zero strides on real dimensions.
            reasons.append(
                f"{role}: zero stride on a dimension of size > 1 (an expanded view); pass a materialised tensor"
            )
    return reasons


def _score_mod_reasons(p: AttentionProblem, platform: Platform) -> list[str]:
    """What cuDNN refuses beside a score modifier: it then applies no mask of its own (the frontend:
    "Attention score mod enabled and hence other subgraphs are disabled")."""
    reasons = []
    if platform.cudnn < SCORE_MOD_MIN_CUDNN:
        reasons.append(f"score modifiers need cuDNN >= 9.6 (have {_ver(platform.cudnn)})")
    for i, spec in enumerate(p.score_mod.inputs if p.score_mod is not None else ()):
        if spec.rank == 4 and spec.shape[0] > 1:
            # Measured on an H100 with cuDNN 9.19, through the bare frontend too: scores multiplied by a
            # [B, 1, 1, 1] or [B, H, 1, 1] tensor come out wrong (rel err 0.96-0.98); [1, H, 1, 1], and
            # per-row and per-column tensors [1, 1, S, 1] / [1, 1, 1, S], are read right.
            reasons.append(
                f"score_mod input {i}: shape {list(spec.shape)}; cuDNN 9.19 misreads score_mod tensors "
                "that vary by batch; pass a dense attn_mask beside the modifier instead"
            )
    if p.is_fp8:
        # Measured on an H100 with cuDNN 9.19: sdpa_fp8 with a soft-capping fn builds and runs, but O
        # comes out wrong (rel err 12.5 against the emulation, values saturated). Not measured elsewhere.
        reasons.append(
            "fn (a score modifier) on FP8 attention: cuDNN 9.19 returns wrong results (measured on an "
            "H100: rel err 12 for soft-capping); refused. Use sdpa with score_mod on fp16/bf16 tensors"
        )
    o = p.options
    if o.padding and not (p.score_mod is not None and p.score_mod.keys_in_bounds):
        # Measured on an H100 with cuDNN 9.19: beside a score modifier the sequence lengths bound no
        # key (dense BHSD with seq_len_kv and packed THD alike: O off by 45-64%); the query rows are
        # still bounded. A top-left causal mask inside the modifier over equal lengths needs no bound.
        reasons.append(
            "score_mod with sequence lengths (padding, packed sequences): cuDNN 9.19 applies no padding "
            "mask beside a score modifier, so keys past a sequence's length would be attended (measured "
            "on an H100); refused. A dense boolean attn_mask beside the modifier is applied "
            "(cudnn_attn.sdpa(softcap=, attn_mask=)), and the reference backend runs it"
        )
    if o.has_band or o.alibi:
        reasons.append(
            "score_mod with a causal mask, band or ALiBi: cuDNN applies no mask of its own beside a score "
            "modifier; write the mask inside score_mod (gen_index, cmp_ge, binary_select)"
        )
    return reasons
