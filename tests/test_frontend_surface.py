"""Frontend code as the frontend's own users write it, through ``import cudnn_attn as cudnn``:
tensors described with ``set_dim``, outputs left to the frontend's default layout, the pythonic
``Graph``'s canonical names and ``set_io_tuples``, the getters before the build, the ordered
``execute``, and the enums such code spells. Where the frontend can answer without a GPU, its
own answer is the expectation; results are checked against float64 attention."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err

import cudnn_attn as cudnn

B, H, S, D = 1, 2, 8, 16
SCALE = 0.25
BSHD = [S * H * D, D, H * D, 1]  # BHSD dims over [B, S, H, D] memory


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _attention(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=SCALE)


def _frontend():
    return pytest.importorskip("cudnn")


def test_set_dim_keeps_the_strides_a_tensor_was_described_with():
    """set_dim reset the strides to row-major: BSHD buffers bound by memory were read as BHSD
    (wrong by 3.2, without a word), and BSHD views were refused."""
    g = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q, k, v = (
        g.tensor(dim=[B, H, S, D], stride=BSHD, data_type=cudnn.data_type.FLOAT, name=n).set_dim([B, H, S, D])
        for n in "qkv"
    )
    assert q.get_stride() == BSHD
    o, _ = g.sdpa(q, k, v, is_inference=True, attn_scale=SCALE)
    o.set_output(True).set_dim([B, H, S, D]).set_stride(BSHD)
    g.build()
    memory = [randn(B, S, H, D, seed=i) for i in range(3)]
    out = torch.full((B, S, H, D), float("nan"))
    g.execute({q: memory[0], k: memory[1], v: memory[2], o: out})
    assert rel_err(out.transpose(1, 2), _attention(*(t.transpose(1, 2) for t in memory))) < 1e-5
    other = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT).tensor(dim=[B, H, S, D], stride=BSHD)
    assert other.set_dim([B * H, S, D]).get_stride() == [S * D, D, 1]  # another rank: row-major


def test_outputs_left_unset_take_the_frontends_packed_layout():
    """O and the gradients took q's layout (BSHD here); the frontend materializes packed BHSD,
    so a buffer allocated from get_dim(), or bound by memory, read another layout."""
    fe = _frontend()
    q_t, k_t, v_t, o_t, d_o = (randn(B, S, H, D, seed=10 + i).transpose(1, 2) for i in range(5))
    stats_t = randn(B, H, S, 1, seed=15)
    answers = {}
    for module in (fe, cudnn):
        g = module.pygraph(io_data_type=module.data_type.FLOAT)
        handles = [g.tensor_like(t) for t in (q_t, k_t, v_t)]
        o, stats = g.sdpa(*handles, generate_stats=True, attn_scale=SCALE)
        o.set_output(True)
        stats.set_output(True)
        g.validate()
        g.build_operation_graph()
        b = module.pygraph(io_data_type=module.data_type.FLOAT)
        grads = b.sdpa_backward(*(b.tensor_like(t) for t in (q_t, k_t, v_t, o_t, d_o, stats_t)), attn_scale=SCALE)
        for grad in grads:
            grad.set_output(True)
        b.validate()
        b.build_operation_graph()
        answers[module.__name__] = [t.get_stride() for t in (o, stats, *grads)]
    assert (
        answers["cudnn_attn"]
        == answers["cudnn"]
        == [[H * S * D, S * D, D, 1], [H * S, S, 1, 1]] + [[H * S * D, S * D, D, 1]] * 3
    )
    g = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    handles = [g.tensor_like(t) for t in (q_t, k_t, v_t)]
    o, _ = g.sdpa(*handles, is_inference=True, attn_scale=SCALE)
    o.set_output(True)
    g.build()
    out = torch.full(o.get_dim(), float("nan"))
    g.execute({**dict(zip(handles, (q_t, k_t, v_t))), o: out})
    assert out.is_contiguous() and rel_err(out, _attention(q_t, k_t, v_t)) < 1e-5
    with cudnn.Graph() as ours:  # the library's own Graph keeps q's layout, as documented
        ours.sdpa(q_t, k_t, v_t, attn_scale=SCALE)
    assert ours(q_t, k_t, v_t).stride() == q_t.stride()


def test_an_omitted_attn_scale_is_no_scaling_in_the_frontends_graphs():
    """The frontend's node multiplies the scores by attn_scale only where one is given (its C++
    SDPA node; its graph analyzer: "An omitted attn_scale is no scaling (1.0)"): pygraph and the
    declared Graph scaled by 1/sqrt(d), silently other results. The library's own Graph keeps
    torch's 1/sqrt(d), as documented."""
    q, k, v, d_o = (randn(B, H, S, D, seed=60 + i) for i in range(4))
    unscaled = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=1.0)
    g = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    handles = [g.tensor_like(t) for t in (q, k, v)]
    o, stats = g.sdpa(*handles, generate_stats=True)
    o.set_output(True)
    stats.set_output(True)
    out, lse = torch.empty_like(q), torch.empty(B, H, S, 1)
    g.execute({**dict(zip(handles, (q, k, v))), o: out, stats: lse})
    assert rel_err(out, unscaled) < 1e-5
    bwd = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    bound = (q, k, v, out, d_o, lse)
    inputs = [bwd.tensor_like(t) for t in bound]
    grads = bwd.sdpa_backward(*inputs)
    got = [torch.empty_like(t) for t in (q, k, v)]
    for handle in grads:
        handle.set_output(True)
    bwd.execute({**dict(zip(inputs, bound)), **dict(zip(grads, got))})
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(
        torch.nn.functional.scaled_dot_product_attention(*leaves, scale=1.0), leaves, d_o.double()
    )
    assert all(rel_err(a, b) < 1e-5 for a, b in zip(got, want))
    with cudnn.Graph(inputs=["SDPA::q", "SDPA::k", "SDPA::v"], outputs=["SDPA::O"]) as declared:
        declared.sdpa(name="SDPA", q=q, k=k, v=v, is_inference=True)
    assert rel_err(declared(q, k, v), unscaled) < 1e-5
    with cudnn.Graph() as own:
        own.sdpa(q, k, v)
    assert (
        rel_err(own(q, k, v), torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double()))
        < 1e-5
    )


