"""FP8 attention on cuDNN, checked on the host: ``sdpa_fp8`` / ``sdpa_fp8_backward`` graphs
lowered from problems built directly and validated by the frontend (no GPU), every bound
tensor under its role's uid; and the capability rules that keep unsupported FP8 problems
away from cuDNN."""

from __future__ import annotations

import pytest
import torch

import cudnn_attn
from cudnn_attn.core.mask import Causal
from cudnn_attn.core.problem import AttentionProblem, KVCacheLayout, Op, TensorSpec
from cudnn_attn.core.roles import FP8_AMAXES, FP8_BACKWARD_AMAXES, FP8_BACKWARD_SCALES, FP8_SCALES, UID
from cudnn_attn.ops.cudnn import lowering
from cudnn_attn.ops.cudnn.capabilities import Platform, unsupported_reasons

cudnn = pytest.importorskip("cudnn")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
H100 = Platform("NVIDIA H100", (9, 0), 91900, "1.32.0")
B200 = Platform("NVIDIA B200", (10, 0), 91900, "1.32.0")


def spec(*shape, dtype=E4M3):
    return TensorSpec.contiguous(shape, dtype, "cuda:0")


def scalars(roles):
    return {role: spec(1, 1, 1, 1, dtype=torch.float32) for role in roles}


def forward(b=2, h=8, h_kv=8, s_q=128, s_kv=128, d=128, d_v=None, dtype=E4M3, stats=True, amax_s=True, **kw):
    d_v = d if d_v is None else d_v
    q, k = spec(b, h, s_q, d, dtype=dtype), spec(b, h_kv, s_kv, d, dtype=dtype)
    v = spec(b, h_kv, s_kv, d_v, dtype=dtype)
    amaxes = scalars(FP8_AMAXES if amax_s else ("amax_o",))
    p = AttentionProblem(
        op=Op.FORWARD,
        q=q,
        k=k,
        v=v,
        o=spec(b, h, s_q, d_v, dtype=dtype),
        stats=spec(b, h, s_q, 1, dtype=torch.float32) if stats else None,
        **scalars(FP8_SCALES),
        **amaxes,
    )
    return p.replace(attn_scale=0.125, **kw)


def backward(**kw):
    p = forward(**kw)
    return p.replace(
        op=Op.BACKWARD,
        scale_o=None,
        amax_s=None,
        amax_o=None,
        grad_o=p.o,
        grad_q=p.q,
        grad_k=p.k,
        grad_v=p.v,
        stats=spec(*p.stats_shape, dtype=torch.float32),
        **scalars(FP8_BACKWARD_SCALES),
        **scalars(FP8_BACKWARD_AMAXES),
    )


def padded(p, b=2):
    lengths = spec(b, dtype=torch.int32)
    return p.replace(seq_len_q=lengths, seq_len_kv=lengths, padding=True)


def lowered(problem):
    result = lowering.lower(problem)
    result.graph.validate()  # the frontend's own checks of the lowered graph
    return result, result.graph.inspect()


def node(info):
    (only,) = info["nodes"]
    return only


def bound(info):
    """The graph's non-virtual tensors (what a run binds) by uid."""
    return {t["uid"]: t for t in info["tensors"].values() if not t["is_virtual"]}


def expected_uids(p):
    return {UID[role] for role in p.tensor_specs()}


FORWARD_CASES = {
    "plain": forward(),
    "no-stats": forward(stats=False),
    "no-amax-s": forward(amax_s=False),
    "causal": forward(causal=Causal.TOP_LEFT),
    "bottom-right-padding": padded(forward(s_q=64, causal=Causal.BOTTOM_RIGHT)),
    "gqa": forward(h=8, h_kv=2),
    "e5m2-d64": forward(d=64, dtype=E5M2),
    "window": forward(causal=Causal.TOP_LEFT, sliding_window=32),
    "dropout": forward(
        dropout_p=0.1, dropout_seed=spec(1, dtype=torch.int64), dropout_offset=spec(1, dtype=torch.int64)
    ),
}


