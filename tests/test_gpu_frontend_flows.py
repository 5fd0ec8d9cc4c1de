"""The cuDNN frontend tutorial's flows, written the frontend's way, through
``import cudnn_attn as cudnn``: the drop-in promise, checked against torch."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import rel_err

import cudnn_attn as cudnn

pytestmark = pytest.mark.gpu

B, H, S, D = 4, 12, 1024, 64
TOL = 8e-3  # fp16 outputs against a float32 torch computation


def torch_ref(q, k, v, **kwargs):
    return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs)


def build_and_run(graph, variant_pack):
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    workspace = torch.empty(graph.get_workspace_size(), device="cuda", dtype=torch.uint8)
    graph.execute(variant_pack, workspace, handle=HANDLE)
    torch.cuda.synchronize()


HANDLE = None


@pytest.fixture(autouse=True)
def handle():
    global HANDLE
    HANDLE = cudnn.create_handle()
    yield
    cudnn.destroy_handle(HANDLE)


def new_graph():
    return cudnn.pygraph(
        io_data_type=cudnn.data_type.HALF,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
    )


def qkv(h_kv=H, layout="BHSD"):
    def make(heads):
        if layout == "BSHD":
            return torch.randn(B, S, heads, D, device="cuda", dtype=torch.half).transpose(1, 2)
        return torch.randn(B, heads, S, D, device="cuda", dtype=torch.half)

    return make(H), make(h_kv), make(h_kv)


@pytest.mark.parametrize(
    "flow",
    ["basic", "causal", "bshd", "gqa", "mqa", "bias", "alibi"],
)
def test_inference_flows(flow):
    h_kv = {"gqa": 4, "mqa": 1}.get(flow, H)
    q_gpu, k_gpu, v_gpu = qkv(h_kv, "BSHD" if flow == "bshd" else "BHSD")
    o_gpu = torch.empty_like(q_gpu)
    graph = new_graph()
    q, k, v = graph.tensor_like(q_gpu), graph.tensor_like(k_gpu), graph.tensor_like(v_gpu)
    extra, pack, ref = {}, {}, {}
    if flow == "bias":
        bias_gpu = torch.randn(1, H, S, S, device="cuda", dtype=torch.half)
        extra["bias"] = graph.tensor_like(bias_gpu)
        pack[extra["bias"]] = bias_gpu
        ref["attn_mask"] = bias_gpu.float()
    if flow in ("causal", "alibi"):
        extra["use_causal_mask"] = True
    if flow == "alibi":
        extra["use_alibi_mask"] = True
    o, _ = graph.sdpa(name="sdpa", q=q, k=k, v=v, is_inference=True, attn_scale=1 / math.sqrt(D), **extra)
    o.set_output(True).set_dim(o_gpu.size()).set_stride(o_gpu.stride())
    build_and_run(graph, {q: q_gpu, k: k_gpu, v: v_gpu, o: o_gpu, **pack})
    if flow == "alibi":
        n = 8
        slopes = torch.tensor(
            [2 ** (-8 * (i + 1) / n) for i in range(n)] + [2 ** (-4 * (2 * i + 1) / n) for i in range(H - n)],
            device="cuda",
        )
        distance = torch.arange(S, device="cuda").view(1, -1) - torch.arange(S, device="cuda").view(-1, 1)
        causal = torch.ones(S, S, dtype=torch.bool, device="cuda").tril()
        ref["attn_mask"] = (slopes.view(1, H, 1, 1) * distance).masked_fill(~causal, float("-inf"))
    expected = torch_ref(q_gpu, k_gpu, v_gpu, is_causal=flow == "causal", enable_gqa=h_kv != H, **ref)
    assert rel_err(o_gpu, expected) < TOL


def test_training_forward_and_backward_flow():
    q_gpu, k_gpu, v_gpu = qkv()
    d_o_gpu = torch.randn_like(q_gpu)
    o_gpu, stats_gpu = torch.empty_like(q_gpu), torch.empty(B, H, S, 1, device="cuda", dtype=torch.float32)
    graph = new_graph()
    q, k, v = graph.tensor_like(q_gpu), graph.tensor_like(k_gpu), graph.tensor_like(v_gpu)
    o, stats = graph.sdpa(
        name="sdpa", q=q, k=k, v=v, is_inference=False, attn_scale=1 / math.sqrt(D), use_causal_mask=True
    )
    o.set_output(True).set_dim(o_gpu.size()).set_stride(o_gpu.stride())
    stats.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    build_and_run(graph, {q: q_gpu, k: k_gpu, v: v_gpu, o: o_gpu, stats: stats_gpu})

    bwd = new_graph()
    tensors = {
        name: bwd.tensor_like(t)
        for name, t in (("q", q_gpu), ("k", k_gpu), ("v", v_gpu), ("o", o_gpu), ("dO", d_o_gpu), ("stats", stats_gpu))
    }
    dq, dk, dv = bwd.sdpa_backward(
        name="sdpa_backward",
        q=tensors["q"],
        k=tensors["k"],
        v=tensors["v"],
        o=tensors["o"],
        dO=tensors["dO"],
        stats=tensors["stats"],
        attn_scale=1 / math.sqrt(D),
        use_causal_mask=True,
    )
    grads = [torch.empty_like(x) for x in (q_gpu, k_gpu, v_gpu)]
    for handle, g in zip((dq, dk, dv), grads):
        handle.set_output(True).set_dim(g.size()).set_stride(g.stride())
    pack = {
        tensors[n]: t
        for n, t in (("q", q_gpu), ("k", k_gpu), ("v", v_gpu), ("o", o_gpu), ("dO", d_o_gpu), ("stats", stats_gpu))
    }
    build_and_run(bwd, {**pack, dq: grads[0], dk: grads[1], dv: grads[2]})
    leaves = [x.detach().float().requires_grad_() for x in (q_gpu, k_gpu, v_gpu)]
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
    out.backward(d_o_gpu.float())
    assert rel_err(o_gpu, out) < TOL
    for g, leaf in zip(grads, leaves):
        assert rel_err(g, leaf.grad) < 2 * TOL


def test_dropout_flow_with_host_seed_and_offset():
    q_gpu, k_gpu, v_gpu = qkv()
    seed = torch.full((1, 1, 1, 1), 123456, dtype=torch.int64)
    offset = torch.full((1, 1, 1, 1), 1, dtype=torch.int64)
    outs = []
    for _ in range(2):
        graph = new_graph()
        q, k, v = graph.tensor_like(q_gpu), graph.tensor_like(k_gpu), graph.tensor_like(v_gpu)
        o, _ = graph.sdpa(
            name="sdpa",
            q=q,
            k=k,
            v=v,
            is_inference=True,
            attn_scale=1 / math.sqrt(D),
            dropout=(0.1, graph.tensor_like(seed), graph.tensor_like(offset)),
        )
        o_gpu = torch.empty_like(q_gpu)
        o.set_output(True).set_dim(o_gpu.size()).set_stride(o_gpu.stride())
        graph.build()
        outs.append(graph(q_gpu, k_gpu, v_gpu, seed, offset))
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1])  # same seed and offset, same mask
    no_dropout = torch_ref(q_gpu, k_gpu, v_gpu)
    assert 0.05 < rel_err(outs[0], no_dropout) < 1.0  # dropout changed the result, but not wildly


def test_paged_cache_flow():
    block, blocks_per_seq, h_kv = 64, S // 64, 4
    q_gpu = torch.randn(B, H, 1, D, device="cuda", dtype=torch.half)
    k_dense, v_dense = (torch.randn(B, h_kv, S, D, device="cuda", dtype=torch.half) for _ in range(2))
    # The frontend's container layout: [num_blocks, H_kv, block_size, D].
    k_container = (
        k_dense.view(B, h_kv, blocks_per_seq, block, D).permute(0, 2, 1, 3, 4).reshape(-1, h_kv, block, D).contiguous()
    )
    v_container = (
        v_dense.view(B, h_kv, blocks_per_seq, block, D).permute(0, 2, 1, 3, 4).reshape(-1, h_kv, block, D).contiguous()
    )
    table = torch.arange(B * blocks_per_seq, device="cuda", dtype=torch.int32).view(B, 1, blocks_per_seq, 1)
    seq_q = torch.ones(B, 1, 1, 1, device="cuda", dtype=torch.int32)
    seq_kv = torch.full((B, 1, 1, 1), S, device="cuda", dtype=torch.int32)
    graph = new_graph()
    q, k, v = graph.tensor_like(q_gpu), graph.tensor_like(k_container), graph.tensor_like(v_container)
    table_t = graph.tensor_like(table)
    sq, skv = graph.tensor_like(seq_q), graph.tensor_like(seq_kv)
    o, _ = graph.sdpa(
        name="sdpa",
        q=q,
        k=k,
        v=v,
        is_inference=True,
        attn_scale=1 / math.sqrt(D),
        use_padding_mask=True,
        seq_len_q=sq,
        seq_len_kv=skv,
        paged_attention_k_table=table_t,
        paged_attention_v_table=table_t,
        paged_attention_max_seq_len_kv=S,
        kv_cache_layout="NHPD",
    )
    o_gpu = torch.empty_like(q_gpu)
    o.set_output(True).set_dim(o_gpu.size()).set_stride(o_gpu.stride())
    build_and_run(graph, {q: q_gpu, k: k_container, v: v_container, table_t: table, sq: seq_q, skv: seq_kv, o: o_gpu})
    expected = torch_ref(q_gpu, k_dense, v_dense, enable_gqa=True)
    assert rel_err(o_gpu, expected) < TOL


def test_attention_layer_class():
    torch.manual_seed(0)
    layer = cudnn.nn.Attention(768, H, num_kv_heads=4, causal=True, device="cuda", dtype=torch.half)
    x = torch.randn(B, 256, 768, device="cuda", dtype=torch.half, requires_grad=True)
    y = layer(x)
    y.float().square().mean().backward()
    b, s, _ = x.shape
    qkv = layer.qkv(x.detach()).view(b, s, H + 8, D)
    q, k, v = (t.transpose(1, 2) for t in qkv.split([H, 4, 4], dim=2))
    o = torch_ref(q, k, v, is_causal=True, enable_gqa=True).half()
    expected = layer.out(o.transpose(1, 2).reshape(b, s, H * D))
    assert rel_err(y, expected) < TOL
    assert layer.qkv.weight.grad is not None and torch.isfinite(layer.qkv.weight.grad).all()


def test_rng_dump_on_cudnn_is_the_keep_mask_its_output_used():
    """As the frontend's tests do: rebuild dropout attention from cuDNN's own rng_dump."""
    gen = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(2, 4, 128, 64, generator=gen).to("cuda", torch.float16) for _ in range(3))
    p, scale = 0.25, 0.125
    seed = torch.full((1, 1, 1, 1), 1234, dtype=torch.int64, device="cuda")
    offset = torch.full((1, 1, 1, 1), 5, dtype=torch.int64, device="cuda")
    dump = torch.full((2, 4, 128, 128), float("nan"), device="cuda")
    out = torch.full_like(q, float("nan"))
    g = cudnn.pygraph()
    handles = [g.tensor_like(t) for t in (q, k, v, seed, offset)]
    dump_t = g.tensor_like(dump)
    o, _ = g.sdpa(
        *handles[:3], attn_scale=scale, dropout=(p, handles[3], handles[4]), rng_dump=dump_t, is_inference=True
    )
    o.set_output(True)
    build_and_run(g, {**dict(zip(handles, (q, k, v, seed, offset))), o: out, dump_t: dump})
    keep = (dump != 0).double()
    assert 0.6 < keep.mean().item() < 0.9  # about 1 - p kept
    attention = torch.softmax(q.double() @ k.double().transpose(-1, -2) * scale, -1)
    expected = (attention * keep / (1 - p)) @ v.double()
    assert rel_err(out, expected) < TOL


def test_int64_lengths_on_cudnn_match_int32():
    """Notebook 52 passes int64 lengths: cuDNN reads them as int32, the result is the same."""
    gen = torch.Generator().manual_seed(22)
    q, k, v = (torch.randn(2, 4, 128, 64, generator=gen).to("cuda", torch.float16) for _ in range(3))
    results = []
    for dtype in (torch.int32, torch.int64):
        lq = torch.tensor([100, 128], dtype=dtype, device="cuda").view(2, 1, 1, 1)
        lkv = torch.tensor([77, 128], dtype=dtype, device="cuda").view(2, 1, 1, 1)
        with cudnn.Graph() as g:
            g.sdpa(q, k, v, use_padding_mask=True, seq_len_q=lq, seq_len_kv=lkv, attn_scale=0.125)
        results.append(g(q, k, v, lq, lkv))
    assert torch.equal(results[0], results[1]) and torch.isfinite(results[0]).all()