def test_the_pythonic_graph_takes_the_frontends_canonical_names_and_set_io_tuples():
    q, k, v = (randn(B, H, S, D, seed=20 + i) for i in range(3))
    with cudnn.Graph(inputs=["SDPA::q", "SDPA::k", "SDPA::v"], outputs=["SDPA::O", "SDPA::Stats"]) as g:
        o, stats = g.sdpa(name="SDPA", q=q, k=k, v=v, attn_scale=SCALE, generate_stats=True)
    out, lse = g(q, k, v)
    assert rel_err(out, _attention(q, k, v)) < 1e-5 and lse.shape == (B, H, S, 1)
    with cudnn.Graph(inputs=[q, k, v], outputs=["SDPA::O"]) as by_tensor:  # the frontend's DLPack map
        by_tensor.sdpa(name="SDPA", q=q, k=k, v=v, attn_scale=SCALE, is_inference=True)
    assert rel_err(by_tensor(q, k, v), _attention(q, k, v)) < 1e-5
    with cudnn.Graph() as later:
        o, _ = later.sdpa(name="SDPA", q=q, k=k, v=v, attn_scale=SCALE, is_inference=True)
    later.set_io_tuples(["SDPA::v", "SDPA::k", "SDPA::q"], [o])  # after the build, as the frontend's docs do
    assert rel_err(later(v, k, q), _attention(q, k, v)) < 1e-5
    before = cudnn.Graph()
    with before:
        before.sdpa(name="SDPA", q=q, k=k, v=v, attn_scale=SCALE, generate_stats=True)
        before.set_io_tuples([q, k, v], ["SDPA::Stats"])
    assert before(q, k, v).shape == (B, H, S, 1)
    with pytest.raises(cudnn.ValidationError) as refused:
        with cudnn.Graph(inputs=[torch.zeros(4096), k, v], outputs=["SDPA::O"]) as bad:
            bad.sdpa(name="SDPA", q=q, k=k, v=v, attn_scale=SCALE, is_inference=True)
    assert "names no input of this graph" in str(refused.value) and len(str(refused.value)) < 200
    with pytest.raises(cudnn.ValidationError, match="set_io_tuples: inputs and outputs must be lists"):
        later.set_io_tuples("SDPA::q", [o])