@pytest.mark.parametrize("problem", FORWARD_CASES.values(), ids=FORWARD_CASES.keys())
def test_forward_lowers_to_sdpa_fp8(problem):
    _, info = lowered(problem)
    n = node(info)
    assert n["type"] == "SDPA_FP8" and n["params"]["attn_scale"] == pytest.approx(0.125)
    assert bool(n["params"].get("generate_stats")) == (problem.stats is not None)
    tensors = bound(info)
    assert set(tensors) == expected_uids(problem)
    for role, spec_ in problem.tensor_specs().items():
        t = tensors[UID[role]]
        assert t["dim"] == list(spec_.shape) or role.startswith(("seq_len", "dropout")), role
        assert t["dtype"] == f"data_type.{lowering.cudnn_dtype(spec_.dtype).name}", role
    for role in FP8_SCALES:  # in the frontend's slot of that name
        assert n["inputs"][role] == role
    assert n["outputs"]["Amax_O"] and tensors[UID["amax_o"]]["dim"] == [1, 1, 1, 1]
    if problem.amax_s is None:
        virtual = info["tensors"][n["outputs"]["Amax_S"]]
        assert virtual["is_virtual"] and virtual["uid"] not in expected_uids(problem)


@pytest.mark.parametrize("stats", [True, False], ids=["stats", "no-stats"])
def test_a_forward_sink_lowers_to_a_sinkless_graph_with_its_stats(stats):
    """cuDNN 9.19 compiles no FP8 forward kernel with a sink on Hopper: the plan runs without it,
    with the log-sum-exp (asked for or not), and folds it in after (ops/cudnn/folded_sink.py)."""
    p = forward(causal=Causal.TOP_LEFT, stats=stats, sink_token=spec(1, 8, 1, 1, dtype=torch.float32))
    tensors = bound(lowered(p)[1])
    assert UID["sink_token"] not in tensors and tensors[UID["stats"]]["dim"] == [2, 8, 128, 1]
    assert set(tensors) == expected_uids(p) - {UID["sink_token"]} | {UID["stats"]}


def test_a_backward_sink_lowers_to_a_sinkless_graph():
    """cuDNN 9.19's FP8 backward with a sink faults on Hopper: the sink-less graph, given the stats
    that hold the sink, makes dQ, dK, dV; the plan makes dSink from O, dO and the stats."""
    sink = spec(1, 8, 1, 1, dtype=torch.float32)
    p = backward(causal=Causal.TOP_LEFT, sink_token=sink, grad_sink=sink)
    tensors = bound(lowered(p)[1])
    assert set(tensors) == expected_uids(p) - {UID["sink_token"], UID["grad_sink"]}


def test_forward_masks_use_the_fp8_spelling():
    n = node(lowered(padded(forward(causal=Causal.BOTTOM_RIGHT)))[1])
    params = n["params"]
    assert params["right_bound"] == 0 and "diagonal_band_right_bound" not in params
    assert params["diagonal_alignment"].name == "BOTTOM_RIGHT" and params["use_padding_mask"] is True
    assert n["inputs"]["seq_len_q"] == "seq_len_q" and n["inputs"]["seq_len_kv"] == "seq_len_kv"
    window = node(lowered(forward(causal=Causal.TOP_LEFT, sliding_window=32))[1])["params"]
    assert window["left_bound"] == 32 and window["right_bound"] == 0 and window["diagonal_alignment"].name == "TOP_LEFT"


def test_gqa_keeps_kv_heads_and_output_dtype():
    p = forward(h=8, h_kv=2).replace(o=spec(2, 8, 128, 128, dtype=E5M2))
    tensors = bound(lowered(p)[1])
    assert tensors[UID["k"]]["dim"] == [2, 2, 128, 128] and tensors[UID["v"]]["dim"] == [2, 2, 128, 128]
    assert tensors[UID["o"]]["dtype"] == "data_type.FP8_E5M2" and tensors[UID["q"]]["dtype"] == "data_type.FP8_E4M3"


BACKWARD_CASES = {
    "plain": backward(),
    "causal": backward(causal=Causal.TOP_LEFT),
    "bottom-right-padding": padded(backward(causal=Causal.BOTTOM_RIGHT)),
    "gqa": backward(h=8, h_kv=2),
    "deterministic": backward().replace(deterministic=True),
}


