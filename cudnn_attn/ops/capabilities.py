"""What cuDNN can run, by GPU architecture and cuDNN version: checked before cuDNN sees a problem.

Each rule is a plain condition with its reason, phrased as the failing condition. Sources:
the cuDNN frontend's attention support matrix and the cuDNN backend release notes (known
issues); rules marked "refused" guard shapes known to fail or to give wrong results.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..data_type import FP8
from ..options import Causal
from ..problem import AttentionProblem


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


def _version(v: int) -> str:
    major, rest = divmod(v, 10000)
    return f"{major}.{rest // 100}"


def unsupported_reasons(p: AttentionProblem, platform: Platform) -> list[str]:
    """Why cuDNN on ``platform`` cannot run ``p``; empty when it can."""
    return list(_reasons(p, platform))


@functools.lru_cache(maxsize=4096)  # pure: a rebuilt graph pays a lookup
def _reasons(p: AttentionProblem, platform: Platform) -> tuple[str, ...]:
    reasons: list[str] = []
    if not p.device.startswith("cuda"):
        return (f"device={p.device}: cuDNN runs on CUDA tensors",)
    if platform.arch < MIN_ARCH:
        reasons.append(
            f"compute capability {platform.arch[0]}.{platform.arch[1]} < 8.0: fused attention needs Ampere or newer"
        )
    if platform.cudnn < MIN_CUDNN:
        reasons.append(f"cuDNN {_version(platform.cudnn)} < 9.0: this library lowers to the cuDNN 9 attention graph")
    if p.q.dtype in FP8:
        reasons.append(f"dtype={p.q.dtype}: fp8 attention (with its descale/scale tensors) is not lowered to cuDNN yet")
    reasons += _head_dim_reasons(p, platform)
    if p.is_paged and platform.cudnn < PAGED_MIN_CUDNN:
        reasons.append(f"paged K/V caches need cuDNN >= 9.5 (have {_version(platform.cudnn)})")
    if p.options.causal is Causal.BOTTOM_RIGHT and platform.cudnn < BOTTOM_RIGHT_MIN_CUDNN:
        reasons.append(f"bottom-right causal masks need cuDNN >= 9.3 (have {_version(platform.cudnn)})")
    if p.options.sliding_window is not None and platform.cudnn < SLIDING_WINDOW_MIN_CUDNN:
        reasons.append(f"sliding windows need cuDNN >= 9.2 (have {_version(platform.cudnn)})")
    if p.is_thd and platform.cudnn < RAGGED_INT64_MIN_CUDNN:
        reasons.append(f"ragged (THD) inputs need cuDNN >= 9.6 (have {_version(platform.cudnn)})")
    if not p.is_forward and p.s_q == 1 and p.s_kv == 1:
        # cuDNN release notes, known issue: "bprop is not supported when both key/value have sequence length of 1".
        reasons.append("sdpa_backward with S_q = S_kv = 1: refused (cuDNN does not support this backward shape)")
    if p.s_q == 1 and p.options.causal is not Causal.NONE and p.h_k != p.h_q:
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


def _head_dim_reasons(p: AttentionProblem, platform: Platform) -> list[str]:
    d = max(p.d_qk, p.d_v)
    if platform.arch >= (9, 0):
        limit, where = 256, "Hopper and newer"
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
