"""Malformed requests: each gives one ValidationError whose lines name the right argument."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cudnn_attn
from cudnn_attn import UnsupportedError, ValidationError

B, H, S, D = 2, 4, 16, 64


def t(*shape, dtype=torch.float16):
    return torch.randn(*shape).to(dtype)


def lengths(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


Q, K, V = t(B, H, S, D), t(B, H, S, D), t(B, H, S, D)
DO = t(B, H, S, D)
STATS = torch.randn(B, H, S, 1)
PAGED_CACHE = t(8, 16, H, D)
TABLE = torch.arange(8, dtype=torch.int32).view(B, 4)


def fwd(**kw):
    args = {"q": Q, "k": K, "v": V}
    args.update(kw)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with cudnn_attn.Graph(backend="reference") as g:
        g.sdpa(q, k, v, **args)


def bwd(**kw):
    args = {"q": Q, "k": K, "v": V, "o": Q, "dO": DO, "stats": STATS}
    args.update(kw)
    with cudnn_attn.Graph(backend="reference") as g:
        g.sdpa_backward(
            args.pop("q"), args.pop("k"), args.pop("v"), args.pop("o"), args.pop("dO"), args.pop("stats"), **args
        )


def paged(**kw):
    args = {"q": t(B, H, 1, D), "k": PAGED_CACHE, "v": PAGED_CACHE, "page_table": TABLE, "seq_len_kv": lengths(30, 64)}
    args.update(kw)
    with cudnn_attn.Graph(backend="reference") as g:
        g.sdpa_with_paged_cache(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("page_table"), **args)


# (id, call, argument the message must name, a phrase it must contain)
MALFORMED = [
    ("q-rank-2", lambda: fwd(q=t(S, D)), "q:", "rank 2"),
    ("q-rank-5", lambda: fwd(q=t(1, B, H, S, D)), "q:", "rank 5"),
    ("k-rank", lambda: fwd(k=t(H, S, D)), "k:", "rank 3"),
    ("q-not-tensor", lambda: fwd(q=[1, 2, 3]), "q:", "expected a tensor"),
    ("v-not-tensor", lambda: fwd(v="v"), "v:", "expected a tensor"),
    ("q-last-stride", lambda: fwd(q=t(B, H, D, S).transpose(2, 3)), "q:", "last stride"),
    ("k-last-stride", lambda: fwd(k=t(B, H, D, S).transpose(2, 3)), "k:", "last stride"),
    ("q-int", lambda: fwd(q=torch.ones(B, H, S, D, dtype=torch.int32)), "q:", "int32"),
    ("k-dtype-differs", lambda: fwd(k=t(B, H, S, D, dtype=torch.bfloat16)), "k:", "bfloat16"),
    ("v-dtype-differs", lambda: fwd(v=t(B, H, S, D, dtype=torch.bfloat16)), "v:", "bfloat16"),
    ("k-batch", lambda: fwd(k=t(3, H, S, D), v=t(3, H, S, D)), "k:", "batch 3"),
    ("v-seq-len", lambda: fwd(v=t(B, H, S + 8, D)), "v:", "sequence length"),
    ("k-head-dim", lambda: fwd(k=t(B, H, S, 32)), "k:", "d_qk=32"),
    ("gqa-ratio", lambda: fwd(k=t(B, 3, S, D), v=t(B, 3, S, D)), "k:", "3 heads"),
    ("gqa-v-ratio", lambda: fwd(v=t(B, 3, S, D)), "v:", "3 heads"),
    ("io-data-type", lambda: _graph_io(cudnn_attn.data_type.BFLOAT16), "io_data_type", "bfloat16"),
    ("both-causal", lambda: fwd(use_causal_mask=True, use_causal_mask_bottom_right=True), "use_causal_mask", "both"),
    (
        "inference-contradicts-stats",
        lambda: fwd(is_inference=True, generate_stats=True),
        "generate_stats",
        "contradicts",
    ),
    ("bias-shape", lambda: fwd(attn_bias=t(B, H, S, S + 1)), "attn_bias", "S_kv=17"),
    ("bias-heads", lambda: fwd(attn_bias=t(1, 3, S, S)), "attn_bias", "H=3"),
    ("bias-rank", lambda: fwd(attn_bias=t(S, S)), "attn_bias", "rank 2"),
    ("bias-dtype", lambda: fwd(attn_bias=torch.zeros(1, 1, S, S, dtype=torch.int64)), "attn_bias", "int64"),
    ("bias-given-twice", lambda: fwd(attn_bias=t(1, 1, S, S), bias=t(1, 1, S, S)), "attn_bias", "twice"),
    ("window-zero", lambda: fwd(use_causal_mask=True, sliding_window_length=0), "sliding_window_length", ">= 1"),
    ("window-not-int", lambda: fwd(sliding_window_length=2.5), "sliding_window_length", "2.5"),
    ("padding-without-lengths", lambda: fwd(use_padding_mask=True), "seq_len_q", "missing"),
    (
        "lengths-without-padding",
        lambda: fwd(seq_len_q=lengths(S, S), seq_len_kv=lengths(S, S)),
        "seq_len_q",
        "use_padding_mask",
    ),
    (
        "seq-len-dtype",
        lambda: fwd(use_padding_mask=True, seq_len_q=lengths(S, S, dtype=torch.int16), seq_len_kv=lengths(S, S)),
        "seq_len_q",
        "int16",
    ),
    (
        "seq-len-shape",
        lambda: fwd(use_padding_mask=True, seq_len_q=lengths(S, S, S), seq_len_kv=lengths(S, S)),
        "seq_len_q",
        "[3]",
    ),
    (
        "seq-len-value",
        lambda: fwd(use_padding_mask=True, seq_len_q=lengths(S, S + 1), seq_len_kv=lengths(S, S)),
        "seq_len_q",
        "17",
    ),
    (
        "seq-len-negative",
        lambda: fwd(use_padding_mask=True, seq_len_q=lengths(S, S), seq_len_kv=lengths(-1, S)),
        "seq_len_kv",
        "-1",
    ),
    ("dropout-one", lambda: fwd(dropout=1.0), "dropout", "1.0"),
    ("dropout-negative", lambda: fwd(dropout=-0.1), "dropout", "-0.1"),
    ("dropout-not-number", lambda: fwd(dropout="0.1"), "dropout", "'0.1'"),
    ("dropout-tuple-and-seed", lambda: fwd(dropout=(0.1, 1, 2), dropout_seed=3), "dropout", "both"),
    (
        "dropout-seed-shape",
        lambda: fwd(dropout=0.1, dropout_seed=torch.zeros(2, dtype=torch.int64)),
        "dropout_seed",
        "one value",
    ),
    ("dropout-seed-dtype", lambda: fwd(dropout=0.1, dropout_seed=torch.zeros(1)), "dropout_seed", "float32"),
    ("attn-scale-nan", lambda: fwd(attn_scale=float("nan")), "attn_scale", "finite"),
    ("attn-scale-string", lambda: fwd(attn_scale="big"), "attn_scale", "'big'"),
    ("right-bound", lambda: fwd(diagonal_band_right_bound=-1), "diagonal_band_right_bound", "-1"),
    (
        "window-disagrees",
        lambda: fwd(use_causal_mask=True, sliding_window_length=3, diagonal_band_left_bound=4),
        "sliding_window_length",
        "disagrees",
    ),
    ("compute-dtype", lambda: fwd(compute_data_type=torch.float16), "compute_data_type", "float16"),
    ("thd-no-lengths", lambda: fwd(q=t(40, H, D), k=t(40, H, D), v=t(40, H, D)), "seq_len_q", "missing"),
    (
        "thd-lengths-overflow",
        lambda: fwd(q=t(10, H, D), k=t(10, H, D), v=t(10, H, D), seq_len_q=lengths(6, 6), seq_len_kv=lengths(5, 5)),
        "seq_len_q",
        "sum to 12",
    ),
    ("thd-k-dense", lambda: fwd(q=t(10, H, D), seq_len_q=lengths(5, 5), seq_len_kv=lengths(5, 5)), "k:", "rank 4"),
    ("paged-table-dtype", lambda: paged(page_table=TABLE.long()), "page_table_k", "int64"),
    ("paged-table-shape", lambda: paged(page_table=torch.zeros(3, 4, dtype=torch.int32)), "page_table_k", "[3, 4]"),
    ("paged-table-values", lambda: paged(page_table=TABLE + 5), "page_table_k", "out of range"),
    ("paged-no-seq-len-kv", lambda: paged(seq_len_kv=None), "seq_len_kv", "paged"),
    ("paged-max-too-large", lambda: paged(max_seq_len_kv=100), "paged_attention_max_seq_len_kv", "100"),
    ("paged-layout-name", lambda: paged(kv_cache_layout="HND"), "kv_cache_layout", "HND"),
    (
        "paged-max-without-pages",
        lambda: fwd(paged_attention_max_seq_len_kv=64),
        "paged_attention_max_seq_len_kv",
        "without paged",
    ),
    ("fp8-backward", lambda: bwd(q=t(B, H, S, D, dtype=torch.float8_e4m3fn)), "q:", "sdpa_fp8_backward"),
    ("bwd-stats-dtype", lambda: bwd(stats=STATS.half()), "stats", "float16"),
    ("bwd-stats-shape", lambda: bwd(stats=torch.randn(B, H, S)), "stats", "rank 3"),
    ("bwd-do-shape", lambda: bwd(dO=t(B, H, S, 32)), "dO", "[2, 4, 16, 32]"),
    ("bwd-o-shape", lambda: bwd(o=t(B, H, S + 1, D)), "o:", "[2, 4, 17, 64]"),
    ("bwd-dbias-without-bias", lambda: bwd(bias_grad=True), "dBias", "without attn_bias"),
    ("device-mismatch", lambda: fwd(k=torch.empty(B, H, S, D, dtype=torch.float16, device="meta")), "device", "meta"),
    # An empty batch or sequence is torch's empty call (it runs); no heads or no head dim is not.
    ("zero-heads", lambda: fwd(q=t(B, 0, S, D)), "q:", "heads and head dims must be >= 1"),
    ("zero-head-dim", lambda: fwd(q=t(B, H, S, 0), k=t(B, H, S, 0)), "q:", "heads and head dims must be >= 1"),
]


def _graph_io(io):
    with cudnn_attn.Graph(io_data_type=io, backend="reference") as g:
        g.sdpa(Q, K, V)


@pytest.mark.parametrize("call,argument,phrase", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_request_names_its_argument(call, argument, phrase):
    with pytest.raises(ValidationError) as info:
        call()
    lines = info.value.problems
    hit = [line for line in lines if argument in line and phrase in line]
    assert hit, f"no line names {argument!r} with {phrase!r}: {lines}"


@pytest.mark.parametrize(
    "keywords, argument",
    [({"use_causal_mask_bottom_right": True}, "use_causal_mask_bottom_right")],
    ids=["bottom-right"],
)
def test_a_bottom_right_diagonal_leaving_rows_without_keys_is_unsupported_as_in_the_frontend(keywords, argument):
    """Well formed, but refused by the frontend as not supported: tests written for it skip on
    cudnnGraphNotSupportedError, so it is that (an UnsupportedError), on every backend."""
    with pytest.raises(cudnn_attn.cudnnGraphNotSupportedError) as info:
        fwd(k=t(B, H, 8, D), v=t(B, H, 8, D), **keywords)
    assert isinstance(info.value, UnsupportedError)
    assert any(argument in line and "S_q=16 > S_kv=8" in line for line in info.value.problems)


def test_at_least_40_distinct_malformed_requests_are_each_caught():
    # Run the table: every request raises, and at least 40 different lines name what was wrong.
    caught = set()
    for name, call, argument, phrase in MALFORMED:
        with pytest.raises(ValidationError) as info:
            call()
        lines = {line for line in info.value.problems if argument in line and phrase in line}
        assert lines, f"{name}: no line names {argument!r} with {phrase!r}: {info.value.problems}"
        caught |= lines
    assert len(caught) >= 40, sorted(caught)


def test_every_problem_is_reported_together():
    with pytest.raises(ValidationError) as info:
        fwd(k=t(B, 3, S, 60), use_causal_mask=True, use_causal_mask_bottom_right=True, dropout=2.0)
    text = str(info.value)
    for fragment in ("k: 3 heads", "d_qk=60", "use_causal_mask: both", "dropout: probability 2.0"):
        assert fragment in text, text
    assert len(info.value.problems) >= 4


def test_multi_node_graph_prefixes_each_problem_with_its_node():
    with pytest.raises(ValidationError) as info:
        with cudnn_attn.Graph(backend="reference") as g:
            g.sdpa(Q, K, V, name="first")
            g.sdpa(Q, t(B, 3, S, D), V, name="second")
    assert all(line.startswith("second: ") for line in info.value.problems)


def test_validation_is_a_pure_function_of_the_problem():
    from cudnn_attn.core import validation
    from cudnn_attn.core.problem import AttentionProblem, Op, TensorSpec

    def problem(k_head_dim):  # built afresh on each call, from fresh tensors
        q = TensorSpec.of(t(B, H, S, D))
        k = TensorSpec.of(t(B, H, S, k_head_dim))
        return AttentionProblem(op=Op.FORWARD, q=q, k=k, v=q, o=q).replace(attn_scale=0.125)

    bad, bad_again = problem(32), problem(32)
    assert bad is not bad_again and bad == bad_again
    found = validation.problems(bad)
    assert any(line.startswith("k:") and "d_qk=32" in line for line in found), found
    assert validation.problems(bad_again) == found  # equal problems, equal answers
    found.append("a caller's own line")  # what a caller does with the answer ...
    assert validation.problems(bad) == validation.problems(bad_again) == found[:-1]  # ... stays its own
    assert validation.problems(problem(D)) == []  # bad's answer is not reused for a problem that differs


def test_validation_error_is_a_value_error_and_unsupported_is_not_implemented():
    assert issubclass(ValidationError, ValueError)
    assert issubclass(cudnn_attn.UnsupportedError, NotImplementedError)
    assert issubclass(cudnn_attn.ShapeMismatchError, ValueError)


def test_graph_arguments_are_validated():
    with pytest.raises(ValidationError, match="backend"):
        cudnn_attn.Graph(backend="tensorrt")
    with pytest.raises(ValidationError, match="io_data_type"):
        cudnn_attn.Graph(io_data_type="complex")


def test_cudnn_backend_on_cpu_tensors_is_unsupported_with_an_alternative():
    with pytest.raises(cudnn_attn.UnsupportedError) as info:
        with cudnn_attn.Graph(backend="cudnn") as g:
            g.sdpa(Q, K, V)
    assert "CUDA" in str(info.value) and 'backend="reference"' in str(info.value)


@pytest.mark.parametrize(
    "keywords,argument",
    [(dict(rng_dump=torch.empty(B, H, S, S)), "rng_dump")],
    ids=["backward-rng-dump"],
)
def test_valid_frontend_requests_not_run_yet_are_unsupported_naming_the_argument(keywords, argument):
    with pytest.raises(cudnn_attn.UnsupportedError) as info:
        bwd(**keywords)
    assert any(argument in line for line in info.value.problems), info.value.problems


def test_frontend_keywords_passed_on_every_call_are_taken():
    """The frontend's tests pass these on every call, None or not: they change nothing here."""

    def run(**keywords):
        with cudnn_attn.Graph(backend="reference") as g:
            g.sdpa(Q, K, V, **keywords)
        return g(Q, K, V)

    expected = run()
    for keywords in (
        dict(implementation="AUTO", rng_dump=None, max_total_seq_len_q=None, max_total_seq_len_kv=None),
        dict(implementation="UNIFIED", max_total_seq_len_q=B * S, max_total_seq_len_kv=B * S),
        dict(diagonal_alignment="BOTTOM_RIGHT"),
    ):  # an alignment with no bound masks nothing
        assert torch.equal(run(**keywords), expected), keywords