@pytest.mark.parametrize("problem", BACKWARD_CASES.values(), ids=BACKWARD_CASES.keys())
def test_backward_lowers_to_sdpa_fp8_backward(problem):
    result, info = lowered(problem)
    n = node(info)
    assert n["type"] == "SDPA_FP8_BWD"
    assert bool(n["params"].get("use_deterministic_algorithm")) == problem.deterministic
    tensors = bound(info)
    assert set(tensors) == expected_uids(problem)
    for role, spec_ in problem.tensor_specs().items():
        t = tensors[UID[role]]
        if not role.startswith("seq_len"):
            assert t["dim"] == list(spec_.shape) and t["stride"] == list(spec_.stride), role
        assert t["dtype"] == f"data_type.{lowering.cudnn_dtype(spec_.dtype).name}", role
    frontend_names = {
        "grad_o": "dO",
        "descale_grad_o": "descale_dO",
        "descale_grad_p": "descale_dP",
        "scale_grad_q": "scale_dQ",
        "scale_grad_k": "scale_dK",
        "scale_grad_v": "scale_dV",
        "scale_grad_p": "scale_dP",
    }
    for role in (*FP8_BACKWARD_SCALES, "grad_o"):
        assert n["inputs"][frontend_names.get(role, role)] == role
    outputs = {"amax_dQ": "amax_grad_q", "amax_dK": "amax_grad_k", "amax_dV": "amax_grad_v", "amax_dP": "amax_grad_p"}
    for port, role in outputs.items():
        assert info["tensors"][n["outputs"][port]]["uid"] == UID[role]
    assert result.constant_lengths == {}


def test_backward_takes_no_full_length_workaround():
    """The fp16/bf16 NaN workaround (full-length padding at S_kv % 128 == 64) is not applied to FP8."""
    p = backward(s_q=128, s_kv=192)
    result, info = lowered(p)
    assert not node(info)["params"].get("use_padding_mask") and result.constant_lengths == {}


def test_bias_and_alibi_are_not_lowered():
    with pytest.raises(ValueError, match="no attn_bias or ALiBi"):
        lowering.lower(forward(bias=spec(1, 8, 128, 128, dtype=torch.float16)))
    with pytest.raises(ValueError, match="no attn_bias or ALiBi"):
        lowering.lower(backward(alibi=True, causal=Causal.TOP_LEFT))


def test_graph_ops_lower_with_every_tensor_bound():
    """Problems recorded by ``g.sdpa_fp8`` / ``g.sdpa_fp8_backward`` lower as those built above."""
    q, kv = torch.randn(2, 8, 128, 128).to(E4M3), torch.randn(2, 2, 128, 128).to(E4M3)
    stats = torch.randn(2, 8, 128, 1)
    with cudnn_attn.Graph(backend="reference") as g:
        g.sdpa_fp8(q, kv, kv, *(torch.ones(1, 1, 1, 1) for _ in FP8_SCALES), generate_stats=True, use_causal_mask=True)
        g.sdpa_fp8_backward(
            q, kv, kv, q, q, stats, *(torch.ones(1, 1, 1, 1) for _ in FP8_BACKWARD_SCALES), use_causal_mask=True
        )
    for problem, kind in zip(g.problems, ("SDPA_FP8", "SDPA_FP8_BWD")):
        assert problem.is_fp8
        _, info = lowered(problem)
        assert node(info)["type"] == kind and set(bound(info)) == expected_uids(problem)


# ---- capabilities ---------------------------------------------------------------------------


def thd_forward():
    q = spec(200, 8, 128)
    lengths = spec(2, dtype=torch.int32)
    return forward().replace(
        q=q,
        k=q,
        v=q,
        o=q,
        stats=None,
        seq_len_q=lengths,
        seq_len_kv=lengths,
        max_seq_len_q=128,
        max_seq_len_kv=128,
        padding=True,
    )


