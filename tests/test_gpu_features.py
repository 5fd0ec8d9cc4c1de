"""cuDNN features beyond the dense grid: THD, paged caches, dropout, dBias, determinism,
CUDA graphs, streams and CuPy. Each result is compared with the reference backend."""

from __future__ import annotations

import pytest
import torch
from cases import paged_cache
from conftest import poisoned, rel_err

import cudnn_attn
from cudnn_attn.ops import get_backend

pytestmark = pytest.mark.gpu

TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def randn(*shape, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device="cuda", dtype=dtype)


def both(build, inputs, **run):
    """Run the graph that ``build(backend)`` records on cuDNN and on the reference."""
    fast, ref = build("cudnn"), build("reference")
    assert fast.nodes[0].backend == "cudnn"
    outs = tuple(poisoned(h) for h in fast.outputs)
    got = fast(*inputs, out=outs, **run)
    expected = ref(*inputs)
    torch.cuda.synchronize()
    return (got if isinstance(got, tuple) else (got,)), (expected if isinstance(expected, tuple) else (expected,))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal-br"])
def test_thd_ragged_forward_and_backward(dtype, causal):
    lq, lkv = [37, 128, 1, 90], [64, 128, 50, 90]
    h, h_kv, d = 8, 2, 128
    q, k, v = (
        randn(sum(lq), h, d, dtype=dtype, seed=1),
        randn(sum(lkv), h_kv, d, dtype=dtype, seed=2),
        randn(sum(lkv), h_kv, d, dtype=dtype, seed=3),
    )
    seq_q, seq_kv = (torch.tensor(x, dtype=torch.int32, device="cuda") for x in (lq, lkv))
    kw = dict(
        seq_len_q=seq_q, seq_len_kv=seq_kv, max_seq_len_q=128, max_seq_len_kv=128, use_causal_mask_bottom_right=causal
    )

    def forward(backend):
        with cudnn_attn.Graph(backend=backend, cache=cudnn_attn.PlanCache()) as g:
            g.sdpa(q, k, v, generate_stats=True, **kw)
        return g

    (o, s), (o_ref, s_ref) = both(forward, (q, k, v, seq_q, seq_kv))
    assert rel_err(o, o_ref) < TOL[dtype]
    rows = torch.arange(128, device="cuda").view(1, 1, -1, 1) < seq_q.view(-1, 1, 1, 1)
    assert rel_err(s.masked_fill(~rows, 0), s_ref.masked_fill(~rows, 0)) < 1e-3
    d_o = randn(*o_ref.shape, dtype=dtype, seed=4)

    def backward(backend):
        with cudnn_attn.Graph(backend=backend, cache=cudnn_attn.PlanCache()) as g:
            g.sdpa_backward(q, k, v, o_ref, d_o, s_ref, **kw)
        return g

    got, expected = both(backward, (q, k, v, o_ref, d_o, s_ref, seq_q, seq_kv))
    for a, e in zip(got, expected):
        assert rel_err(a, e) < 3 * TOL[dtype]


@pytest.mark.parametrize("layout", ["NPHD", "NHPD"])
@pytest.mark.parametrize("s_q", [1, 16], ids=["decode", "prefill"])
def test_paged_cache(layout, s_q):
    b, h, h_kv, s_kv, d, page = 3, 8, 2, 300, 128, 32
    q = randn(b, h, s_q, d, seed=5)
    k_cache, table_k = paged_cache(randn(b, h_kv, s_kv, d, seed=6), page, layout, 7)
    v_cache, table_v = paged_cache(randn(b, h_kv, s_kv, d, seed=8), page, layout, 9)
    lengths = torch.tensor([300, 17, 160], dtype=torch.int32, device="cuda")

    def build(backend):
        with cudnn_attn.Graph(backend=backend, cache=cudnn_attn.PlanCache()) as g:
            g.sdpa_with_paged_cache(
                q,
                k_cache,
                v_cache,
                table_k,
                page_table_v=table_v,
                seq_len_kv=lengths,
                kv_cache_layout=layout,
                use_causal_mask_bottom_right=s_q > 1,
            )
        return g

    (o,), (o_ref,) = both(build, (q, k_cache, v_cache, table_k, lengths, table_v))
    assert rel_err(o, o_ref) < TOL[torch.bfloat16]


