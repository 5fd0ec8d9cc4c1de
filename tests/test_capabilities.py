"""cuDNN's capability rules, on synthetic GPUs and versions (no GPU needed)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cudnn_attn.core.mask import Causal, ScoreOptions
from cudnn_attn.core.problem import AttentionProblem, KVCacheLayout, Op, TensorSpec
from cudnn_attn.core.softcap import softcap_modifier
from cudnn_attn.ops.cudnn.capabilities import Platform, unsupported_reasons

H200 = Platform("NVIDIA H200", (9, 0), 91900, "1.32.0")
A100 = Platform("NVIDIA A100", (8, 0), 91900, "1.32.0")


def spec(*shape, dtype=torch.bfloat16):
    return TensorSpec.contiguous(shape, dtype, "cuda:0")


def forward(b=2, h=8, h_kv=8, s_q=128, s_kv=128, d=128, **kw):
    q = spec(b, h, s_q, d)
    kv = spec(b, h_kv, s_kv, d)
    return AttentionProblem(op=Op.FORWARD, q=q, k=kv, v=kv, o=q).replace(attn_scale=0.1, **kw)


def backward(**kw):
    p = forward(**kw)
    return p.replace(
        op=Op.BACKWARD, stats=spec(*p.stats_shape, dtype=torch.float32), grad_o=p.o, grad_q=p.q, grad_k=p.k, grad_v=p.v
    )


def reasons(p, platform=H200):
    return " | ".join(unsupported_reasons(p, platform))


def test_a_plain_problem_is_supported_on_hopper_and_ampere():
    assert unsupported_reasons(forward(), H200) == []
    assert unsupported_reasons(backward(), A100) == []


@pytest.mark.parametrize(
    "problem,platform,fragment",
    [
        (forward(), Platform("T4", (7, 5), 91900, "1.32.0"), "compute capability 7.5"),
        (forward(), Platform("H100", (9, 0), 80900, "1.32.0"), "cuDNN 8.9 < 9.0"),
        (forward(d=256), A100, None),
        (forward(d=256, s_q=1), A100, "head_dim=256 > 128"),
        (backward(d=256), A100, "backward on Ampere/Ada"),
        (backward(d=256), H200, None),
        (forward(d=512), H200, None),  # cuDNN's forward engines serve large heads on Hopper
        (backward(d=264), H200, "head_dim=264 > 256: the limit for Hopper backward"),
        (backward(s_q=1, s_kv=1), H200, "S_q = S_kv = 1"),
        (forward(s_q=1, h_kv=2, causal=Causal.BOTTOM_RIGHT), Platform("H100", (9, 0), 91800, "1.32.0"), "decode"),
        (forward(s_q=1, h_kv=2, causal=Causal.BOTTOM_RIGHT), H200, None),  # right on 9.19
        (forward().replace(attn_scale=-0.5), H200, "attn_scale=-0.5: cuDNN's kernels give NaN"),
        (forward().replace(attn_scale=0.0), H200, "attn_scale=0: cuDNN's kernels give NaN"),
        (
            forward(causal=Causal.BOTTOM_RIGHT),
            Platform("H100", (9, 0), 90200, "1.32.0"),
            "bottom-right causal masks need cuDNN >= 9.3",
        ),
        (
            forward(causal=Causal.TOP_LEFT, sliding_window=8),
            Platform("H100", (9, 0), 90100, "1.32.0"),
            "sliding windows",
        ),
        (backward(bias=spec(2, 1, 1, 128)), H200, "broadcast over S_q"),
        (backward(bias=spec(1, 8, 128, 128)), H200, None),
        (
            forward().replace(q=TensorSpec((2, 8, 128, 128), (0, 16384, 128, 1), torch.bfloat16, "cuda:0")),
            H200,
            "zero stride",
        ),
        (forward().replace(q=spec(2, 8, 128, 128, dtype=torch.float8_e4m3fn)), H200, "fp8"),
        (forward().replace(q=TensorSpec.contiguous((2, 8, 128, 128), torch.bfloat16, "cpu")), H200, "CUDA tensors"),
    ],
    ids=[
        "sm75",
        "cudnn8",
        "ampere-d256-prefill",
        "ampere-d256-decode",
        "ampere-d256-backward",
        "hopper-d256-backward",
        "hopper-d512-forward",
        "hopper-d264-backward",
        "backward-s1",
        "decode-causal-gqa-before-9.19",
        "decode-causal-gqa-9.19",
        "negative-scale",
        "zero-scale",
        "old-bottom-right",
        "old-window",
        "broadcast-bias-backward",
        "full-bias-backward",
        "zero-stride",
        "fp8",
        "cpu",
    ],
)
def test_rules(problem, platform, fragment):
    text = reasons(problem, platform)
    if fragment is None:
        assert text == ""
    else:
        assert fragment in text


def test_paged_needs_cudnn_9_5():
    q = spec(2, 8, 1, 128)
    cache = spec(16, 16, 8, 128)
    p = AttentionProblem(
        op=Op.FORWARD,
        q=q,
        k=cache,
        v=cache,
        o=q,
        options=ScoreOptions(padding=True),
        seq_len_kv=spec(2, dtype=torch.int32),
        page_table_k=spec(2, 8, dtype=torch.int32),
        page_table_v=spec(2, 8, dtype=torch.int32),
        kv_cache_layout=KVCacheLayout.NPHD,
    )
    assert unsupported_reasons(p, H200) == []
    assert "paged K/V caches need cuDNN >= 9.5" in reasons(p, Platform("H100", (9, 0), 90400, "1.32.0"))
    odd = p.replace(k=spec(16, 24, 8, 128), v=spec(16, 24, 8, 128))
    assert "page_size=24: cuDNN's paged K/V load takes power-of-two page sizes" in reasons(odd, H200)


def test_platform_describes_itself():
    assert H200.describe() == "NVIDIA H200 (sm90), cuDNN 9.19.0, frontend 1.32.0"


def test_sequence_lengths_beside_a_score_modifier_are_refused_unless_the_modifier_bounds_the_keys():
    """cuDNN 9.19 drops the padding mask beside a score modifier (measured on an H100: keys past a
    sequence's length attended, O off by 45-64%). A top-left causal modifier over equal lengths
    (packed self-attention) keeps every row's keys inside its sequence and needs no bound."""
    lengths = dict(seq_len_q=spec(2, 1, 1, 1, dtype=torch.int32), seq_len_kv=spec(2, 1, 1, 1, dtype=torch.int32))
    plain = ScoreOptions(attn_scale=0.125, padding=True)
    causal = dataclasses.replace(plain, causal=Causal.TOP_LEFT)
    loose, options = softcap_modifier(20.0, plain, 128, 128)
    assert "applies no padding mask" in reasons(forward(score_mod=loose, padding=True, **lengths))
    bounded, options = softcap_modifier(20.0, causal, 128, 128, same_lengths=True)
    assert bounded.keys_in_bounds and reasons(forward(score_mod=bounded, padding=True, **lengths)) == ""
    unequal, _ = softcap_modifier(20.0, causal, 128, 128, same_lengths=False)
    assert "applies no padding mask" in reasons(forward(score_mod=unequal, padding=True, **lengths))
    assert reasons(forward(score_mod=loose)) == ""  # no lengths: nothing for cuDNN to drop