def paged_forward():
    cache = spec(16, 16, 8, 128)
    table = spec(2, 8, dtype=torch.int32)
    p = forward(s_q=1).replace(
        k=cache, v=cache, page_table_k=table, page_table_v=table, kv_cache_layout=KVCacheLayout.NPHD
    )
    return padded(p)


@pytest.mark.parametrize(
    "problem, platform",
    [
        (forward(), H100),
        (backward(), H100),
        (padded(forward(causal=Causal.TOP_LEFT)), B200),
        (forward(h_kv=2, d=64, dtype=E5M2), H100),
        (forward(dropout_p=0.1), H100),
        (backward(dropout_p=0.1), H100),
        (forward(causal=Causal.TOP_LEFT, sliding_window=64), H100),
        (forward(d=64), B200),
        (backward(d=64), B200),
        (padded(forward(causal=Causal.BOTTOM_RIGHT)), B200),
        (forward(), Platform("H100", (9, 0), 90700, "1.32.0")),
        (forward(sink_token=spec(1, 8, 1, 1, dtype=torch.float32)), H100),
        (forward(d=192, d_v=128), H100),
        (forward(d=144, d_v=128), H100),
        (forward(s_q=1, sink_token=spec(1, 8, 1, 1, dtype=torch.float32)), H100),
        (
            backward(sink_token=spec(1, 8, 1, 1, dtype=torch.float32), grad_sink=spec(1, 8, 1, 1, dtype=torch.float32)),
            H100,
        ),
    ],
    ids=[
        "forward",
        "backward",
        "padding-causal",
        "gqa-e5m2-d64",
        "dropout",
        "backward-dropout",
        "window",
        "blackwell-d64",
        "blackwell-backward-d64",
        "blackwell-bottom-right",
        "cudnn-9.7",
        "sink",
        "deepseek-192-128",
        "d144-128",
        "decode-sink",
        "backward-sink",
    ],
)
def test_supported_fp8_problems_have_no_reasons(problem, platform):
    assert unsupported_reasons(problem, platform) == []


