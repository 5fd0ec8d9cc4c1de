"""The lowering to cuDNN frontend graphs, checked on the host: the frontend builds and
validates graphs without a GPU, so each problem's tensors and node attributes are visible."""

from __future__ import annotations

import pytest
import torch
from cases import MASK_GRID, Case, keywords, make_inputs

import cudnn_attn
from cudnn_attn.core.roles import ROLES
from cudnn_attn.ops.cudnn import lowering

cudnn = pytest.importorskip("cudnn")


def problem_of(build) -> cudnn_attn.AttentionProblem:
    with cudnn_attn.Graph(backend="reference") as g:
        build(g)
    return g.problems[0]


def lowered(problem, **kw):
    result = lowering.lower(problem, **kw)
    result.graph.validate()  # the frontend's own checks of the lowered graph
    return result, result.graph.inspect()


def node(info):
    (only,) = info["nodes"]
    return only


def by_uid(info):
    return {t["uid"]: t for t in info["tensors"].values()}


@pytest.mark.parametrize("case", MASK_GRID, ids=lambda c: c.id)
def test_every_mask_case_lowers_and_validates(case: Case):
    t = make_inputs(case, "cpu")
    p = problem_of(lambda g: g.sdpa(t["q"], t["k"], t["v"], generate_stats=True, **keywords(case, t)))
    _, info = lowered(p)
    params = node(info)["params"]
    tensors = by_uid(info)
    assert params["attn_scale"] == pytest.approx(p.options.attn_scale)
    assert tensors[lowering.UID["q"]]["dim"] == list(p.q.shape) and tensors[lowering.UID["q"]]["stride"] == list(
        p.q.stride
    )
    assert tensors[lowering.UID["o"]]["stride"] == list(p.o.stride)
    assert tensors[lowering.UID["stats"]]["dtype"] == "data_type.FLOAT"
    options = dict(case.options)
    if options.get("use_causal_mask") or options.get("use_causal_mask_bottom_right"):
        assert params["diagonal_band_right_bound"] == 0
        expected = "BOTTOM_RIGHT" if options.get("use_causal_mask_bottom_right") else "TOP_LEFT"
        assert params["diagonal_alignment"].name == expected
    assert params.get("diagonal_band_left_bound") == options.get("sliding_window_length")
    assert bool(params.get("use_alibi_mask")) == bool(options.get("use_alibi_mask"))
    assert bool(params.get("use_padding_mask")) == bool(case.padding)
    if case.bias:
        assert tensors[lowering.UID["bias"]]["dim"] == list(case.bias)
    if case.padding:
        assert tensors[lowering.UID["seq_len_kv"]]["dim"] == [case.b, 1, 1, 1]


def test_backward_lowers_with_dbias_and_determinism():
    q = torch.randn(2, 4, 64, 64).half()
    bias = torch.randn(1, 4, 64, 64).half()
    stats = torch.randn(2, 4, 64, 1)
    p = problem_of(
        lambda g: g.sdpa_backward(
            q, q, q, q, q, stats, attn_bias=bias, bias_grad=True, use_causal_mask=True, use_deterministic_algorithm=True
        )
    )
    _, info = lowered(p)
    n = node(info)
    assert n["type"] == "SDPA_BWD" and n["params"]["use_deterministic_algorithm"] is True
    tensors = by_uid(info)
    for role in ("grad_q", "grad_k", "grad_v", "grad_bias", "stats", "grad_o"):
        assert lowering.UID[role] in tensors, role
    assert tensors[lowering.UID["grad_bias"]]["dim"] == [1, 4, 64, 64]


def test_thd_lowers_to_ragged_bshd():
    q = torch.randn(50, 8, 64).half()
    kv = torch.randn(70, 2, 64).half()
    lq, lkv = torch.tensor([20, 30], dtype=torch.int32), torch.tensor([40, 30], dtype=torch.int32)
    p = problem_of(
        lambda g: g.sdpa(
            q, kv, kv, seq_len_q=lq, seq_len_kv=lkv, max_seq_len_q=32, max_seq_len_kv=40, generate_stats=True
        )
    )
    result, info = lowered(p)
    tensors = by_uid(info)
    assert tensors[lowering.UID["q"]]["dim"] == [2, 8, 32, 64]
    assert tensors[lowering.UID["q"]]["stride"] == [32 * 512, 64, 512, 1]  # [S_max*token, head, token, 1]
    assert tensors[lowering.UID["k"]]["stride"] == [40 * 128, 64, 128, 1]
    ragged = {role: ROLES[role].ragged_uid for role in ("q", "k", "v", "o")}
    for role, uid in ragged.items():
        assert tensors[uid]["dim"] == [3, 1, 1, 1] and tensors[uid]["dtype"] == "data_type.INT64", role
    assert result.ragged[ragged["q"]] == ("seq_len_q", 512) and result.ragged[ragged["k"]] == ("seq_len_kv", 128)
    assert node(info)["params"]["use_padding_mask"] is True


