"""The frontend's graph helpers through ``import cudnn_attn as cudnn``, on the reference backend:
``cudnn.graph(handle)``, ``jit`` and ``graph_cache`` (the frontend's caching test's form), the plan
helpers, a graph-tensor ``attn_scale`` read at each run, build-step arguments, and
``execute(override_uids=, override_shapes=, override_strides=)`` for THD graphs. Results are
checked against torch's attention on fresh random inputs."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import rel_err

import cudnn_attn as cudnn

H, D = 3, 32


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _attention(q, k, v, scale, causal=False):
    return torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), scale=scale, is_causal=causal
    )


def _dense_graph(b: int, s: int, **graph_kwargs):
    g = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT, **graph_kwargs)
    dims, strides = (b, H, s, D), (H * s * D, s * D, D, 1)
    q, k, v = (g.tensor(name=n, dim=dims, stride=strides, uid=i, device="cpu") for i, n in enumerate("qkv", 1))
    return g, q, k, v


def test_graph_is_the_frontends_context_manager_and_the_module_stays_importable():
    assert callable(cudnn.graph) and cudnn.graph.__name__ == "graph"
    assert sys.modules["cudnn_attn.graph"].Graph is cudnn.Graph
    from cudnn_attn.graph import Graph

    assert Graph is cudnn.Graph


def test_jit_and_graph_cache_build_once_per_key_and_return_uids():
    made = []

    @cudnn.jit(heur_modes=[cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    @cudnn.graph_cache(key_fn=lambda handle, b: b, maxsize=2)
    def lookup(handle, b):
        made.append(b)
        with cudnn.graph(handle, io_data_type=cudnn.data_type.FLOAT) as (g, extra):
            assert extra == [] and not g.is_built  # the block builds nothing: jit does
            dims, strides = (b, H, 16, D), (H * 16 * D, 16 * D, D, 1)
            q, k, v = (g.tensor(name=n, dim=dims, stride=strides, uid=i, device="cpu") for i, n in enumerate("qkv", 1))
            o, _ = g.sdpa(q=q, k=k, v=v, attn_scale=0.2, use_causal_mask=True, generate_stats=False)
            o.set_output(True).set_uid(10)
            return g, [q, k, v, o]

    handle = cudnn.create_handle()
    g, uids = lookup(handle, 2)
    assert uids == [1, 2, 3, 10] and g.is_built and g.get_execution_plan_count() == 1
    assert lookup(handle, 2)[0] is g and made == [2]
    lookup(handle, 3), lookup(handle, 4)  # the oldest key (2) is dropped past maxsize
    assert lookup(handle, 2)[0] is not g and made == [2, 3, 4, 2]
    q, k, v = (randn(2, H, 16, D, seed=i) for i in range(3))
    out = torch.full_like(q, float("nan"))
    g.execute({1: q, 2: k, 3: v, 10: out}, None, handle=handle)
    assert rel_err(out, _attention(q, k, v, 0.2, causal=True)) < 1e-5


def test_plan_helpers_address_the_candidates_of_a_one_node_graph():
    g, q, k, v = _dense_graph(2, 16)
    o, _ = g.sdpa(q=q, k=k, v=v, attn_scale=D**-0.5, generate_stats=False)
    assert g.get_execution_plan_count() == 0  # nothing built yet
    g.build([cudnn.heur_mode.A])
    assert g.get_execution_plan_count() == 1 and g.get_plan_name_at_index(0) == "reference"
    assert g.get_workspace_size_plan_at_index(0) == 0
    data = [randn(2, H, 16, D, seed=10 + i) for i in range(3)]
    out = torch.full_like(data[0], float("nan"))
    g.execute_plan_at_index(dict(zip((q, k, v, o), (*data, out))), None, 0)
    assert rel_err(out, _attention(*data, D**-0.5)) < 1e-5
    with pytest.raises(cudnn.ValidationError, match=r"index: 1; this graph has 1 candidate plan"):
        g.execute_plan_at_index({q: data[0], k: data[1], v: data[2], o: out}, None, 1)
    with pytest.raises(cudnn.ValidationError, match="heuristics: 'C'"):
        cudnn.pygraph().build(["C"])
    with pytest.raises(cudnn.ValidationError, match="policy: 3"):
        g.build_plans(3)


def test_plan_indices_need_a_one_node_graph():
    g, q, k, v = _dense_graph(1, 8)
    o1, _ = g.sdpa(q=q, k=k, v=v, generate_stats=False)
    g.sdpa(q=q, k=o1, v=v, generate_stats=False)
    g.build()
    with pytest.raises(cudnn.UnsupportedError, match="this graph has 2 nodes"):
        g.get_plan_name_at_index(0)


def test_a_graph_tensor_attn_scale_is_read_at_each_run_forward_and_backward():
    b, s = 2, 12
    dims = (b, H, s, D)
    fwd = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q, k, v = (fwd.tensor(name=n, dim=dims, device="cpu") for n in "qkv")
    scale = fwd.tensor(name="scale", dim=(1, 1, 1, 1), data_type=cudnn.data_type.FLOAT, is_pass_by_value=True)
    o, st = fwd.sdpa(q=q, k=k, v=v, attn_scale=scale, generate_stats=True, use_causal_mask=True)
    o.set_output(True)
    st.set_output(True)
    bwd = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    bq, bk, bv, bo, bdo = (bwd.tensor(name=n, dim=dims, device="cpu") for n in ("q", "k", "v", "o", "dO"))
    bstats = bwd.tensor(name="stats", dim=(b, H, s, 1), device="cpu")
    bscale = bwd.tensor(name="scale", dim=(1, 1, 1, 1), data_type=cudnn.data_type.FLOAT, is_pass_by_value=True)
    grads = bwd.sdpa_backward(q=bq, k=bk, v=bv, o=bo, dO=bdo, stats=bstats, attn_scale=bscale, use_causal_mask=True)
    for t in grads:
        t.set_output(True)
    fwd.build()
    bwd.build()
    assert fwd.problems[0].scale_tensor.device == "cpu" and fwd.problems[0].options.attn_scale == 1.0
    data = [randn(*dims, seed=20 + i).requires_grad_() for i in range(3)]
    grad_out = randn(*dims, seed=30)
    plain = [t.detach() for t in data]
    for value in (0.5, 0.07):
        ref = _attention(*data, value, causal=True)
        expected = torch.autograd.grad(ref, data, grad_out.double())
        out, lse = torch.full(dims, float("nan")), torch.full((b, H, s, 1), float("nan"))
        value_t = torch.full((1, 1, 1, 1), value)
        fwd.execute({q: plain[0], k: plain[1], v: plain[2], scale: value_t, o: out, st: lse})
        assert rel_err(out, ref) < 1e-5
        got = [torch.full(dims, float("nan")) for _ in range(3)]
        bwd.execute(
            {
                bq: plain[0],
                bk: plain[1],
                bv: plain[2],
                bo: out,
                bdo: grad_out,
                bstats: lse,
                bscale: value_t,
                **dict(zip(grads, got)),
            }
        )
        assert all(rel_err(g, e) < 1e-4 for g, e in zip(got, expected))


def test_a_tensor_attn_scale_must_be_one_float32_value():
    g, q, k, v = _dense_graph(1, 8)
    scale = g.tensor(name="scale", dim=(1, 2, 1, 1), data_type=cudnn.data_type.HALF, is_pass_by_value=True)
    g.sdpa(q=q, k=k, v=v, attn_scale=scale, generate_stats=False)
    with pytest.raises(cudnn.ValidationError, match=r"attn_scale: .*a tensor scale is float32 with one value"):
        g.build()


def _thd_graph(b: int, max_s_q: int, s_kv: int, **kwargs):
    """test_sdpa_thd.py's graph: packed Q and O with ragged offsets, padded BSHD K and V."""
    g = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT, **kwargs)
    q = g.tensor(name="Q", dim=(b, H, max_s_q, D), stride=(H * D, D, H * D, 1), uid=1, device="cpu")
    q.set_ragged_offset(
        g.tensor(name="q_off", dim=(b + 1, 1, 1, 1), data_type=cudnn.data_type.INT64, uid=50, device="cpu")
    )
    bshd = (s_kv * H * D, D, H * D, 1)
    k = g.tensor(name="K", dim=(b, H, s_kv, D), stride=bshd, uid=2, device="cpu")
    v = g.tensor(name="V", dim=(b, H, s_kv, D), stride=bshd, uid=3, device="cpu")
    lengths = [
        g.tensor(name=n, dim=(b, 1, 1, 1), data_type=cudnn.data_type.INT32, uid=u, device="cpu")
        for n, u in (("seq_q", 100), ("seq_kv", 101))
    ]
    o, _ = g.sdpa(
        name="sdpa_thd",
        q=q,
        k=k,
        v=v,
        attn_scale=D**-0.5,
        use_padding_mask=True,
        seq_len_q=lengths[0],
        seq_len_kv=lengths[1],
        use_causal_mask=True,
        generate_stats=False,
    )
    o.set_output(True).set_dim((b, H, max_s_q, D)).set_stride((H * D, D, H * D, 1)).set_uid(1000)
    o.set_ragged_offset(
        g.tensor(name="o_off", dim=(b + 1, 1, 1, 1), data_type=cudnn.data_type.INT64, uid=51, device="cpu")
    )
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g