def test_dropout_matches_the_reference_given_cudnns_mask():
    b, h, s, d, p = 2, 4, 128, 64, 0.2
    q, k, v, d_o = (randn(b, h, s, d, seed=i) for i in range(4))
    with cudnn_attn.Graph(backend="reference") as g:
        g.sdpa(q, k, v, dropout=p, dropout_seed=1234, dropout_offset=7, generate_stats=True)
    problem = g.problems[0]
    fast = get_backend("cudnn").build(problem, rng_dump=True)
    rng_dump = torch.full((b, h, s, s), float("nan"), device="cuda")
    o, stats = poisoned(g.outputs[0]), poisoned(g.outputs[1])
    fast(
        {"q": q, "k": k, "v": v, "dropout_seed": 1234, "dropout_offset": 7}, {"o": o, "stats": stats}, rng_dump=rng_dump
    )
    torch.cuda.synchronize()
    keep = rng_dump.bool()
    assert set(rng_dump.unique().tolist()) <= {0.0, 1.0} and abs(keep.float().mean().item() - (1 - p)) < 0.02
    ref_plan = get_backend("reference").build(problem)
    o_ref, s_ref = torch.empty_like(o), torch.empty_like(stats)
    ref_plan({"q": q, "k": k, "v": v}, {"o": o_ref, "stats": s_ref}, dropout_keep=keep)
    assert rel_err(o, o_ref) < TOL[torch.bfloat16]

    # The backward regenerates the same mask from the same seed and offset.
    with cudnn_attn.Graph(backend="cudnn") as gb:
        gb.sdpa_backward(q, k, v, o_ref, d_o, s_ref, dropout=p, dropout_seed=1234, dropout_offset=7)
    got = gb(q, k, v, o_ref, d_o, s_ref)
    with cudnn_attn.Graph(backend="reference") as rb:
        rb.sdpa_backward(q, k, v, o_ref, d_o, s_ref, dropout=p, dropout_seed=1234, dropout_offset=7)
    ref_b = get_backend("reference").build(rb.problems[0])
    expected = [torch.empty_like(x) for x in (q, k, v)]
    ref_b(
        {"q": q, "k": k, "v": v, "o": o_ref, "grad_o": d_o, "stats": s_ref},
        dict(zip(("grad_q", "grad_k", "grad_v"), expected)),
        dropout_keep=keep,
    )
    for a, e in zip(got, expected):
        assert rel_err(a, e) < 3 * TOL[torch.bfloat16]


def test_bias_gradient():
    q, k, v, d_o = (randn(2, 4, 128, 64, dtype=torch.float16, seed=i) for i in range(4))
    bias = randn(1, 4, 128, 128, dtype=torch.float16, seed=9)

    def build(backend):
        with cudnn_attn.Graph(backend=backend, cache=cudnn_attn.PlanCache()) as g:
            o, s = g.sdpa(q, k, v, attn_bias=bias, generate_stats=True)
            g.sdpa_backward(q, k, v, o, d_o, s, attn_bias=bias, bias_grad=True)
        return g

    got, expected = both(build, (q, k, v, bias, d_o))
    for name, a, e in zip(("O", "Stats", "dQ", "dK", "dV", "dBias"), got, expected):
        assert rel_err(a, e) < 3 * TOL[torch.float16], name


def test_broadcast_bias_backward_is_refused():
    q = randn(2, 4, 64, 64)
    bias = randn(2, 1, 1, 64)
    with pytest.raises(cudnn_attn.UnsupportedError, match="broadcast over S_q"):
        with cudnn_attn.Graph() as g:
            o, s = g.sdpa(q, q, q, attn_bias=bias, generate_stats=True)
            g.sdpa_backward(q, q, q, o, q, s, attn_bias=bias)


def test_deterministic_backward_is_bitwise_repeatable():
    q, k, v, d_o = (randn(2, 8, 256, 128, seed=i) for i in range(4))
    with cudnn_attn.Graph() as g:
        o, s = g.sdpa(q, k, v, generate_stats=True, use_causal_mask=True)
        g.sdpa_backward(q, k, v, o, d_o, s, use_causal_mask=True, use_deterministic_algorithm=True)
    first = g(q, k, v, d_o)
    second = g(q, k, v, d_o)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_cuda_graph_capture_and_replay():
    q, k, v = (randn(2, 8, 128, 64, seed=i) for i in range(3))
    with cudnn_attn.Graph() as g:
        o_handle, _ = g.sdpa(q, k, v, use_causal_mask=True)
    static_out = poisoned(o_handle)
    g(q, k, v, out=static_out)  # warm up outside the capture (handle, workspace)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        g(q, k, v, out=static_out)
    for seed in (10, 11):
        for static, new in zip((q, k, v), (randn(2, 8, 128, 64, seed=seed + i) for i in range(3))):
            static.copy_(new)
        static_out.fill_(float("nan"))
        cuda_graph.replay()
        torch.cuda.synchronize()
        expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        assert rel_err(static_out, expected) < TOL[torch.bfloat16]


