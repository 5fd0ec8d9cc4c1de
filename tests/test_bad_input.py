"""Bad input, each once found to escape as another exception, a wrong result or a hang: now a
clear library error naming the argument (one regression test per finding, and its class)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import randn, rel_err

import cudnn_attn
from cudnn_attn import ShapeMismatchError, UnsupportedError, ValidationError
from cudnn_attn.ops.reference import math as reference_math

LIBRARY_ERRORS = (ValidationError, UnsupportedError, ShapeMismatchError)


@pytest.fixture
def q():
    return randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def k():
    return randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(1))


# ---- the functional form ------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, argument",
    [
        (lambda a: a.update(key=a["key"].to("meta")), "device"),
        (lambda a: a.update(query=np.ones((1, 2, 8, 16), np.float32)), "query"),
        (lambda a: a.update(query=None), "query"),
        (lambda a: a.update(query=torch.tensor(1.0, dtype=torch.bfloat16)), "query"),
        (lambda a: a.update(attn_mask=torch.zeros(3, 5)), "attn_mask"),
        (lambda a: a.update(attn_mask=np.zeros((8, 8), np.float32)), "attn_mask"),
        (lambda a: a.update(attn_mask=torch.zeros(8, 8, dtype=torch.int32)), "attn_mask"),
        (lambda a: a.update(dropout_p=(0.1, 1, 0)), "dropout_p"),
        (lambda a: a.update(dropout_p=-0.1), "dropout_p"),
        (lambda a: a.update(dropout_p=float("nan")), "dropout_p"),
        (lambda a: a.update(scale=1j), "scale"),
        (lambda a: a.update(scale=10**400), "scale"),
        (lambda a: a.update(scale="0.1"), "scale"),
        (lambda a: a.update(is_causal="yes"), "is_causal"),
        (lambda a: a.update(value=a["value"][:, :, :4]), "value"),
    ],
    ids=[
        "meta-key",
        "numpy-query",
        "none-query",
        "0-d-query",
        "mask-shape",
        "numpy-mask",
        "int-mask",
        "dropout-tuple",
        "dropout-negative",
        "dropout-nan",
        "scale-complex",
        "scale-huge",
        "scale-string",
        "is-causal-string",
        "value-length",
    ],
)
def test_sdpa_refuses_bad_arguments_naming_them(q, k, change, argument):
    args = {"query": q, "key": k, "value": k.clone()}
    change(args)
    with pytest.raises(ValidationError) as caught:
        cudnn_attn.sdpa(**args)
    assert any(line.startswith(f"{argument}:") for line in caught.value.problems), caught.value.problems


def test_sdpa_accepts_broadcast_inputs(q, k):
    expanded = q[:, :1].expand(1, 2, 8, 16)
    expected = torch.nn.functional.scaled_dot_product_attention(expanded.double(), k.double(), k.double())
    assert rel_err(cudnn_attn.sdpa(expanded, k, k), expected) < 1e-2


# ---- the graph ----------------------------------------------------------------------------


def test_broadcast_inputs_get_a_valid_derived_output_layout(q, k):
    expanded = q[:, :1].expand(1, 2, 8, 16)
    with cudnn_attn.Graph() as g:
        o, _ = g.sdpa(expanded, k, k)
    assert o.spec.stride[-1] == 1 and o.spec.stride[1] > 0
    expected = torch.nn.functional.scaled_dot_product_attention(expanded.double(), k.double(), k.double())
    assert rel_err(g(expanded, k), expected) < 1e-2


@pytest.mark.parametrize("missing", ["o", "dO", "stats"])
def test_backward_without_a_required_input_names_it(q, k, missing):
    with cudnn_attn.Graph() as fwd:
        fwd.sdpa(q, k, k, generate_stats=True)
    o, stats = fwd(q, k)
    args = {"o": o, "dO": randn(*o.shape), "stats": stats}
    args[missing] = None
    with pytest.raises(ValidationError, match=f"{missing}: missing"):
        with cudnn_attn.Graph() as g:
            g.sdpa_backward(q, k, k, **args)


@pytest.mark.parametrize(
    "set_up",
    [
        lambda o: o.set_stride([0, 0, 0, 1]),
        lambda o: o.set_stride([1]),
        lambda o: o.set_stride([]),
        lambda o: o.set_stride([256, 128, 16, 2]),
        lambda o: o.set_dim([1, 2, 8]),
        lambda o: o.set_dim([1, 2, 8, 16, 1]),
        lambda o: o.set_dim([1, 2, 8, 16]).set_stride([256, 128, 16]),
    ],
    ids=["zero-strides", "one-stride", "no-strides", "overlapping", "rank-3", "rank-5", "stride-count"],
)
def test_bad_output_geometry_is_refused_at_build(q, k, set_up):
    with pytest.raises(ValidationError) as caught:
        with cudnn_attn.Graph() as g:
            o, _ = g.sdpa(q, k, k)
            set_up(o)
    assert all(line.startswith("o: ") for line in caught.value.problems), caught.value.problems


@pytest.mark.parametrize("value", [[1, 2.5], ["a"], 8, [True, 2]], ids=["float", "string", "int", "bool"])
def test_setters_take_sequences_of_ints_only(q, value):
    with cudnn_attn.Graph() as g:
        o, _ = g.sdpa(q, q, q)
        with pytest.raises(ValidationError, match="set_dim"):
            o.set_dim(value)


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"dim": [1, 2, 8, 16], "stride": [1]}, "stride"),
        ({"dim": None, "stride": [1]}, "dim"),
        ({"dim": [1, 2, float("nan"), 16], "stride": [256, 128, 16, 1]}, "dim"),
        ({"dim": [1, 2, 8.5, 16], "stride": [256, 128, 16, 1]}, "dim"),
        ({"dim": [1, 2, 8, 16], "stride": [256, 128, 16, 1], "device": "bogus"}, "device"),
        ({"dim": [1, 2, 8, 16], "stride": [256, 128, 16, 1], "data_type": "nonsense"}, "data_type"),
    ],
    ids=["stride-count", "dim-none", "dim-nan", "dim-fraction", "device", "data-type"],
)
def test_graph_tensor_validates_its_arguments(kwargs, argument):
    kwargs = {"data_type": torch.float16, **kwargs}
    with cudnn_attn.Graph() as g:
        with pytest.raises(ValidationError) as caught:
            g.tensor(**kwargs)
        g.sdpa(randn(1, 2, 8, 16), randn(1, 2, 8, 16), randn(1, 2, 8, 16))
    assert any(line.startswith(f"{argument}:") for line in caught.value.problems), caught.value.problems


@pytest.mark.parametrize(
    "keywords, argument",
    [
        ({"attn_scale": 10**400}, "attn_scale"),
        ({"use_causal_mask": True, "sliding_window_length": 2**70}, "sliding_window_length"),
        ({"dropout": 0.1, "dropout_seed": 2**70}, "dropout_seed"),
        ({"use_causal_mask": 2}, "use_causal_mask"),
        ({"generate_stats": "yes"}, "generate_stats"),
        ({"max_seq_len_kv": 2**40}, "max_seq_len_kv"),
    ],
    ids=["huge-scale", "huge-window", "huge-seed", "flag-2", "stats-string", "huge-max-length"],
)
def test_out_of_range_scalars_are_validation_errors(q, keywords, argument):
    with pytest.raises(ValidationError) as caught:
        with cudnn_attn.Graph() as g:
            g.sdpa(q, q, q, **keywords)
    assert any(line.startswith(f"{argument}:") for line in caught.value.problems), caught.value.problems


def test_outputs_follow_the_kind_of_q_not_of_another_input(q, k):
    bias = np.zeros((1, 2, 8, 8), np.float32)
    with cudnn_attn.Graph() as g:
        g.sdpa(q, k, k, attn_bias=bias)
    out = g(q, k, bias)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("out", [5, "o", object()], ids=["int", "str", "object"])
def test_a_bad_out_argument_is_a_shape_mismatch(q, out):
    with cudnn_attn.Graph() as g:
        g.sdpa(q, q, q)
    with pytest.raises(ShapeMismatchError, match="out"):
        g(q, out=out)


@pytest.mark.parametrize(
    "keywords, fragment",
    [
        ({"use_padding_mask": False}, "use_padding_mask"),
        ({"generate_stats": True}, "generate_stats: not a keyword of sdpa_with_paged_cache"),
        ({"is_inference": True}, "is_inference: not a keyword"),
    ],
    ids=["padding-off", "stats", "is-inference"],
)
def test_paged_op_refuses_conflicting_keywords_clearly(keywords, fragment):
    q = randn(1, 2, 1, 16)
    cache = randn(4, 8, 2, 16)
    table = torch.arange(4, dtype=torch.int32).view(1, 4)
    with pytest.raises(ValidationError, match=fragment):
        with cudnn_attn.Graph() as g:
            g.sdpa_with_paged_cache(
                q, cache, cache, table, seq_len_kv=torch.tensor([20], dtype=torch.int32), **keywords
            )


def test_paged_op_without_a_page_table_names_the_page_table():
    q = randn(1, 2, 1, 16)
    cache = randn(4, 8, 2, 16)
    with pytest.raises(ValidationError) as caught:
        with cudnn_attn.Graph() as g:
            g.sdpa_with_paged_cache(q, cache, cache, None, seq_len_kv=torch.tensor([20], dtype=torch.int32))
    assert caught.value.problems[0].startswith("page_table: missing")


# ---- memory: nothing quadratic at plan time, caches bounded in bytes -------------------------


def test_a_long_causal_reference_plan_holds_no_mask():
    with cudnn_attn.Graph(cache=cudnn_attn.PlanCache()) as g:
        t = g.tensor(dim=[1, 1, 2**20, 64], stride=[2**26, 2**26, 64, 1], data_type=torch.bfloat16, device="cpu")
        g.sdpa(t, t, t, use_causal_mask=True)
    assert g.nodes[0].plan.nbytes == 0 and g.nbytes() == 0


@pytest.mark.parametrize(
    "options, with_bias",
    [
        ({"use_causal_mask": True}, True),
        ({"use_alibi_mask": True, "use_causal_mask": True}, False),
        ({"sliding_window_length": 3, "use_causal_mask_bottom_right": True}, False),
    ],
    ids=["causal-bias", "alibi", "window"],
)
def test_row_blocks_give_the_same_result_as_one_block(monkeypatch, options, with_bias):
    gen = torch.Generator().manual_seed(3)
    q, k, v, d_o = (randn(2, 2, 13, 16, generator=gen) for _ in range(4))
    bias = randn(1, 2, 13, 13, generator=gen) if with_bias else None

    def run():
        with cudnn_attn.Graph(cache=cudnn_attn.PlanCache()) as g:
            o, stats = g.sdpa(q, k, v, attn_bias=bias, generate_stats=True, **options)
            g.sdpa_backward(q, k, v, o, d_o, stats, attn_bias=bias, **options)
        return g(q, k, v, bias, d_o) if with_bias else g(q, k, v, d_o)

    whole = run()
    monkeypatch.setattr(reference_math, "BLOCK_SCORES", 2 * 2 * 13 * 3)  # blocks of 3 rows
    blocked = run()
    assert len(whole) == 5  # O, Stats, dQ, dK, dV
    for a, b in zip(whole, blocked):
        assert rel_err(a, b) < 1e-6


class _Held:
    def __init__(self, nbytes):
        self.nbytes = nbytes


def test_plan_cache_is_bounded_in_bytes():
    cache = cudnn_attn.PlanCache(maxsize=100, max_bytes=1000)
    for i in range(5):
        cache.get_or_build(i, lambda: _Held(400))
    assert len(cache) == 2 and cache.nbytes() == 800 and cache.stats()["evictions"] == 3
    assert 4 in cache and 3 in cache and 0 not in cache


def test_bucketed_attention_keeps_a_bounded_number_of_graphs():
    attend = cudnn_attn.BucketedAttention(buckets=(4, 8, 16, 32, 64), max_plans=2)
    for s in (3, 7, 15, 31, 63):
        x = randn(1, 1, s, 16)
        attend(x, x, x)
    assert attend.plan_count == 2


def test_a_square_paged_cache_asks_for_its_layout_unless_both_readings_coincide():
    q = randn(1, 4, 1, 16)
    table = torch.arange(4, dtype=torch.int32).view(1, 4)
    lengths = torch.tensor([6], dtype=torch.int32)
    square = randn(4, 2, 2, 16)  # page_size == H_kv == 2: [N, P, H, D] and [N, H, P, D] gather differently
    with pytest.raises(ValidationError, match="kv_cache_layout"):
        with cudnn_attn.Graph() as g:
            g.sdpa_with_paged_cache(q, square, square, table, seq_len_kv=lengths)
    single = randn(8, 1, 1, 16)  # one token of one head per page: the readings coincide
    with cudnn_attn.Graph() as g:
        g.sdpa_with_paged_cache(q, single, single, torch.arange(8, dtype=torch.int32).view(1, 8), seq_len_kv=lengths)
    assert g.problems[0].h_k == 1 and g.problems[0].page_size == 1


def test_prepared_runs_let_go_of_plans_their_cache_drops():
    """Runs hold plans; the plan cache's bounds bound them too: a run whose plan the cache
    evicted is prepared afresh (a new plan), never served from a table that outlived it."""
    cache = cudnn_attn.PlanCache(maxsize=1)
    attend = cudnn_attn.BucketedAttention(buckets=(8, 16), cache=cache)
    short, long = randn(1, 1, 5, 16), randn(1, 1, 12, 16)
    attend(short, short, short)
    attend(long, long, long)  # the second plan evicts the first
    attend(short, short, short)  # prepared again: built again
    stats = cache.stats()
    assert stats["builds"] == 3 and stats["evictions"] == 2 and len(cache) == 1


def test_prepared_eager_runs_are_released_at_exit():
    # In a child process: releasing plans leaves this process's graphs unusable.
    code = (
        "import torch, cudnn_attn\n"
        "from cudnn_attn.runtime import lifecycle, prepared\n"
        "q = torch.randn(1, 2, 8, 16)\n"
        "with cudnn_attn.backend('reference'):  # plain 'auto' CPU calls run on torch's kernel, no plan\n"
        "    cudnn_attn.sdpa(q, q, q)\n"
        "assert prepared.held() and len(cudnn_attn.default_cache()) == 1\n"
        "lifecycle.release_plans()  # what runs at interpreter exit\n"
        "assert not prepared.held() and len(cudnn_attn.default_cache()) == 0\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