@pytest.mark.parametrize(
    "problem, platform, expected",
    [
        (
            forward(d=256),
            H100,
            "sdpa_fp8 with head_dim=256/256: refused above 192/128 (FP8 attention gave wrong results at 256; larger "
            "dims are unverified); use fp16 or bf16 attention for larger heads",
        ),
        (
            forward(d=192, d_v=192),
            H100,
            "sdpa_fp8 with head_dim=192/192: refused above 192/128 (FP8 attention gave wrong results at 256; larger "
            "dims are unverified); use fp16 or bf16 attention for larger heads",
        ),
        (
            backward(d=256),
            B200,
            "sdpa_fp8_backward with head_dim=256/256: refused above 128/128 (FP8 attention gave wrong results at 256; "
            "larger dims are unverified); use fp16 or bf16 attention for larger heads",
        ),
        (
            thd_forward(),
            H100,
            "sdpa_fp8 with THD (ragged) tensors: not supported for FP8; pad to [B, H, S, D] with seq_len_q/kv",
        ),
        (
            paged_forward(),
            H100,
            "sdpa_fp8 with paged K/V caches: not supported for FP8; gather the pages into a dense K/V",
        ),
        (
            forward(bias=spec(1, 8, 128, 128, dtype=torch.float16)),
            H100,
            "sdpa_fp8 with attn_bias: cuDNN's FP8 attention takes no bias; use fp16 or bf16 attention",
        ),
        (
            backward(alibi=True, causal=Causal.TOP_LEFT),
            H100,
            "sdpa_fp8_backward with use_alibi_mask: not supported for FP8 (sdpa_fp8_backward has no ALiBi); "
            "use fp16 or bf16 attention",
        ),
        (
            forward(),
            Platform("NVIDIA A100", (8, 0), 91900, "1.32.0"),
            "sdpa_fp8 on compute capability 8.0: cuDNN's FP8 attention needs Hopper (sm90) or newer; "
            "use sdpa/sdpa_backward with fp16 or bf16 tensors here",
        ),
        (
            backward(),
            Platform("NVIDIA L40S", (8, 9), 91900, "1.32.0"),
            "sdpa_fp8_backward on compute capability 8.9: cuDNN's FP8 attention needs Hopper (sm90) or newer; "
            "use sdpa/sdpa_backward with fp16 or bf16 tensors here",
        ),
        (
            forward(),
            Platform("NVIDIA RTX PRO 6000", (12, 0), 91900, "1.32.0"),
            "sdpa_fp8 on sm120: refused (FP8 attention is not supported on sm12x); use fp16 or bf16",
        ),
        (forward(), Platform("H100", (9, 0), 90600, "1.32.0"), "sdpa_fp8 needs cuDNN >= 9.7 (have 9.6)"),
        (
            backward(),
            Platform("H100", (9, 0), 91000, "1.32.0"),
            "sdpa_fp8_backward on cuDNN 9.10.0: refused (known bugs in its FP8 attention); use 9.10.2 or newer",
        ),
        (
            backward(d=64),
            H100,
            "sdpa_fp8_backward on Hopper with head_dim=64/64: needs exactly 128 for both Q/K and V; "
            "use sdpa_backward with fp16 or bf16 tensors",
        ),
        (forward(d=72), H100, "sdpa_fp8 with head_dim=72/72: FP8 head dims must be multiples of 16"),
        (
            forward(causal=Causal.BOTTOM_RIGHT),
            H100,
            "sdpa_fp8 with a bottom-right causal mask on sm90: FP8 bottom-right masks need Blackwell (sm100) or newer; "
            "use use_causal_mask (top-left) or fp16/bf16 attention",
        ),
        (
            padded(forward(causal=Causal.TOP_LEFT, sliding_window=64)),
            H100,
            "sdpa_fp8 with a sliding window and a padding mask on sm90: refused (the Hopper FP8 kernel can hang); "
            "drop one of the two or use fp16/bf16 attention",
        ),
        (
            padded(forward(causal=Causal.TOP_LEFT)),
            H100,
            "sdpa_fp8 with a padding mask (seq_len_q/seq_len_kv) on sm90: refused (the Hopper FP8 kernel can hang on a "
            "sequence with no keys); pad to full lengths or use fp16/bf16 attention",
        ),
        (
            backward(d=64, dropout_p=0.1),
            B200,
            "sdpa_fp8_backward with dropout on sm100: not supported by the FP8 backward there",
        ),
        (
            forward().replace(o=spec(2, 8, 128, 128, dtype=torch.bfloat16)),
            H100,
            "sdpa_fp8 with o in bfloat16: fp16/bf16 outputs from FP8 attention need Blackwell (sm100) and "
            "cuDNN >= 9.13; write it in fp8",
        ),
    ],
    ids=[
        "d256",
        "d192-v192",
        "backward-d256-blackwell",
        "thd",
        "paged",
        "bias",
        "alibi-backward",
        "sm80",
        "sm89",
        "sm120",
        "cudnn-9.6",
        "cudnn-9.10.0",
        "hopper-backward-d64",
        "d72",
        "bottom-right-hopper",
        "window-padding-hopper",
        "padding-hopper",
        "blackwell-backward-dropout",
        "bf16-output-hopper",
    ],
)
def test_fp8_refusals_name_exactly_one_reason(problem, platform, expected):
    assert unsupported_reasons(problem, platform) == [expected]


def test_half_outputs_pass_on_blackwell_with_cudnn_9_13():
    p = backward(d=64).replace(grad_q=spec(2, 8, 128, 64, dtype=torch.float16))
    assert unsupported_reasons(p, B200) == []
    assert unsupported_reasons(p, Platform("B200", (10, 0), 91200, "1.32.0")) == [
        "sdpa_fp8_backward with dQ in float16: fp16/bf16 outputs from FP8 attention need Blackwell (sm100) and "
        "cuDNN >= 9.13; write it in fp8"
    ]


def test_fp8_data_without_scales_is_refused():
    p = AttentionProblem(
        op=Op.FORWARD, q=spec(2, 8, 128, 128), k=spec(2, 8, 128, 128), v=spec(2, 8, 128, 128), o=spec(2, 8, 128, 128)
    )
    (reason,) = unsupported_reasons(p, H100)
    assert "sdpa_fp8" in reason and "descale" in reason
