"""A ``with Graph()`` block that repeats an earlier recording adopts its build; any difference
that could change the build (geometry, aliasing, argument types, values of integer inputs,
handle settings, options) builds in full, and adopted graphs run exactly like built ones."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import randn, rel_err

import cudnn_attn
from cudnn_attn import PlanCache
from cudnn_attn.errors import ValidationError


def _qkv(s=16, d=32, dtype=torch.bfloat16):
    return tuple(randn(2, 4, s, d, dtype=dtype) for _ in range(3))


def _record(cache, q, k, v, **kwargs):
    with cudnn_attn.Graph(cache=cache) as g:
        o, stats = g.sdpa(q, k, v, **kwargs)
    return g


def test_a_repeated_recording_adopts_the_build_and_runs_the_same():
    cache = PlanCache()
    q, k, v = _qkv()
    first = _record(cache, q, k, v, use_causal_mask=True, generate_stats=True)
    q2, k2, v2 = _qkv()  # fresh tensors, same geometry
    second = _record(cache, q2, k2, v2, use_causal_mask=True, generate_stats=True)
    assert len(cache.recorded) == 1 and cache.stats()["builds"] == 1
    assert cache.stats()["hits"] == 1  # an adopted build counts as a plan-cache hit
    assert second.nodes[0].plan is first.nodes[0].plan
    assert [h.name for h in second.inputs] == [h.name for h in first.inputs] == ["q", "k", "v"]
    assert [h.spec for h in second.outputs] == [h.spec for h in first.outputs]
    out2, stats2 = second(q2, k2, v2)
    out1, stats1 = first(q2, k2, v2)
    assert torch.equal(out1, out2) and torch.equal(stats1, stats2)
    assert rel_err(out2, torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, is_causal=True)) < 1.6e-2


@pytest.mark.parametrize(
    "first, second",
    [
        ({"shape": (2, 4, 16, 32)}, {"shape": (2, 4, 24, 32)}),
        ({"dtype": torch.bfloat16}, {"dtype": torch.float16}),
        ({"layout": "bhsd"}, {"layout": "bshd"}),
        ({"kw": {"use_causal_mask": True}}, {"kw": {"use_causal_mask": False}}),
        ({"kw": {"attn_scale": 0.5}}, {"kw": {"attn_scale": 0.25}}),
        ({"alias": False}, {"alias": True}),
    ],
    ids=["shape", "dtype", "strides", "flag", "scale", "aliasing"],
)
def test_any_difference_builds_its_own(first, second):
    cache = PlanCache()
    graphs = []
    for case in (first, second):
        shape, dtype = case.get("shape", (2, 4, 16, 32)), case.get("dtype", torch.bfloat16)
        if case.get("layout") == "bshd":
            q, k, v = (randn(shape[0], shape[2], shape[1], shape[3], dtype=dtype).transpose(1, 2) for _ in range(3))
        else:
            q, k, v = (randn(*shape, dtype=dtype) for _ in range(3))
        if case.get("alias"):
            k = v = q
        kw = case.get("kw", {})
        graphs.append((_record(cache, q, k, v, **kw), (q, k, v), kw))
    assert len(cache.recorded) == 2
    for g, (q, k, v), kw in graphs:
        distinct = [q] if k is q else [q, k, v]  # an input given twice is one graph input
        assert len(g.inputs) == len(distinct)
        torch_kw = {"is_causal": kw.get("use_causal_mask", False), "scale": kw.get("attn_scale")}
        expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), **torch_kw)
        assert rel_err(g(*distinct), expected) < 2e-2


def test_an_argument_of_another_type_is_validated_again():
    """True == 1.0 in Python, but attn_scale=True is refused: the key holds the type."""
    cache = PlanCache()
    q, k, v = _qkv()
    _record(cache, q, k, v, attn_scale=1.0)
    with pytest.raises(ValidationError, match="attn_scale: True"):
        _record(cache, q, k, v, attn_scale=True)


def test_a_failed_build_is_not_kept():
    cache = PlanCache()
    q, k, v = _qkv()
    for _ in range(2):
        with pytest.raises(ValidationError, match="sliding_window_length"):
            _record(cache, q, k, v, sliding_window_length=-3)
    assert len(cache.recorded) == 0


def _paged(b=2, h_kv=2, s_kv=24, d=16, page=8):
    per_seq = s_kv // page
    cache = randn(b * per_seq, page, h_kv, d)
    table = torch.randperm(b * per_seq).view(b, per_seq).to(torch.int32)
    return cache, table


def test_values_of_integer_inputs_are_checked_on_every_recording():
    """The key proves geometry, not values: an adopted build still checks this recording's
    page table and lengths where they are given as tensors."""
    cache = PlanCache()
    q = randn(2, 4, 1, 16)
    kv, table = _paged()
    lengths = torch.tensor([24, 11], dtype=torch.int32)

    def record(table, lengths):
        with cudnn_attn.Graph(cache=cache) as g:
            g.sdpa_with_paged_cache(q, kv, kv, table, seq_len_kv=lengths)
        return g

    first = record(table, lengths)
    second = record(table.clone(), lengths.clone())
    assert len(cache.recorded) == 1 and second.nodes[0].plan is first.nodes[0].plan
    assert torch.equal(second(q, kv, table, lengths), first(q, kv, table, lengths))
    with pytest.raises(ValidationError, match="page_table"):
        record(table + 100, lengths)  # pages past the cache
    with pytest.raises(ValidationError, match="seq_len_kv"):
        record(table, torch.tensor([24, 99], dtype=torch.int32))


def test_handle_settings_are_part_of_the_recording():
    cache = PlanCache()
    q, k, v = _qkv()
    with cudnn_attn.Graph(cache=cache) as g1:
        o, _ = g1.sdpa(q, k, v)
    with cudnn_attn.Graph(cache=cache) as g2:
        o, _ = g2.sdpa(q, k, v)
        o.set_name("attention_out")
    assert len(cache.recorded) == 2 and g2.outputs[0].name == "attention_out"
    out = torch.empty_like(q)
    g2(q, k, v, out={"attention_out": out})  # the adopted runner knows this graph's handles
    assert torch.equal(out, g1(q, k, v))


def test_graph_options_are_part_of_the_recording():
    cache = PlanCache()
    q, k, v = _qkv()
    with cudnn_attn.Graph(cache=cache) as g1:
        g1.sdpa(q, k, v)
    with pytest.raises(ValidationError, match="io_data_type"):  # bf16 tensors, an fp16 graph: not adopted
        with cudnn_attn.Graph(cache=cache, io_data_type=torch.float16) as g2:
            g2.sdpa(q, k, v)
    assert len(cache.recorded) == 1


def test_made_handles_adopt_by_name_and_geometry():
    cache = PlanCache()
    q, k, v = _qkv()
    graphs = []
    for _ in range(2):
        with cudnn_attn.Graph(cache=cache) as g:
            q_in = g.tensor(name="query", dim=q.shape, stride=q.stride(), data_type=q.dtype, device="cpu")
            g.sdpa(q_in, k, v)
        graphs.append(g)
    assert len(cache.recorded) == 1
    assert [h.name for h in graphs[1].inputs] == ["query", "k", "v"]
    assert graphs[1].inputs[0] is not graphs[0].inputs[0] and graphs[1].inputs[0].recording is graphs[1].recording
    assert torch.equal(graphs[1](q, k, v), graphs[0](q, k, v))


def test_a_template_linked_later_changes_the_recording():
    """tensor_like(x) after an op that took x makes x that handle: not the same as a handle
    of another tensor."""
    cache = PlanCache()
    q, k, v = _qkv()
    with cudnn_attn.Graph(cache=cache) as g1:
        g1.sdpa(q, k, v)
        g1.tensor_like(q, name="linked")
    with cudnn_attn.Graph(cache=cache) as g2:
        g2.sdpa(q, k, v)
        g2.tensor_like(torch.empty_like(q), name="linked")
    assert len(cache.recorded) == 2
    assert [h.name for h in g1.inputs] == ["linked", "k", "v"] and [h.name for h in g2.inputs] == ["q", "k", "v"]


def test_forward_and_backward_in_one_graph_adopt_together():
    cache = PlanCache()
    results = []
    q, k, v = _qkv()
    d_o = randn(*q.shape)
    for _ in range(2):
        with cudnn_attn.Graph(cache=cache) as g:
            o, stats = g.sdpa(q, k, v, generate_stats=True, use_causal_mask=True)
            g.sdpa_backward(q, k, v, o, d_o, stats, use_causal_mask=True)
        results.append(g(q, k, v, d_o))
    assert len(cache.recorded) == 1 and cache.stats()["builds"] == 2  # forward and backward plans
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_eviction_and_clear_forget_recorded_builds():
    """A recorded build never outlives its plans in the cache."""
    cache = PlanCache(maxsize=1)
    a, b = _qkv(s=16), _qkv(s=24)
    _record(cache, *a)
    _record(cache, *b)  # evicts a's plan, and with it every recorded build
    assert len(cache.recorded) == 1
    _record(cache, *a)
    assert cache.stats()["builds"] == 3
    cache.clear()
    assert len(cache.recorded) == 0


def test_unkeyed_recordings_build_in_full():
    cache = PlanCache()
    q, k, v = _qkv()
    for _ in range(2):
        with cudnn_attn.Graph(cache=cache) as g:
            g.sdpa(torch.nn.Parameter(q, requires_grad=False), k, v)  # a tensor subclass
    assert len(cache.recorded) == 0 and cache.stats()["hits"] == 1


def test_no_tensor_of_a_recording_is_kept_alive():
    cache = PlanCache()
    for _ in range(2):
        q, k, v = _qkv()
        refs = [weakref.ref(t) for t in (q, k, v)]
        g = _record(cache, q, k, v)
        g(q, k, v)
        del q, k, v
        gc.collect()
        assert all(r() is None for r in refs)
    assert len(cache.recorded) == 1