def test_output_getters_answer_what_the_setters_said_before_the_build():
    fe = _frontend()
    answers = {}
    for module in (fe, cudnn):
        g = module.pygraph(io_data_type=module.data_type.HALF)
        q = g.tensor(dim=[B, H, S, D], stride=[H * S * D, S * D, D, 1], data_type=module.data_type.HALF)
        o, stats = g.sdpa(q, q, q, generate_stats=True, attn_scale=SCALE)
        o.set_output(True).set_dim([B, H, S, D]).set_stride(BSHD)
        answers[module.__name__] = (o.get_dim(), o.get_stride(), o.get_is_virtual(), stats.get_is_virtual())
        g.validate()
        answers[module.__name__] += (stats.get_is_virtual(),)
    assert answers["cudnn_attn"] == answers["cudnn"] == ([B, H, S, D], BSHD, False, True, True)


def test_execute_takes_the_ordered_form_and_ignores_a_virtual_output():
    q_t, k_t, v_t = (randn(B, H, S, D, seed=30 + i) for i in range(3))
    g = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q, k, v = (g.tensor_like(t) for t in (q_t, k_t, v_t))
    o, stats = g.sdpa(q, k, v, generate_stats=True, attn_scale=SCALE)
    o.set_output(True)  # stats never marked: virtual, under the frontend's rule
    g.build()
    out = torch.full_like(q_t, float("nan"))
    g.execute([q_t, k_t, v_t, out], None, tensor_uids=[q.get_uid(), k.get_uid(), v.get_uid(), o.get_uid()])
    assert rel_err(out, _attention(q_t, k_t, v_t)) < 1e-5
    out.fill_(float("nan"))
    g.execute({q: q_t, k: k_t, v: v_t, o: out, stats: torch.empty(B, H, S, 1)})  # unused, as in the frontend
    assert rel_err(out, _attention(q_t, k_t, v_t)) < 1e-5
    uids = [q.get_uid(), k.get_uid(), v.get_uid(), o.get_uid()]
    for pack, tensor_uids, message in (
        ({q: q_t, k: k_t, v: v_t, o: out}, uids, "variant_pack: dict beside tensor_uids"),
        ([q_t, k_t, v_t, out], [999, "junk", 3, 4], "tensor_uids: .* expected a list or tuple of tensor uids"),
        ([q_t, k_t, v_t, out], uids[:3] + uids[:1], "given more than once"),
        ([q_t, k_t, v_t], uids, "3 buffers for 4 tensor_uids"),
    ):
        with pytest.raises(cudnn.ValidationError, match=message):
            g.execute(pack, None, tensor_uids=tensor_uids)


def test_tensor_like_takes_the_frontends_keywords_and_flags():
    g = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q = g.tensor_like(torch.zeros(B, H, S, D), is_virtual=False)
    assert q.get_dim() == [B, H, S, D]
    with pytest.raises(cudnn.UnsupportedError, match="Graph.tensor_like"):
        g.tensor_like(torch.zeros(B, H, S, D), is_virtual=True)
    scale = g.tensor(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT, is_pass_by_value=True)
    assert g.tensor_like(scale).get_is_pass_by_value()


