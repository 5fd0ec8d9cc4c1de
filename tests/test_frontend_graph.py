"""The frontend's graph surface through ``import cudnn_attn as cudnn``: pygraph's constructor,
``tensor()``, uids, variant packs keyed by handle, name or uid, the output rule of ``pygraph``,
caller-made ``dBias``. Results are checked against the reference math on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err

import cudnn_attn as cudnn

B, H, S, D = 2, 3, 16, 32


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _attention(q, k, v, scale):
    return torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=scale)


def _qkv(seed: int = 0):
    return [randn(B, H, S, D, seed=seed * 3 + i) for i in range(3)]


def test_pygraph_takes_the_frontends_positional_constructor():
    g = cudnn.pygraph("g", cudnn.data_type.FLOAT, cudnn.data_type.FLOAT, cudnn.data_type.FLOAT, None, 132, 90)
    assert g.name == "g" and g.sm_count == 132 and g.sm_version == 90
    cudnn.pygraph(is_override_shape_enabled=True, is_dynamic_shape_enabled=True, is_cuda_graph_replay_expected=True)
    with pytest.raises(cudnn.ValidationError, match="sm_version"):
        cudnn.pygraph(sm_version="sm90")
    with pytest.raises(cudnn.ValidationError, match="not a parameter of pygraph"):
        cudnn.pygraph(flavour=1)
    with pytest.raises(cudnn.UnsupportedError, match="device_property"):
        cudnn.pygraph(device_property=object())


def test_tensor_takes_the_frontends_signature_and_uids_key_the_variant_pack():
    q, k, v = _qkv(1)
    g = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q_t = g.tensor(list(q.shape), list(q.stride()), uid=7, name="q", device="cpu")  # dtype from io_data_type
    k_t = g.tensor(list(k.shape), device="cpu")  # row-major strides
    v_t = g.tensor(dim=list(v.shape), data_type=torch.float32, device="cpu").set_uid(9)
    o, _ = g.sdpa(q_t, k_t, v_t, is_inference=True, attn_scale=0.125)
    o.set_output(True).set_uid(11)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.build_plans()
    out = torch.full((B, H, S, D), float("nan"))
    g.execute({7: q, k_t.get_uid(): k, 9: v, 11: out, None: q})  # a None key is ignored, as in the frontend
    expected = _attention(q, k, v, 0.125)
    assert rel_err(out, expected) < 1e-5
    assert q_t.get_uid() == 7 and len({q_t.get_uid(), k_t.get_uid(), v_t.get_uid(), o.get_uid()}) == 4
    other = cudnn.pygraph()
    other.tensor([1, 1, 1, 1], data_type=torch.float32, uid=3, device="cpu")
    with pytest.raises(cudnn.ValidationError, match="already the uid"):
        other.tensor([1, 1, 1, 1], data_type=torch.float32, device="cpu").set_uid(3)


def test_pygraph_outputs_are_virtual_until_marked_and_graph_outputs_are_not():
    q, k, v = _qkv(2)
    g = cudnn.pygraph()
    o, stats = g.sdpa(g.tensor_like(q), g.tensor_like(k), g.tensor_like(v), is_inference=False, attn_scale=D**-0.5)
    o.set_output(True)  # stats never marked: virtual, not produced, not in the pack
    g.build()
    assert [h.name for h in g.outputs] == [o.name] and g.problems[0].stats is None
    out = torch.empty(B, H, S, D)
    g.execute({g.inputs[0]: q, g.inputs[1]: k, g.inputs[2]: v, o: out})
    assert rel_err(out, _attention(q, k, v, D**-0.5)) < 1e-5
    with cudnn.Graph() as ours:  # the library's own Graph produces every output unless told otherwise
        o2, s2 = ours.sdpa(q, k, v, generate_stats=True)
        o2.set_output(True)
    assert len(ours(q, k, v)) == 2


def test_caller_made_dbias_receives_the_bias_gradient():
    q, k, v = _qkv(3)
    bias = randn(1, H, S, S, seed=40)
    d_out = randn(B, H, S, D, seed=50)
    with cudnn.Graph() as fwd:
        fwd.sdpa(q, k, v, bias=bias, generate_stats=True)
    out, stats = fwd(q, k, v, bias)
    d_bias = torch.full((1, H, S, S), float("nan"))
    g = cudnn.pygraph()
    handles = [g.tensor_like(t) for t in (q, k, v, out, d_out, stats, bias)]
    d_bias_t = g.tensor_like(d_bias)
    dq, dk, dv = g.sdpa_backward(*handles[:6], bias=handles[6], dBias=d_bias_t, attn_scale=D**-0.5)
    for t in (dq, dk, dv):
        t.set_output(True)
    grads = [torch.empty(B, H, S, D) for _ in range(3)]
    g.execute(
        {
            **dict(zip(handles, (q, k, v, out, d_out, stats, bias))),
            dq: grads[0],
            dk: grads[1],
            dv: grads[2],
            d_bias_t: d_bias,
        }
    )
    with cudnn.Graph() as ours:
        ours.sdpa_backward(q, k, v, out, d_out, stats, bias=bias, bias_grad=True)
    expected = ours(q, k, v, out, d_out, stats, bias)
    for got, want in zip((*grads, d_bias), expected):
        assert rel_err(got, want) < 1e-5


def test_rng_dump_receives_the_keep_mask_the_output_was_computed_with():
    """The frontend's tests rebuild dropout attention from rng_dump: the mask written must be the
    one the output used (on the reference backend, its own draws)."""
    q, k, v = _qkv(6)
    p, scale = 0.3, D**-0.5
    seed, offset = torch.tensor([123], dtype=torch.int64), torch.tensor([7], dtype=torch.int64)
    dump = torch.full((B, H, S, S), float("nan"))
    g = cudnn.pygraph()
    handles = [g.tensor_like(t) for t in (q, k, v, seed, offset)]
    dump_t = g.tensor_like(dump)
    o, _ = g.sdpa(
        *handles[:3], attn_scale=scale, dropout=(p, handles[3], handles[4]), rng_dump=dump_t, is_inference=True
    )
    o.set_output(True)
    out = torch.empty(B, H, S, D)
    g.execute({**dict(zip(handles, (q, k, v, seed, offset))), o: out, dump_t: dump})
    assert set(dump.unique().tolist()) == {0.0, 1.0}
    attention = torch.softmax(q.double() @ k.double().transpose(-1, -2) * scale, -1)
    expected = (attention * dump.double() / (1 - p)) @ v.double()
    assert rel_err(out, expected) < 1e-5


def test_the_pythonic_graph_runs_declared_inputs_and_outputs_by_name():
    """Notebooks 50 and 51's ``cudnn.Graph(inputs=[...], outputs=[...])`` form, on CPU tensors."""
    q, k, v = _qkv(7)
    scale = D**-0.5
    with cudnn.Graph(
        io_data_type=cudnn.data_type.FLOAT,
        inputs=["SDPA::q", "SDPA::k", "SDPA::v"],
        outputs=["attn_output", "stats"],
        workspace_alloc=False,
    ) as fwd:
        o, stats = fwd.sdpa(name="SDPA", q=q, k=k, v=v, attn_scale=scale, generate_stats=True, use_causal_mask=True)
        o.set_output(True).set_name("attn_output").set_dim(q.shape).set_stride(q.stride())
        stats.set_output(True).set_name("stats").set_data_type(cudnn.data_type.FLOAT)
    out, lse = fwd(q, k, v)
    expected = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert rel_err(out, expected) < 1e-5 and lse.shape == (B, H, S, 1)
    d_out = randn(B, H, S, D, seed=70)
    names = ["d_sdpa::q", "d_sdpa::k", "d_sdpa::v", "d_sdpa::o", "d_sdpa::stats", "d_sdpa::dO"]
    with cudnn.Graph(inputs=names, outputs=["dQ", "dK", "dV"]) as bwd:  # the frontend's order: o, stats, dO
        grads = bwd.sdpa_backward(
            name="d_sdpa", q=q, k=k, v=v, o=out, dO=d_out, stats=lse, attn_scale=scale, use_causal_mask=True
        )
        for g, name in zip(grads, ("dQ", "dK", "dV")):
            g.set_output(True).set_name(name)
    d_q, d_k, d_v = bwd(q, k, v, out, lse, d_out)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True).backward(d_out.double())
    for got, leaf in zip((d_q, d_k, d_v), leaves):
        assert rel_err(got, leaf.grad) < 1e-5
    by_name = bwd(
        {"d_sdpa::q": q, "d_sdpa::k": k, "d_sdpa::v": v, "d_sdpa::o": out, "d_sdpa::stats": lse, "d_sdpa::dO": d_out}
    )
    assert set(by_name) >= {"dQ", "dK", "dV"} and torch.equal(by_name["dQ"], d_q)