def test_caller_ragged_offsets_lower_onto_the_tensors_they_address():
    """The frontend's THD form: 4-D tensors keep their dims and strides and take the caller's
    offsets (bound as int64 under the role's offset uid); Stats and O may have their own."""
    b, h, s, d = 2, 4, 16, 64
    bshd = (s * h * d, d, h * d, 1)
    q, k, v = (torch.randn(b * s * h * d).half().as_strided((b, h, s, d), bshd) for _ in range(3))
    offsets = torch.tensor([0, 5 * h * d, 12 * h * d], dtype=torch.int32).view(-1, 1, 1, 1)
    lengths = torch.tensor([5, 7], dtype=torch.int32).view(-1, 1, 1, 1)
    with cudnn_attn.pygraph(io_data_type=cudnn_attn.data_type.HALF, backend="reference") as g:
        tq, tk, tv, to = (g.tensor_like(x) for x in (q, k, v, offsets))
        for t in (tq, tk, tv):
            t.set_ragged_offset(to)
        o, stats = g.sdpa(
            q=tq,
            k=tk,
            v=tv,
            generate_stats=True,
            use_padding_mask=True,
            seq_len_q=g.tensor_like(lengths),
            seq_len_kv=g.tensor_like(lengths),
        )
        o.set_output(True).set_dim([b, h, s, d]).set_stride(list(bshd)).set_ragged_offset(to)
        stats.set_output(True).set_ragged_offset(g.tensor_like(offsets // d))  # in Stats' own elements
    p = g.problems[0]
    assert p.offset_tensors == ("q", "k", "v", "o", "stats") and p.q_offset.dtype == torch.int32
    _, info = lowered(p)
    tensors = by_uid(info)
    assert tensors[lowering.UID["q"]]["dim"] == [b, h, s, d] and tensors[lowering.UID["q"]]["stride"] == list(bshd)
    for role in ("q", "k", "v", "o", "stats"):
        offset = tensors[lowering.UID[f"{role}_offset"]]
        assert offset["dim"] == [b + 1, 1, 1, 1] and offset["dtype"] == "data_type.INT64", role


@pytest.mark.parametrize("layout", ["NPHD", "NHPD"])
def test_paged_caches_lower_to_frontend_containers(layout):
    q = torch.randn(2, 8, 1, 64).half()
    cache = torch.randn(10, 16, 2, 64).half() if layout == "NPHD" else torch.randn(10, 2, 16, 64).half()
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    lengths = torch.tensor([64, 33], dtype=torch.int32)
    p = problem_of(
        lambda g: g.sdpa_with_paged_cache(q, cache, cache, table, seq_len_kv=lengths, kv_cache_layout=layout)
    )
    result, info = lowered(p)
    tensors = by_uid(info)
    k = tensors[lowering.UID["k"]]
    assert k["dim"] == [10, 2, 16, 64]  # the frontend's [num_pages, H_kv, page_size, D]
    expected_stride = [2048, 64, 128, 1] if layout == "NPHD" else [2048, 1024, 64, 1]
    assert k["stride"] == expected_stride
    assert tensors[lowering.UID["page_table_k"]]["dim"] == [2, 1, 4, 1]
    assert node(info)["params"]["paged_attention_max_seq_len_kv"] == 64
    assert result.constant_lengths == {"seq_len_q": 1}  # no seq_len_q given: the plan binds S_q per batch


def test_dropout_with_int_seed_is_passed_by_value():
    q = torch.randn(1, 2, 32, 64).half()
    p = problem_of(lambda g: g.sdpa(q, q, q, dropout=0.25, dropout_seed=5, dropout_offset=6))
    _, info = lowered(p, rng_dump=True)
    n = node(info)
    assert n["params"]["dropout_0"] == 0.25
    tensors = info["tensors"]
    assert tensors["dropout_seed"]["uid"] == lowering.UID["dropout_seed"]
    assert lowering.UID["rng_dump"] in by_uid(info)


@pytest.mark.parametrize(
    "s_q, s_kv, causal, padded",
    [
        (192, 192, False, True),
        (64, 320, False, True),
        (1, 256, False, True),
        (1, 256, True, True),
        (256, 256, False, False),
        (192, 192, True, False),
        (128, 100, False, False),
    ],
    ids=["s192", "skv320", "sq1", "sq1-causal", "s256", "s192-causal", "skv100"],
)
def test_backward_known_nan_shapes_lower_with_full_length_padding(s_q, s_kv, causal, padded):
    """cuDNN 9.19 returns NaN gradients at S_kv % 128 == 64 (no causal) and at S_q = 1 for rows
    with a low log-sum-exp; a padding mask with full lengths avoids both (ops/cudnn/workarounds.py)."""
    q, kv = torch.randn(1, 2, s_q, 64).half(), torch.randn(1, 2, s_kv, 64).half()
    stats = torch.randn(1, 2, s_q, 1)

    def record(g):
        o, _ = g.sdpa(q, kv, kv, generate_stats=True, use_causal_mask_bottom_right=causal)
        g.sdpa_backward(q, kv, kv, q, q, stats, use_causal_mask_bottom_right=causal)

    with cudnn_attn.Graph(backend="reference") as g:
        record(g)
    result, info = lowered(g.problems[1])
    assert bool(node(info)["params"].get("use_padding_mask")) == padded
    assert result.constant_lengths == ({"seq_len_q": s_q, "seq_len_kv": s_kv} if padded else {})