@pytest.mark.parametrize("lengths_q", [[5, 16, 9], [24, 3, 20]])
def test_execute_overrides_the_geometry_of_a_thd_graph_per_run(lengths_q):
    b, s_kv, built_s_q = 3, 32, 16
    g = _thd_graph(b, built_s_q, s_kv, is_override_shape_enabled=True)
    seq_q, seq_kv = torch.tensor(lengths_q, dtype=torch.int32), torch.tensor([20, 32, 11], dtype=torch.int32)
    max_s_q = max(lengths_q)
    q = randn(sum(lengths_q), H, D, seed=40)
    k, v = (randn(b, s_kv, H, D, seed=41 + i).transpose(1, 2) for i in range(2))
    offsets = torch.tensor([0, *torch.cumsum(seq_q, 0).tolist()], dtype=torch.int64).view(-1, 1, 1, 1) * H * D
    out = torch.full_like(q, float("nan"))
    pack = {
        1: q,
        50: offsets,
        2: k,
        3: v,
        100: seq_q.view(-1, 1, 1, 1),
        101: seq_kv.view(-1, 1, 1, 1),
        1000: out,
        51: offsets,
    }
    uids = list(pack)
    shapes = [(b, H, max_s_q, D) if u in (1, 1000) else tuple(pack[u].shape) for u in uids]
    strides = [pack[u].stride() for u in uids]  # Q and O: the packed tensors' own 3-D strides, as the test passes
    g.execute(pack, None, override_uids=uids, override_shapes=shapes, override_strides=strides)
    start = 0
    for i, (n_q, n_kv) in enumerate(zip(lengths_q, seq_kv.tolist())):
        rows = slice(start, start + n_q)
        qi = q[rows].transpose(0, 1)[None]
        ki, vi = k[i : i + 1, :, :n_kv], v[i : i + 1, :, :n_kv]
        mask = torch.ones(n_q, n_kv, dtype=torch.bool).tril()  # top-left causal, as the graph asks
        want = torch.nn.functional.scaled_dot_product_attention(qi.double(), ki.double(), vi.double(), attn_mask=mask)
        assert rel_err(out[rows].transpose(0, 1)[None], want) < 1e-5, i
        start += n_q
    assert g.get_execution_plan_count() == 1