def test_bad_frontend_input_is_refused_by_name():
    q, k, v = _qkv(8)
    with pytest.raises(cudnn.ValidationError, match="inputs: 'SDPA::x' names no input"):
        with cudnn.Graph(inputs=["SDPA::q", "SDPA::x"], outputs=["O"]) as g:
            g.sdpa(name="SDPA", q=q, k=k, v=v)
    g = cudnn.pygraph()
    with pytest.raises(cudnn.UnsupportedError, match="is_virtual"):
        g.tensor([1, 1, 1, 1], data_type=torch.float32, is_virtual=True, device="cpu")
    with pytest.raises(cudnn.ValidationError, match="set_ragged_offset: Tensor; expected a tensor of this graph"):
        g.tensor_like(q).set_ragged_offset(torch.zeros(B + 1, 1, 1, 1, dtype=torch.int32))
    with pytest.raises(cudnn.UnsupportedError, match="ragged_offset_multiplier"):
        g.tensor([B, H, S, D], data_type=torch.float32, device="cpu", ragged_offset_multiplier=2)
    with pytest.raises(cudnn.ValidationError, match="rng_dump"):
        with cudnn.Graph() as bad:
            bad.sdpa(q, k, v, rng_dump=torch.empty(B, H, S, S + 1))
    with pytest.raises(cudnn.ValidationError, match="dBias"):
        with cudnn.Graph() as bad:
            bad.sdpa_backward(q, k, v, q, q, torch.zeros(B, H, S, 1), dBias="not a tensor")
    with pytest.raises(cudnn.ShapeMismatchError, match="'nope'"):
        with cudnn.pygraph() as ok:
            ok.sdpa(q, k, v)
        ok.execute({"nope": q})