def test_a_bad_left_bound_is_named_as_given():
    q = randn(B, H, S, D, seed=40)
    for keyword in ("diagonal_band_left_bound", "sliding_window_length"):
        with pytest.raises(cudnn.ValidationError, match=f"{keyword}: 0; must be an int >= 1"):
            with cudnn.Graph() as g:
                g.sdpa(q, q, q, **{keyword: 0})


def test_the_frontends_enums_are_spelled_here_too():
    fe = _frontend()
    for name in ("cuda_graph_retention", "scalar_type"):
        assert {m.name for m in getattr(cudnn, name)} == {m for m in dir(getattr(fe, name)) if m.isupper()}
    cudnn.pygraph(cuda_graph_retention=cudnn.cuda_graph_retention.PER_GRAPH)


def test_set_dim_after_default_strides_makes_them_the_new_dims_row_major():
    """Strides that were only a default (none given) stayed, overlapping, after set_dim."""
    g = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    assert g.tensor(dim=[1, 1, 1, 1]).set_dim([B, H, S, D]).get_stride() == [H * S * D, S * D, D, 1]
    assert g.tensor(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1]).set_dim([B, H, S, D]).get_stride() == [1, 1, 1, 1]


def test_a_copy_of_a_default_strided_tensor_keeps_its_strides_a_default():
    g = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    copy = g.tensor_like(g.tensor(dim=[1, 1, 1, 1]))
    assert copy.set_dim([B, H, S, D]).get_stride() == [H * S * D, S * D, D, 1]


def test_output_getters_before_the_build_and_of_virtual_outputs_report_what_the_frontend_does():
    """The frontend infers O's and Stats' geometry as the op is recorded, and keeps reporting a
    virtual Stats' after validate(); these getters said None."""
    frontend = _frontend()
    reports = []
    for module in (frontend, cudnn):
        g = module.pygraph(io_data_type=module.data_type.HALF)
        q = g.tensor(name="q", dim=[1, 2, 4, 8], stride=[64, 8, 16, 1], data_type=module.data_type.HALF)
        v = g.tensor(name="v", dim=[1, 2, 6, 16], stride=[192, 96, 16, 1], data_type=module.data_type.HALF)
        k = g.tensor(name="k", dim=[1, 2, 6, 8], stride=[96, 48, 8, 1], data_type=module.data_type.HALF)
        o, stats = g.sdpa(name="sdpa", q=q, k=k, v=v, is_inference=False, attn_scale=0.5)
        o.set_output(True)  # Stats left virtual
        before = [o.get_dim(), o.get_stride(), stats.get_dim(), stats.get_stride()]
        g.validate()
        reports.append((before, stats.get_dim(), stats.get_stride(), stats.get_is_virtual()))
    assert (
        reports[1]
        == reports[0]
        == ([[1, 2, 4, 16], [128, 64, 16, 1], [1, 2, 4, 1], [8, 4, 1, 1]], [1, 2, 4, 1], [8, 4, 1, 1], True)
    )


def test_get_data_type_answers_the_frontends_members_in_its_graphs():
    """Frontend code compares ``t.get_data_type()`` with ``cudnn.data_type.HALF`` or keys a dict
    by it: a pygraph answered torch dtypes, so the comparison was False. The library's own Graph
    keeps torch's dtypes."""
    g = cudnn.pygraph(io_data_type=cudnn.data_type.HALF)
    q = g.tensor(name="q", dim=[1, 2, 8, 16], stride=[256, 128, 16, 1])
    o, stats = g.sdpa(q=q, k=q, v=q, generate_stats=True, attn_scale=0.25)
    before = [t.get_data_type() for t in (q, o, stats)]
    g.validate()
    after = [t.get_data_type() for t in (q, o, stats)]
    half, single = cudnn.data_type.HALF, cudnn.data_type.FLOAT
    assert before == after == [half, half, single]
    assert {half: torch.float16}[q.get_data_type()] is torch.float16
    x = torch.randn(1, 2, 8, 16)
    with cudnn.Graph() as own:
        out, _ = own.sdpa(x, x, x)
    assert out.get_data_type() is torch.float32
