"""The features ``cudnn-attn info`` asks about: one small, well-formed problem each.

The answer for each is the backend's own (``not_supported_reasons``: the capability rules of
``ops/cudnn/capabilities.py`` on a GPU, the reference backend's on a CPU), never a fixed string.

Example::

    from cudnn_attn.cli.features import sample_problems
    from cudnn_attn.ops import get_backend
    for name, problem in sample_problems("cpu").items():
        print(name, get_backend("reference").not_supported_reasons(problem) or "yes")
"""

from __future__ import annotations

import torch

from ..core.mask import Causal, ScoreOptions
from ..core.problem import AttentionProblem, KVCacheLayout, Op, TensorSpec
from ..core.roles import FP8_AMAXES, FP8_BACKWARD_AMAXES, FP8_BACKWARD_SCALES, FP8_SCALES
from ..core.score_mod import softcap

E4M3 = torch.float8_e4m3fn


def sample_problems(device: str) -> dict[str, AttentionProblem]:
    """One small problem per feature, to ask a backend what it supports on ``device``."""

    def spec(*shape: int, dtype: torch.dtype = torch.bfloat16) -> TensorSpec:
        return TensorSpec.contiguous(shape, dtype, device)

    def dense(dtype: torch.dtype, d: int = 128, d_v: int | None = None) -> dict[str, TensorSpec]:
        qk = spec(2, 8, 128, d, dtype=dtype)
        value = spec(2, 8, 128, d_v or d, dtype=dtype)
        return {"q": qk, "k": qk, "v": value, "o": value}

    def scalars(roles: tuple[str, ...]) -> dict[str, TensorSpec]:
        return {role: spec(1, 1, 1, 1, dtype=torch.float32) for role in roles}

    q = spec(2, 8, 128, 128)
    base = AttentionProblem(op=Op.FORWARD, q=q, k=q, v=q, o=q, options=ScoreOptions(attn_scale=128**-0.5))
    lengths = spec(2, dtype=torch.int32)
    stats = spec(2, 8, 128, 1, dtype=torch.float32)
    cache = spec(16, 16, 8, 128)
    table = spec(2, 8, dtype=torch.int32)
    q_thd = spec(256, 8, 128)
    fp8 = base.replace(**dense(E4M3), stats=stats, **scalars(FP8_SCALES + FP8_AMAXES))
    backward = base.replace(op=Op.BACKWARD, stats=stats, grad_o=q, grad_q=q, grad_k=q, grad_v=q)
    return {
        "forward fp16": base.replace(**dense(torch.float16)),
        "forward bf16": base,
        "forward fp32": base.replace(**dense(torch.float32)),
        "causal": base.replace(causal=Causal.TOP_LEFT),
        "causal bottom-right": base.replace(causal=Causal.BOTTOM_RIGHT),
        "sliding window": base.replace(causal=Causal.TOP_LEFT, sliding_window=64),
        "GQA": base.replace(k=spec(2, 2, 128, 128), v=spec(2, 2, 128, 128)),
        "bias": base.replace(bias=spec(1, 8, 128, 128)),
        "ALiBi": base.replace(causal=Causal.TOP_LEFT, alibi=True),
        "padding": base.replace(padding=True, seq_len_q=lengths, seq_len_kv=lengths),
        "THD (ragged, varlen)": base.replace(
            q=q_thd,
            k=q_thd,
            v=q_thd,
            o=q_thd,
            padding=True,
            seq_len_q=lengths,
            seq_len_kv=lengths,
            max_seq_len_q=128,
            max_seq_len_kv=128,
        ),
        "dropout": base.replace(dropout_p=0.1, stats=stats),
        "head dim 256": base.replace(**dense(torch.bfloat16, 256)),
        "head dims 192/128 (MLA training)": base.replace(**dense(torch.bfloat16, 192, 128)),
        "attention sinks": base.replace(sink_token=spec(1, 8, 1, 1, dtype=torch.float32)),
        "softcap (score modifier)": base.replace(score_mod=softcap(30.0)),
        "paged KV cache": base.replace(
            q=spec(2, 8, 1, 128),
            o=spec(2, 8, 1, 128),
            k=cache,
            v=cache,
            padding=True,
            seq_len_kv=lengths,
            page_table_k=table,
            page_table_v=table,
            kv_cache_layout=KVCacheLayout.NPHD,
        ),
        "backward": backward,
        "FP8 forward": fp8,
        "FP8 backward": fp8.replace(
            op=Op.BACKWARD,
            scale_o=None,
            amax_s=None,
            amax_o=None,
            grad_o=fp8.o,
            grad_q=fp8.q,
            grad_k=fp8.k,
            grad_v=fp8.v,
            **scalars(FP8_BACKWARD_SCALES + FP8_BACKWARD_AMAXES),
        ),
    }


def distributed_reasons() -> list[str]:
    """Why context parallelism (``cudnn_attn.distributed``) cannot run here; empty when it can."""
    import torch.distributed as dist

    return [] if dist.is_available() else ["torch was built without torch.distributed"]
