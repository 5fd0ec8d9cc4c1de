"""The Graph API as users meet it: building, binding inputs, outputs, handles, interop."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import randn, rel_err

import cudnn_attn
import cudnn_attn as cudnn
from cudnn_attn import GraphStateError, ShapeMismatchError, ValidationError


@pytest.fixture
def qkv():
    gen = torch.Generator().manual_seed(0)
    return tuple(randn(2, 4, 16, 32, dtype=torch.float16, generator=gen) for _ in range(3))


def test_frontend_spelling_works_as_a_drop_in(qkv):
    q, k, v = qkv
    handle = cudnn.create_handle()
    with cudnn.Graph(
        io_data_type=cudnn.data_type.HALF,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
    ) as g:
        o, stats = g.sdpa(q=q, k=k, v=v, attn_scale=0.2, is_inference=False, generate_stats=True, use_causal_mask=True)
        o.set_output(True).set_dim(q.shape).set_stride(q.stride())
        stats.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    out, lse = g(q, k, v, handle=handle)
    cudnn.destroy_handle(handle)
    assert out.shape == q.shape and lse.shape == (2, 4, 16, 1) and lse.dtype == torch.float32
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True, scale=0.2
    )
    assert rel_err(out, expected) < 1e-3


def test_empty_graph_builds_with_no_arguments(qkv):
    with cudnn_attn.Graph() as g:
        o, stats = g.sdpa(*qkv)
    assert stats is None  # stats are generated only on request
    assert isinstance(g(*qkv), torch.Tensor)


def test_io_data_type_accepts_torch_dtypes_and_strings(qkv):
    for io in (torch.float16, "half", cudnn_attn.data_type.HALF, None):
        with cudnn_attn.Graph(io_data_type=io) as g:
            g.sdpa(*qkv)
        assert g.problems[0].q.dtype == torch.float16


def test_a_tensor_given_twice_is_one_input():
    x = randn(1, 2, 8, 32, dtype=torch.float16)
    with cudnn_attn.Graph() as g:
        g.sdpa(x, x, x)
    assert [h.name for h in g.inputs] == ["q"]
    out = g(x)
    expected = torch.nn.functional.scaled_dot_product_attention(x.double(), x.double(), x.double())
    assert rel_err(out, expected) < 1e-3


def test_inputs_by_name_and_by_handle(qkv):
    q, k, v = qkv
    with cudnn_attn.Graph() as g:
        g.sdpa(q, k, v)
    by_position = g(q, k, v)
    assert torch.equal(g({"q": q, "k": k, "v": v}), by_position)
    assert torch.equal(g(dict(zip(g.inputs, (q, k, v)))), by_position)


def test_run_with_other_data_of_the_same_geometry(qkv):
    q, k, v = qkv
    with cudnn_attn.Graph() as g:
        g.sdpa(q, k, v)
    q2, k2, v2 = (randn(*q.shape, dtype=q.dtype) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q2.double(), k2.double(), v2.double())
    assert rel_err(g(q2, k2, v2), expected) < 1e-3


def test_mismatched_inputs_raise_shape_mismatch_naming_each_input(qkv):
    q, k, v = qkv
    with cudnn_attn.Graph() as g:
        g.sdpa(q, k, v)
    with pytest.raises(ShapeMismatchError) as info:
        g(randn(2, 4, 17, 32, dtype=torch.float16), k, v.to(torch.bfloat16))
    text = str(info.value)
    assert "q: shape [2, 4, 17, 32]" in text and "v: dtype torch.bfloat16" in text
    with pytest.raises(ShapeMismatchError, match="k: strides"):
        g(q, randn(2, 16, 4, 32, dtype=torch.float16).transpose(1, 2), v)
    with pytest.raises(ShapeMismatchError, match=r"^inputs: 2 given; this graph takes 3: q, k, v$"):
        g(q, k)
    with pytest.raises(ShapeMismatchError, match="not an input"):
        g({"q": q, "k": k, "value": v})


def test_size_one_dims_ignore_strides():
    q = randn(1, 1, 8, 32, dtype=torch.float16)
    with cudnn_attn.Graph() as g:
        g.sdpa(q, q, q)
    other = randn(1, 8, 1, 32, dtype=torch.float16).transpose(1, 2)  # same memory order, other size-1 stride
    assert other.stride() != q.stride()
    g(other)


def test_out_tensors_are_written_in_place(qkv):
    q, k, v = qkv
    with cudnn_attn.Graph() as g:
        o, stats = g.sdpa(q, k, v, generate_stats=True)
    o_buf, s_buf = torch.full(q.shape, float("nan"), dtype=q.dtype), torch.full((2, 4, 16, 1), float("nan"))
    got = g(q, k, v, out=(o_buf, s_buf))
    assert got[0] is o_buf and got[1] is s_buf and not o_buf.isnan().any()
    named = g(q, k, v, out={"O": torch.empty_like(o_buf)})
    assert torch.equal(named[0], o_buf)
    with pytest.raises(ShapeMismatchError, match="out"):
        g(q, k, v, out=(o_buf,))


def test_output_layout_follows_q_and_set_stride(qkv):
    q = randn(2, 16, 4, 32, dtype=torch.float16).transpose(1, 2)  # BSHD
    k, v = q.clone(), q.clone()
    with cudnn_attn.Graph() as g:
        o, _ = g.sdpa(q, k, v)
    assert g.problems[0].layout == "BSHD" and o.get_stride() == list(q.stride())
    with cudnn_attn.Graph() as g2:
        o2, _ = g2.sdpa(q, k, v)
        o2.set_stride((2048, 512, 32, 1))  # BHSD output from BSHD input
    out = g2(q, k, v)
    assert out.stride() == (2048, 512, 32, 1)
    assert torch.equal(out, g(q, k, v))


def test_set_data_type_and_name_chain(qkv):
    q, k, v = qkv
    with cudnn_attn.Graph() as g:
        o, _ = g.sdpa(q, k, v)
        assert o.set_name("attn_out").set_output(True) is o
    assert o.name == "attn_out" and o.shape == (2, 4, 16, 32)
    with pytest.raises(GraphStateError):
        o.set_dim((1, 1, 1, 1))


def test_ops_after_build_and_empty_graphs_are_refused(qkv):
    with cudnn_attn.Graph() as g:
        g.sdpa(*qkv)
    with pytest.raises(GraphStateError):
        g.sdpa(*qkv)
    with pytest.raises(cudnn_attn.ValidationError, match="no ops"):
        with cudnn_attn.Graph():
            pass


def test_an_exception_inside_the_block_skips_the_build(qkv):
    with pytest.raises(KeyError):
        with cudnn_attn.Graph() as g:
            g.sdpa(*qkv)
            raise KeyError("user code failed")
    assert not g.is_built


def test_graph_without_with_block_builds_on_first_call(qkv):
    g = cudnn_attn.Graph()
    g.sdpa(*qkv)
    assert not g.is_built
    g(*qkv)
    assert g.is_built


def test_frontend_tensor_descriptors_and_variant_pack(qkv):
    q, k, v = qkv
    g = cudnn.pygraph(io_data_type=cudnn.data_type.HALF)
    q_t = g.tensor(name="Q", dim=q.shape, stride=q.stride(), data_type=cudnn.data_type.HALF, device="cpu")
    k_t, v_t = g.tensor_like(k), g.tensor_like(v, name="V")
    o_t, _ = g.sdpa(q_t, k_t, v_t, is_inference=True)
    g.validate()
    g.build_operation_graph()
    with pytest.raises(ValidationError, match=r"heuristics: <data_type.HALF.*expected heur_mode members"):
        g.create_execution_plans([cudnn.data_type.HALF])
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans(cudnn.build_plan_policy.ALL)
    assert g.get_workspace_size() == 0
    out = torch.empty_like(q)
    g.execute({q_t: q, k_t: k, v_t: v, o_t: out}, None)
    assert torch.equal(out, g(q, k, v))
    assert [h.name for h in g.inputs] == ["Q", "tensor", "V"]


def test_numpy_arrays_through_dlpack_come_back_as_numpy():
    q = np.random.default_rng(0).standard_normal((1, 2, 8, 32)).astype(np.float16)
    with cudnn_attn.Graph() as g:
        g.sdpa(q, q, q)
    out = g(q)
    assert isinstance(out, np.ndarray) and out.shape == q.shape and out.dtype == np.float16
    expected = torch.nn.functional.scaled_dot_product_attention(*(torch.from_numpy(q).double(),) * 3)
    assert rel_err(torch.from_numpy(out), expected) < 1e-3


def test_repr_and_problem_description(qkv):
    with cudnn_attn.Graph(name="layer0") as g:
        g.sdpa(*qkv, use_causal_mask=True)
    assert "layer0" in repr(g) and "causal-top_left" in repr(g)
    assert g.problems[0].describe() == "sdpa-BHSD-float16-b2-h4-s16-d32-causal-top_left"


def test_a_built_graph_does_not_keep_its_templates_alive():
    import gc
    import weakref

    q = randn(1, 2, 8, 32, dtype=torch.float16)
    ref = weakref.ref(q)
    with cudnn_attn.Graph() as g:
        g.sdpa(q, q, q)
    del q
    gc.collect()
    assert ref() is None and g.is_built