def test_overrides_are_checked_by_name():
    g = _thd_graph(2, 8, 16, is_override_shape_enabled=True)
    with pytest.raises(cudnn.ValidationError, match=r"override_uids: 7 is not a tensor of this graph"):
        g.execute({}, None, override_uids=[7], override_shapes=[(1,)], override_strides=[(1,)])
    with pytest.raises(cudnn.ValidationError, match=r"override_shapes\[1\]: \[2, 3\]; Q has 4 dims"):
        g.execute({}, None, override_uids=[1], override_shapes=[(2, 3)], override_strides=[(3, 1)])
    with pytest.raises(cudnn.ValidationError, match=r"1 uids for 2 shapes"):
        g.execute({}, None, override_uids=[1], override_shapes=[(2, 3), (1,)], override_strides=[(3, 1)])
    plain = _thd_graph(2, 8, 16)
    with pytest.raises(cudnn.ValidationError, match="without is_override_shape_enabled=True"):
        plain.execute({}, None, override_uids=[1], override_shapes=[(2, H, 9, D)], override_strides=[(H * D, D, 1)])


def test_a_packed_tensor_binds_to_a_4d_ragged_graph_tensor_and_bad_offsets_are_refused():
    """test_sdpa_with_caching.py's form: the graph is built for the longest sequence; Q and O are
    the packed [T, H, D] tensors themselves."""
    b, s_kv = 2, 16
    g = _thd_graph(b, 16, s_kv)
    seq_q, seq_kv = torch.tensor([7, 4], dtype=torch.int32), torch.tensor([16, 9], dtype=torch.int32)
    q = randn(11, H, D, seed=50)
    k, v = (randn(b, s_kv, H, D, seed=51 + i).transpose(1, 2) for i in range(2))
    offsets = torch.tensor([0, 7, 11], dtype=torch.int64).view(-1, 1, 1, 1) * H * D
    out = torch.full_like(q, float("nan"))
    pack = {
        1: q,
        50: offsets,
        2: k,
        3: v,
        100: seq_q.view(-1, 1, 1, 1),
        101: seq_kv.view(-1, 1, 1, 1),
        1000: out,
        51: offsets,
    }
    g.execute(pack, None)
    mask = torch.ones(4, 9, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(
        q[7:].transpose(0, 1)[None].double(), k[1:, :, :9].double(), v[1:, :, :9].double(), attn_mask=mask
    )
    assert rel_err(out[7:].transpose(0, 1)[None], want) < 1e-5 and not out.isnan().any()
    late = torch.tensor([0, 9, 11], dtype=torch.int64).view(-1, 1, 1, 1) * H * D  # 4 rows from row 9: past row 11
    with pytest.raises(
        cudnn.ValidationError,
        match=r"q.ragged_offset: offsets \[864\] place a sequence outside q \(1056 elements bound\)",
    ):
        g.execute({**pack, 50: late}, None)
    with pytest.raises(cudnn.ShapeMismatchError, match=r"Q: dtype torch.float16"):
        g.execute({**pack, 1: q.half()}, None)


def test_serialize_and_deserialize_run_the_same_graph_without_building_it_again():
    b, s = 2, 12
    dims = (b, H, s, D)
    g = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q, k, v, o_in, d_o = (
        g.tensor(name=n, dim=dims, uid=i, device="cpu") for i, n in enumerate(("q", "k", "v", "o", "dO"), 1)
    )
    stats = g.tensor(name="stats", dim=(b, H, s, 1), uid=6, device="cpu")
    grads = g.sdpa_backward(q=q, k=k, v=v, o=o_in, dO=d_o, stats=stats, attn_scale=0.3, use_causal_mask=True)
    for uid, t in enumerate(grads, 7):
        t.set_output(True).set_uid(uid)
    g.build()
    data = g.serialize()
    assert isinstance(data, list) and bytes(g.serialize(as_bytes=True)) == bytes(data)
    restored = cudnn.pygraph()
    restored.deserialize(cudnn.create_handle(), data)  # the frontend's (handle, data) form
    assert restored.is_built and restored.problems == g.problems
    tensors = [randn(*dims, seed=60 + i).requires_grad_() for i in range(3)]
    ref = _attention(*tensors, 0.3, causal=True)
    grad_out = randn(*dims, seed=70)
    expected = torch.autograd.grad(ref, tensors, grad_out.double())
    lse = (
        (torch.einsum("bhqd,bhkd->bhqk", *(t.detach().double() for t in tensors[:2])) * 0.3)
        .masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
        .logsumexp(-1, keepdim=True)
    )
    got = [torch.full(dims, float("nan")) for _ in range(3)]
    pack = {
        1: tensors[0].detach(),
        2: tensors[1].detach(),
        3: tensors[2].detach(),
        4: ref.detach().float(),
        5: grad_out,
        6: lse.float(),
        **dict(zip((7, 8, 9), got)),
    }
    restored.execute(pack)
    assert all(rel_err(a, e) < 1e-4 for a, e in zip(got, expected))


@pytest.mark.parametrize("shared", ["q-k-v", "lengths", "ragged-offsets"])
def test_a_graph_with_one_tensor_in_several_input_roles_round_trips(shared):
    """One tensor as q, k and v; one lengths tensor as seq_len_q and seq_len_kv; the frontend's
    THD form's one offsets tensor for Q, K, V and O: each builds and runs, and its serialized
    form was refused as damaged ("a uid is given to two of its tensors")."""
    b, s = 2, 8
    x = randn(b, H, s, D, seed=90)
    g = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    pack = {}
    if shared == "ragged-offsets":
        off = g.tensor(name="off", dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
        lens = g.tensor(name="lens", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
        stride = [s * H * D, D, H * D, 1]
        q, k, v = (g.tensor(name=n, dim=[b, H, s, D], stride=stride, ragged_offset=off) for n in "qkv")
        o, _ = g.sdpa(
            q=q, k=k, v=v, generate_stats=False, attn_scale=0.25, use_padding_mask=True, seq_len_q=lens, seq_len_kv=lens
        )
        o.set_output(True).set_stride(stride).set_ragged_offset(off)
        tokens = randn(b * s, H, D, seed=91)
        pack = {"q": tokens, "k": tokens, "v": tokens, "off": torch.tensor([0, s * H * D, 2 * s * H * D]).int()}
        pack["off"] = pack["off"].view(b + 1, 1, 1, 1)
        pack["lens"] = torch.full((b, 1, 1, 1), s, dtype=torch.int32)
        want = _attention(*(tokens.view(b, s, H, D).transpose(1, 2),) * 3, 0.25).transpose(1, 2).reshape(b * s, H, D)
        out = torch.full((b * s, H, D), float("nan"))
    else:
        q = g.tensor_like(x).set_name("q")
        lens = g.tensor_like(torch.full((b, 1, 1, 1), s, dtype=torch.int32)).set_name("lens")
        k, v = (q, q) if shared == "q-k-v" else (g.tensor_like(x).set_name("k"), g.tensor_like(x).set_name("v"))
        o, _ = g.sdpa(
            q=q, k=k, v=v, generate_stats=False, attn_scale=0.25, use_padding_mask=True, seq_len_q=lens, seq_len_kv=lens
        )
        o.set_output(True)
        pack = {"q": x, "lens": torch.full((b, 1, 1, 1), s, dtype=torch.int32)}
        if shared != "q-k-v":
            pack.update(k=x, v=x)
        want, out = _attention(x, x, x, 0.25), torch.full_like(x, float("nan"))
    o.set_name("o")
    g.build()
    restored = cudnn.pygraph()
    restored.deserialize(g.serialize())
    restored.execute({**pack, "o": out})
    assert rel_err(out, want) < 1e-4


def test_deserialize_refuses_damaged_data_and_a_graph_in_use():
    g, q, k, v = _dense_graph(1, 8)
    g.sdpa(q=q, k=k, v=v, generate_stats=False)
    data = g.serialize(as_bytes=True)
    with pytest.raises(cudnn.ValidationError, match="truncated or damaged"):
        cudnn.pygraph().deserialize(data[:-3])
    with pytest.raises(cudnn.ValidationError, match="not a graph serialized by cudnn_attn"):
        cudnn.pygraph().deserialize(b"\x00" * 16)
    with pytest.raises(cudnn.GraphStateError, match="reads into an empty graph"):
        g.deserialize(data)


FRONTEND_DEFAULTS = dict(
    block_mask=None,
    score_mod=None,
    score_max=None,
    score_sum_exp=None,
    sink_token=None,
    unfuse_fma=False,
    cu_seq_len_q=None,
    cu_seq_len_kv=None,
    stats_use_log2=False,
)


def test_the_frontends_other_sdpa_keywords_take_their_defaults_and_refuse_the_rest_by_name():
    data = [randn(1, H, 8, D, seed=80 + i) for i in range(3)]
    g, q, k, v = _dense_graph(1, 8)
    o, _ = g.sdpa(q=q, k=k, v=v, generate_stats=False, **FRONTEND_DEFAULTS)
    out = torch.empty_like(data[0])
    g.execute({q: data[0], k: data[1], v: data[2], o: out})
    assert rel_err(out, _attention(*data, 1.0)) < 1e-5  # attn_scale=None: no scaling, as the frontend
    for name, value in (("unfuse_fma", True), ("stats_use_log2", True), ("block_mask", 1)):
        g, q, k, v = _dense_graph(1, 8)
        g.sdpa(q=q, k=k, v=v, generate_stats=False, **{name: value})
        with pytest.raises(cudnn.cudnnGraphNotSupportedError, match=f"{name}: "):
            g.build()


def test_the_fp8_spellings_of_the_band_are_aliases():
    data = [randn(1, H, 16, D, seed=90 + i) for i in range(3)]
    results = []
    for keywords in ({"sliding_window": 4}, {"sliding_window_length": 4}, {"left_bound": 4, "right_bound": 0}):
        g, q, k, v = _dense_graph(1, 16)
        o, _ = g.sdpa(q=q, k=k, v=v, generate_stats=False, use_causal_mask="right_bound" not in keywords, **keywords)
        out = torch.empty_like(data[0])
        g.execute({q: data[0], k: data[1], v: data[2], o: out})
        results.append(out)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    g, q, k, v = _dense_graph(1, 16)
    g.sdpa(q=q, k=k, v=v, generate_stats=False, sliding_window=4, sliding_window_length=4)
    with pytest.raises(cudnn.ValidationError, match="sliding_window: given with its alias sliding_window_length"):
        g.build()


def test_pygraph_io_data_type_is_the_default_of_untyped_tensors_only():
    g = cudnn.pygraph(io_data_type=cudnn.data_type.HALF)  # the frontend's graph() default
    dims = (1, H, 8, D)
    q, k, v = (g.tensor(dim=dims, data_type=cudnn.data_type.BFLOAT16, device="cpu") for _ in range(3))
    untyped = g.tensor(dim=dims, device="cpu")
    assert untyped.spec.dtype == torch.float16
    o, _ = g.sdpa(q=q, k=k, v=v, generate_stats=False)
    g.build()
    assert g.problems[0].q.dtype == torch.bfloat16
    with pytest.raises(cudnn.ValidationError, match="io_data_type: float16 but q is bfloat16"):
        with cudnn.Graph(io_data_type=cudnn.data_type.HALF) as own:  # the library's own Graph: a constraint
            own.sdpa(*(torch.randn(*dims, dtype=torch.bfloat16) for _ in range(3)))