def _dense_band(s_q, s_kv, left, right, bottom_right):
    """Allowed scores of a diagonal band by its definition, for small shapes."""
    i = torch.arange(s_q).view(-1, 1)
    j = torch.arange(s_kv).view(1, -1)
    d = i + (s_kv - s_q if bottom_right else 0)
    allowed = torch.ones(s_q, s_kv, dtype=torch.bool)
    if right is not None:
        allowed &= j <= d + right
    if left is not None:
        allowed &= j > d - left
    return allowed


@pytest.mark.parametrize(
    "alignment,left,right",
    [
        ("TOP_LEFT", None, 3),
        ("BOTTOM_RIGHT", None, 3),
        ("BOTTOM_RIGHT", 4, None),
        ("TOP_LEFT", 4, 2),
        ("BOTTOM_RIGHT", 5, 1),
        ("BOTTOM_RIGHT", 6, 0),
        ("TOP_LEFT", 3, None),
    ],
)
def test_any_diagonal_band_is_the_frontends_band(alignment, left, right):
    """diagonal_alignment with any left and right bounds, against softmax over the band by its
    definition (S_q = 12 < S_kv = 20, so the two alignments differ)."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, s, 16, generator=gen) for s in (12, 20, 20))
    keywords = dict(diagonal_alignment=getattr(cudnn_attn.diagonal_alignment, alignment), attn_scale=0.25)
    if left is not None:
        keywords["diagonal_band_left_bound"] = left
    if right is not None:
        keywords["diagonal_band_right_bound"] = right
    with cudnn_attn.Graph(backend="reference") as g:
        g.sdpa(q, k, v, **keywords)
    allowed = _dense_band(12, 20, left, right, alignment == "BOTTOM_RIGHT")
    scores = (q.double() @ k.double().transpose(-1, -2) * 0.25).masked_fill(~allowed, float("-inf"))
    expected = torch.nan_to_num(torch.softmax(scores, -1)) @ v.double()
    assert (g(q, k, v).double() - expected).abs().max() < 1e-5


@pytest.mark.parametrize(
    "keywords,phrase",
    [
        (dict(use_alibi_mask=True), "use_alibi_mask without top-left causal"),
        (dict(use_alibi_mask=True, use_causal_mask_bottom_right=True), "with use_alibi_mask"),
        (dict(use_causal_mask_bottom_right=True, attn_bias=t(1, 1, S, S)), "with attn_bias"),
        (dict(use_causal_mask_bottom_right=True, dropout=0.1), "with dropout"),
    ],
)
def test_masks_cudnn_does_not_combine_run_on_the_reference_and_are_refused_on_cudnn(keywords, phrase):
    """Well formed (the reference computes them), refused by cuDNN's own support surface: as the
    frontend, a not-supported error naming the combination, never a ValidationError."""
    from cudnn_attn.ops.cudnn.capabilities import Platform, unsupported_reasons

    with cudnn_attn.Graph(backend="reference") as g:
        g.sdpa(Q, K, V, **keywords)
    problem = g.problems[0]
    on_gpu = {role: dataclasses.replace(spec, device="cuda:0") for role, spec in problem.tensor_specs().items()}
    reasons = unsupported_reasons(
        dataclasses.replace(problem, **on_gpu), Platform("NVIDIA H100", (9, 0), 91900, "1.32.0")
    )
    assert any(phrase in reason for reason in reasons), reasons


def test_alibi_without_causal_on_the_reference_is_alibi_by_definition():
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 4, 12, 16, generator=gen) for _ in range(3))
    with cudnn_attn.Graph(backend="reference") as g:
        g.sdpa(q, k, v, use_alibi_mask=True, attn_scale=0.25)
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / 4) for h in range(4)], dtype=torch.float64).view(1, 4, 1, 1)
    distance = (torch.arange(12).view(1, -1) - torch.arange(12).view(-1, 1)).double()
    scores = q.double() @ k.double().transpose(-1, -2) * 0.25 + slopes * distance
    assert (g(q, k, v).double() - torch.softmax(scores, -1) @ v.double()).abs().max() < 1e-5


def test_int64_lengths_are_taken_as_the_frontend_takes_them():
    """The frontend's notebook 52 passes int64 seq_len_q/kv: the same result as int32."""
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 2, 16, 16, generator=gen) for _ in range(3))
    results = []
    for dtype in (torch.int32, torch.int64):
        lq, lkv = (
            torch.tensor([9, 16], dtype=dtype).view(2, 1, 1, 1),
            torch.tensor([5, 12], dtype=dtype).view(2, 1, 1, 1),
        )
        with cudnn_attn.Graph(backend="reference") as g:
            g.sdpa(q, k, v, use_padding_mask=True, seq_len_q=lq, seq_len_kv=lkv, attn_scale=0.25)
        results.append(g(q, k, v, lq, lkv))
    assert torch.equal(results[0], results[1]) and results[0].abs().sum() > 0