def test_a_paged_v_cache_has_its_own_pages_heads_and_head_dim():
    """test_mhas's paged cases: V's cache and page table are its own (MLA-like: 1 V head, a small d_v)."""
    gen = torch.Generator().manual_seed(21)
    b, h_q, h_k, h_v, d_qk, d_v, page, s_kv = 2, 4, 2, 1, 64, 16, 8, 32
    q = torch.randn(b, h_q, 3, d_qk, generator=gen).half()
    k = torch.randn(b, h_k, s_kv, d_qk, generator=gen).half()
    v = torch.randn(b, h_v, s_kv, d_v, generator=gen).half()
    n = s_kv // page
    k_cache = k.view(b, h_k, n, page, d_qk).permute(0, 2, 1, 3, 4).reshape(b * n, h_k, page, d_qk)
    v_cache = torch.cat(
        [
            torch.zeros(3, h_v, page, d_v).half(),  # V's pages sit elsewhere than K's
            v.view(b, h_v, n, page, d_v).permute(0, 2, 1, 3, 4).reshape(b * n, h_v, page, d_v),
        ]
    )
    table_k = torch.arange(b * n, dtype=torch.int32).view(b, 1, n, 1)
    table_v = table_k + 3
    lengths = torch.tensor([32, 19], dtype=torch.int32).view(-1, 1, 1, 1)
    ones = torch.full((b, 1, 1, 1), 3, dtype=torch.int32)
    g = cudnn.pygraph(io_data_type=cudnn.data_type.HALF)
    o, _ = g.sdpa(
        q=q,
        k=k_cache,
        v=v_cache,
        is_inference=True,
        attn_scale=k.shape[-1] ** -0.5,
        use_padding_mask=True,
        seq_len_q=ones,
        seq_len_kv=lengths,
        paged_attention_k_table=table_k,
        paged_attention_v_table=table_v,
        paged_attention_max_seq_len_kv=s_kv,
    )
    out = torch.full((b, h_q, 3, d_v), float("nan")).half()
    g.execute(
        {
            "q": q,
            "k": k_cache,
            "v": v_cache,
            "paged_attention_k_table": table_k,
            "paged_attention_v_table": table_v,
            "seq_len_q": ones,
            "seq_len_kv": lengths,
            o: out,
        }
    )
    mask = torch.arange(s_kv).view(1, 1, 1, -1) < lengths.view(-1, 1, 1, 1)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(4, 1), attn_mask=mask
    )
    assert rel_err(out, expected) < 2e-3


@pytest.mark.parametrize(
    "bounds", [dict(diagonal_band_right_bound=1), dict(diagonal_band_left_bound=3, diagonal_band_right_bound=1)]
)
def test_a_bottom_right_band_leaving_the_first_rows_without_keys_is_refused_as_the_frontend_refuses_it(bounds):
    """S_q > S_kv with a right bound on the bottom-right diagonal and no padding: the frontend's
    validate() refuses it as it refuses bottom-right causal; it ran here, its first rows zeros."""

    def build(module):
        g = module.pygraph(io_data_type=module.data_type.HALF)
        q = g.tensor(name="q", dim=[1, 1, 7, 8], stride=[56, 56, 8, 1], data_type=module.data_type.HALF)
        k = g.tensor(name="k", dim=[1, 1, 3, 8], stride=[24, 24, 8, 1], data_type=module.data_type.HALF)
        o, _ = g.sdpa(
            name="sdpa",
            q=q,
            k=k,
            v=k,
            is_inference=True,
            attn_scale=0.5,
            diagonal_alignment=module.diagonal_alignment.BOTTOM_RIGHT,
            **bounds,
        )
        o.set_output(True)
        g.validate()

    frontend = pytest.importorskip("cudnn")
    with pytest.raises(frontend.cudnnGraphNotSupportedError, match="max_s_q > max_s_kv"):
        build(frontend)
    with pytest.raises(
        cudnn.UnsupportedError, match="diagonal_band_right_bound: on the bottom-right diagonal with S_q=7 > S_kv=3"
    ):
        build(cudnn)