def test_runs_on_the_current_and_a_given_stream():
    q, k, v = (randn(2, 8, 128, 64, seed=i) for i in range(3))
    with cudnn_attn.Graph() as g:
        g.sdpa(q, k, v)
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = g(q, k, v)
    explicit = g(q, k, v, stream=side)
    side.synchronize()
    assert rel_err(on_side, expected) < TOL[torch.bfloat16] and rel_err(explicit, expected) < TOL[torch.bfloat16]


def test_cupy_arrays_in_and_out():
    cupy = pytest.importorskip("cupy")
    q = randn(1, 4, 64, 64, dtype=torch.float16)
    q_cp = cupy.from_dlpack(q)
    with cudnn_attn.Graph() as g:
        g.sdpa(q_cp, q_cp, q_cp)
    out = g(q_cp)
    assert isinstance(out, cupy.ndarray)
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), q.float(), q.float())
    assert rel_err(torch.from_dlpack(out), expected) < TOL[torch.float16]


def test_user_handles_are_accepted():
    import cudnn

    q = randn(1, 4, 64, 64, dtype=torch.float16)
    ours, theirs = cudnn_attn.create_handle(), cudnn.create_handle()
    with cudnn_attn.Graph(handle=ours) as g:
        g.sdpa(q, q, q)
    a, b = g(q), g(q, handle=theirs)
    torch.cuda.synchronize()
    assert torch.equal(a, b)
    cudnn_attn.destroy_handle(ours)


def test_info_lists_cudnn_features(capsys):
    from cudnn_attn.cli import commands as cli

    cli.main(["info"])
    text = capsys.readouterr().out
    assert "cudnn" in text and "compute_capability" in text and "paged KV cache" in text


@pytest.mark.parametrize(
    "kw", [{}, {"is_causal": True}, {"enable_gqa": True}, {"mask": True}], ids=["plain", "causal", "gqa", "mask"]
)
def test_functional_sdpa_matches_torch_with_gradients(kw):
    kw = dict(kw)
    h_kv = 2 if kw.get("enable_gqa") else 8
    q = randn(2, 8, 256, 64, seed=1).requires_grad_()
    k, v = randn(2, h_kv, 256, 64, seed=2).requires_grad_(), randn(2, h_kv, 256, 64, seed=3).requires_grad_()
    if kw.pop("mask", False):
        kw["attn_mask"] = randn(1, 8, 256, 256, seed=4)
    out = cudnn_attn.sdpa(q, k, v, **kw)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_kw = {**kw, **({"attn_mask": kw["attn_mask"].float()} if "attn_mask" in kw else {})}
    ref = torch.nn.functional.scaled_dot_product_attention(*leaves, **ref_kw)
    d_o = randn(*out.shape, seed=5)
    out.backward(d_o)
    ref.backward(d_o.float())
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    for a, b in zip((q, k, v), leaves):
        assert rel_err(a.grad, b.grad) < 2 * TOL[torch.bfloat16]


def test_module_under_torch_compile():
    torch.manual_seed(0)
    layer = cudnn_attn.nn.Attention(256, 4, causal=True, device="cuda", dtype=torch.bfloat16)
    x = randn(2, 128, 256, seed=6)
    eager = layer(x)
    compiled = torch.compile(layer)
    assert rel_err(compiled(x), eager) < TOL[torch.bfloat16]


def test_out_of_range_lengths_and_pages_never_crash():
    """Run-time values are not checked on the cuDNN path (that would need a sync); they are
    clamped on the device, so memory stays in bounds and the context stays healthy."""
    q = randn(2, 8, 1, 64, seed=20)
    cache = randn(8, 16, 2, 64, seed=21)
    table = torch.arange(8, device="cuda", dtype=torch.int32).view(2, 4)
    lengths = torch.tensor([64, 30], device="cuda", dtype=torch.int32)
    with cudnn_attn.Graph() as g:
        g.sdpa_with_paged_cache(q, cache, cache, table, seq_len_kv=lengths)
    bad_table = torch.tensor([[0, 10**6, -5, 3], [2**30, 1, 2, 3]], device="cuda", dtype=torch.int32)
    bad_lengths = torch.tensor([10**6, -7], device="cuda", dtype=torch.int32)
    assert [h.name for h in g.inputs] == ["q", "k", "page_table", "seq_len_kv"]  # cache and table serve twice
    g(q, cache, bad_table, bad_lengths)
    torch.cuda.synchronize()  # raises if a kernel faulted
    good = g(q, cache, table, lengths)
    with cudnn_attn.Graph(backend="reference") as ref:
        ref.sdpa_with_paged_cache(q, cache, cache, table, seq_len_kv=lengths)
    assert rel_err(good, ref(q, cache, table, lengths)) < TOL[torch.bfloat16]


def test_out_of_range_ragged_lengths_never_crash():
    q = randn(40, 4, 64, seed=22)
    lengths = torch.tensor([10, 30], device="cuda", dtype=torch.int32)
    lengths_kv = lengths.clone()  # a separate input from seq_len_q
    with cudnn_attn.Graph() as g:
        g.sdpa(q, q, q, seq_len_q=lengths, seq_len_kv=lengths_kv, max_seq_len_q=32, max_seq_len_kv=32)
    out = torch.zeros_like(q)
    g(q, lengths.new_tensor([30, 30]), lengths.new_tensor([30, 10**6]), out=out)  # sums past the 40 packed tokens
    torch.cuda.synchronize()
    with cudnn_attn.Graph(backend="reference") as ref:
        ref.sdpa(q, q, q, seq_len_q=lengths, seq_len_kv=lengths_kv, max_seq_len_q=32, max_seq_len_kv=32)
    assert rel_err(g(q, lengths, lengths_kv), ref(q, lengths, lengths_kv)) < TOL[torch.bfloat16]


def test_stats_of_a_sequence_with_no_keys_are_minus_infinity_as_on_the_reference():
    """cuDNN writes O = 0 for a sequence with seq_len_kv = 0 but leaves its stats unwritten;
    the plan sets them to -inf first, so both backends agree (and a merge by log-sum-exp
    weighs such a part 0)."""
    q, k, v = (randn(2, 4, 8, 64, seed=70 + i) for i in range(3))
    lengths_q = torch.tensor([8, 8], dtype=torch.int32, device="cuda")
    lengths_kv = torch.tensor([0, 5], dtype=torch.int32, device="cuda")
    results = []
    for device in ("cuda", "cpu"):
        args = [t.to(device) for t in (q, k, v, lengths_q, lengths_kv)]
        with cudnn_attn.Graph() as g:
            o, stats = g.sdpa(
                *args[:3], seq_len_q=args[3], seq_len_kv=args[4], use_padding_mask=True, generate_stats=True
            )
        results.append(g(*args, out=(poisoned(o), poisoned(stats))))
    (o_gpu, stats_gpu), (o_cpu, stats_cpu) = results
    assert torch.equal(stats_gpu[0].cpu(), stats_cpu[0]) and bool(torch.isneginf(stats_gpu[0]).all())
    assert o_gpu[0].abs().sum() == 0
    assert rel_err(stats_gpu[1], stats_cpu[1]) < 1e-3 and rel_err(o_gpu[1], o_cpu[1]) < 2e-2


def test_paged_graph_with_sink_token_and_tensor_scale_matches_the_reference():
    q = randn(2, 8, 1, 64, seed=23)
    cache = randn(8, 16, 2, 64, seed=24)
    table = torch.tensor([[3, 0, 6, 1], [5, 2, 7, 4]], device="cuda", dtype=torch.int32)
    lengths = torch.tensor([64, 30], device="cuda", dtype=torch.int32)
    sinks = torch.randn(1, 8, 1, 1, generator=torch.Generator().manual_seed(25)).cuda()
    scale = torch.full((1, 1, 1, 1), 0.2, device="cuda")

    def build(backend):
        with cudnn_attn.Graph(backend=backend) as g:
            s = g.tensor(name="scale", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=torch.float32)
            g.sdpa_with_paged_cache(q, cache, cache, table, seq_len_kv=lengths, attn_scale=s, sink_token=sinks)
        return g

    (got,), (expected,) = both(build, (q, cache, table, lengths, scale, sinks))
    assert rel_err(got, expected) < TOL[torch.bfloat16]
