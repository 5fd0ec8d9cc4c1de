"""Attention sinks on cuDNN: forward (O, Stats) and backward (dQ, dK, dV, dSink) against the
reference backend on the same GPU and against the real frontend on the same inputs."""

from __future__ import annotations

import pytest
import torch
from conftest import TOLERANCE, rel_err

import cudnn_attn

pytestmark = pytest.mark.gpu

B, H, H_KV, D = 2, 8, 2, 64


def _modules():
    import cudnn

    return {
        "cudnn_attn": (cudnn_attn, {}),
        "reference": (cudnn_attn, {"backend": "reference"}),
        "frontend": (cudnn, {}),
    }


def _run(mod, options, data, sink, causal, window):
    q, k, v = data
    dt = mod.data_type.BFLOAT16
    masks = dict(use_causal_mask=causal)
    if window:
        masks.update(diagonal_band_left_bound=window, diagonal_alignment=mod.diagonal_alignment.TOP_LEFT)
    g = mod.pygraph(
        io_data_type=dt, intermediate_data_type=mod.data_type.FLOAT, compute_data_type=mod.data_type.FLOAT, **options
    )
    tq, tk, tv = (g.tensor(dim=t.shape, stride=t.stride(), data_type=dt) for t in data)
    ts = g.tensor(dim=sink.shape, stride=sink.stride(), data_type=mod.data_type.FLOAT)
    o, stats = g.sdpa(q=tq, k=tk, v=tv, sink_token=ts, generate_stats=True, attn_scale=D**-0.5, **masks)
    o.set_output(True).set_dim(q.shape).set_stride(q.stride()).set_data_type(dt)
    stats.set_output(True).set_data_type(mod.data_type.FLOAT)
    g.build([mod.heur_mode.A, mod.heur_mode.FALLBACK])
    out = torch.full_like(q, float("nan"))
    lse = torch.full((*q.shape[:3], 1), float("nan"), device="cuda")
    ws = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device="cuda")
    g.execute({tq: q, tk: k, tv: v, ts: sink, o: out, stats: lse}, ws)
    d_o = torch.randn(q.shape, generator=torch.Generator(device="cuda").manual_seed(7), device="cuda").to(q.dtype)
    b = mod.pygraph(
        io_data_type=dt, intermediate_data_type=mod.data_type.FLOAT, compute_data_type=mod.data_type.FLOAT, **options
    )
    bq, bk, bv, bo, bdo = (b.tensor(dim=t.shape, stride=t.stride(), data_type=dt) for t in (q, k, v, out, d_o))
    bst = b.tensor(dim=lse.shape, stride=lse.stride(), data_type=mod.data_type.FLOAT)
    bs = b.tensor(dim=sink.shape, stride=sink.stride(), data_type=mod.data_type.FLOAT)
    bds = b.tensor(dim=sink.shape, stride=sink.stride(), data_type=mod.data_type.FLOAT)
    dq, dk, dv = b.sdpa_backward(
        q=bq, k=bk, v=bv, o=bo, dO=bdo, stats=bst, sink_token=bs, dSink_token=bds, attn_scale=D**-0.5, **masks
    )
    grads = {}
    for handle, like, name in ((dq, q, "dQ"), (dk, k, "dK"), (dv, v, "dV")):
        handle.set_output(True).set_dim(like.shape).set_stride(like.stride()).set_data_type(dt)
        grads[name] = torch.full_like(like, float("nan"))
    grads["dSink"] = torch.full_like(sink, float("nan"))
    b.build([mod.heur_mode.A, mod.heur_mode.FALLBACK])
    ws = torch.empty(max(b.get_workspace_size(), 1), dtype=torch.uint8, device="cuda")
    b.execute(
        {
            bq: q,
            bk: k,
            bv: v,
            bo: out,
            bdo: d_o,
            bst: lse,
            bs: sink,
            bds: grads["dSink"],
            dq: grads["dQ"],
            dk: grads["dK"],
            dv: grads["dV"],
        },
        ws,
    )
    torch.cuda.synchronize()
    return {"O": out, "Stats": lse, **grads}


@pytest.mark.parametrize(
    "causal, window", [(False, None), (True, None), (True, 128)], ids=["full", "causal", "gpt-oss"]
)
def test_sinks_forward_and_backward(causal, window):
    s = 512
    gen = torch.Generator(device="cuda").manual_seed(1)
    data = [torch.randn(B, h, s, D, device="cuda", generator=gen).bfloat16() for h in (H, H_KV, H_KV)]
    sink = (torch.randn(1, H, 1, 1, device="cuda", generator=gen) * 2).float()
    runs = {}
    for label, (mod, options) in _modules().items():
        try:
            runs[label] = _run(mod, options, data, sink, causal, window)
        except mod.cudnnGraphNotSupportedError:
            assert label == "frontend", label
    ref = runs["reference"]
    tol = {"O": TOLERANCE[torch.bfloat16], "Stats": 1e-3, "dQ": 2e-2, "dK": 2e-2, "dV": 2e-2, "dSink": 2e-2}
    for name, limit in tol.items():
        assert rel_err(runs["cudnn_attn"][name], ref[name]) < limit, name
        if "frontend" in runs:
            assert rel_err(runs["cudnn_attn"][name], runs["frontend"][name]) < limit, f"vs frontend {name}"


def _decode(backend, q, k_cache, v_cache, table, lengths, sink, stats):
    """One decode step with a sink through the Graph API: paged caches, per-sequence lengths."""
    ones = torch.ones(q.shape[0], 1, 1, 1, dtype=torch.int32, device="cuda")
    with cudnn_attn.Graph(backend=backend) as g:
        g.sdpa(
            q,
            k_cache,
            v_cache,
            sink_token=sink,
            generate_stats=stats,
            use_padding_mask=True,
            seq_len_q=ones,
            seq_len_kv=lengths,
            paged_attention_k_table=table,
            paged_attention_v_table=table,
            paged_attention_max_seq_len_kv=table.shape[2] * k_cache.shape[2],
        )
    return g(
        {
            "q": q,
            "k": k_cache,
            "v": v_cache,
            "sink_token": sink,
            "seq_len_q": ones,
            "seq_len_kv": lengths,
            "paged_attention_k_table": table,
        }
    )


@pytest.mark.parametrize("stats", [True, False], ids=["with-stats", "o-only"])
def test_a_sink_in_decode_is_added_after_the_run(stats):
    """cuDNN's decode kernels take no sink: the plan runs without it and folds it in from the
    log-sum-exp. A sequence with no keys gives O = 0 and the sink as its log-sum-exp."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    page, pages = 64, 8
    q = torch.randn(B, H, 1, D, device="cuda", generator=gen).bfloat16()
    k_cache, v_cache = (
        torch.randn(B * pages, H_KV, page, D, device="cuda", generator=gen).bfloat16() for _ in range(2)
    )
    table = torch.randperm(B * pages, device="cuda", generator=gen).int().view(B, 1, pages, 1)
    sink = (torch.randn(1, H, 1, 1, device="cuda", generator=gen) * 2).float()
    for lengths in ([300, 512], [0, 77]):
        seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda").view(-1, 1, 1, 1)
        got = _decode("cudnn", q, k_cache, v_cache, table, seq_lens, sink, stats)
        want = _decode("reference", q, k_cache, v_cache, table, seq_lens, sink, stats)
        got, want = (got if stats else (got,)), (want if stats else (want,))
        assert rel_err(got[0].float(), want[0].float()) < TOLERANCE[torch.bfloat16], lengths
        if stats:
            assert rel_err(got[1], want[1]) < 1e-3, lengths
        if lengths[0] == 0:
            assert torch.equal(got[0][0], torch.zeros_like(got[0][0]))
            if stats:
                assert torch.equal(got[1][0], sink[0].expand_as(got[1][0]))


def test_decode_with_sinks_through_the_torch_form_learns_them():
    gen = torch.Generator(device="cuda").manual_seed(6)
    q = torch.randn(B, H, 1, D, device="cuda", generator=gen).bfloat16().requires_grad_()
    k, v = (torch.randn(B, H_KV, 300, D, device="cuda", generator=gen).bfloat16().requires_grad_() for _ in range(2))
    sinks = torch.randn(H, device="cuda", generator=gen).requires_grad_()
    out = cudnn_attn.sdpa(q, k, v, enable_gqa=True, sinks=sinks)
    d_out = torch.randn(out.shape, device="cuda", generator=gen).bfloat16()
    grads = torch.autograd.grad(out, (q, k, v, sinks), d_out)
    leaves = [t.detach().cpu().float().requires_grad_() for t in (q, k, v, sinks)]
    ref = cudnn_attn.sdpa(*leaves[:3], enable_gqa=True, sinks=leaves[3])  # the reference backend, on CPU
    expected = torch.autograd.grad(ref, leaves, d_out.cpu().float())
    assert rel_err(out.float().cpu(), ref) < TOLERANCE[torch.bfloat16]
    for name, a, e in zip(("dQ", "dK", "dV", "dSinks"), grads, expected):
        assert rel_err(a.float().cpu(), e) < 2e-2, name


def test_the_torch_form_with_sinks_matches_the_reference_and_learns_them():
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(B, H, 256, D, device="cuda", generator=gen).bfloat16().requires_grad_()
    k, v = (torch.randn(B, H_KV, 256, D, device="cuda", generator=gen).bfloat16().requires_grad_() for _ in range(2))
    sinks = torch.randn(H, device="cuda", generator=gen).requires_grad_()
    out = cudnn_attn.sdpa(q, k, v, is_causal=True, enable_gqa=True, sinks=sinks)
    d_out = torch.randn(out.shape, device="cuda", generator=gen).bfloat16()
    grads = torch.autograd.grad(out, (q, k, v, sinks), d_out)
    leaves = [t.detach().cpu().float().requires_grad_() for t in (q, k, v, sinks)]
    ref = cudnn_attn.sdpa(
        *leaves[:3], is_causal=True, enable_gqa=True, sinks=leaves[3]
    )  # the reference backend, on CPU
    expected = torch.autograd.grad(ref, leaves, d_out.cpu().float())
    assert rel_err(out.float().cpu(), ref) < TOLERANCE[torch.bfloat16]
    for name, a, e in zip(("dQ", "dK", "dV", "dSinks"), grads, expected):
        assert rel_err(a.float().cpu(), e) < 2e-2, name


def test_varlen_with_sinks_matches_the_reference():
    """Forward and backward on any cuDNN: the packed backward runs without cuDNN's sink (which
    needs cuDNN >= 9.26 there) and derives dSink per token (``ops/cudnn/folded_sink.py``)."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    cu = torch.tensor([0, 100, 357, 512], dtype=torch.int32, device="cuda")
    q = torch.randn(512, H, D, device="cuda", generator=gen).bfloat16().requires_grad_()
    k, v = (torch.randn(512, H_KV, D, device="cuda", generator=gen).bfloat16().requires_grad_() for _ in range(2))
    sinks = torch.randn(H, device="cuda", generator=gen).requires_grad_()
    out = cudnn_attn.varlen_sdpa(q, k, v, cu, cu, 257, 257, is_causal=True, enable_gqa=True, sinks=sinks)
    d_out = torch.randn(out.shape, device="cuda", generator=gen).bfloat16()
    leaves = [t.detach().cpu().float().requires_grad_() for t in (q, k, v, sinks)]
    ref = cudnn_attn.varlen_sdpa(
        *leaves[:3], cu.cpu(), cu.cpu(), 257, 257, is_causal=True, enable_gqa=True, sinks=leaves[3]
    )
    assert rel_err(out.float().cpu(), ref) < TOLERANCE[torch.bfloat16]
    grads = torch.autograd.grad(out, (q, k, v, sinks), d_out)
    expected = torch.autograd.grad(ref, leaves, d_out.cpu().float())
    for name, a, e in zip(("dQ", "dK", "dV", "dSinks"), grads, expected):
        assert rel_err(a.float().cpu(), e) < 2e-2, name


@pytest.mark.parametrize("sinks", [False, True], ids=["window", "window-sinks"])
def test_the_torch_form_with_a_window_matches_the_reference(sinks):
    """gpt-oss's layer, dense: a causal window (``window_size=(W - 1, 0)``) with its sinks, forward
    and backward, against the reference backend on CPU."""
    gen = torch.Generator(device="cuda").manual_seed(8)
    q = torch.randn(B, H, 384, D, device="cuda", generator=gen).bfloat16().requires_grad_()
    k, v = (torch.randn(B, H_KV, 384, D, device="cuda", generator=gen).bfloat16().requires_grad_() for _ in range(2))
    leaves = [q, k, v] + ([torch.randn(H, device="cuda", generator=gen).requires_grad_()] if sinks else [])
    out = cudnn_attn.sdpa(
        *leaves[:3], is_causal=True, enable_gqa=True, window_size=(127, 0), sinks=leaves[3] if sinks else None
    )
    d_out = torch.randn(out.shape, device="cuda", generator=gen).bfloat16()
    grads = torch.autograd.grad(out, leaves, d_out)
    cpu = [t.detach().cpu().float().requires_grad_() for t in leaves]
    ref = cudnn_attn.sdpa(
        *cpu[:3], is_causal=True, enable_gqa=True, window_size=(127, 0), sinks=cpu[3] if sinks else None
    )
    expected = torch.autograd.grad(ref, cpu, d_out.cpu().float())
    assert rel_err(out.float().cpu(), ref) < TOLERANCE[torch.bfloat16]
    for name, a, e in zip(("dQ", "dK", "dV", "dSinks"), grads, expected):
        assert rel_err(a.float().cpu(), e) < 2e-2, name


@pytest.mark.parametrize("padding", ["none", "left"])
def test_gpt_oss_through_the_registration_matches_eager(padding):
    """A tiny gpt-oss in bf16 on cuDNN (its window layer dense with ``window_size`` and sinks; padded,
    a dense mask for the training step) against its eager attention in float32: logits and the
    gradients of the sinks and a projection."""
    from test_transformers_integration import batch, gpt_oss_models

    ref, ours = gpt_oss_models(8, "cuda")
    ours = ours.to(torch.bfloat16)
    ids, mask = batch(padding, "cuda")
    real = mask.bool()
    with torch.no_grad():
        expected, actual = ref(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    assert rel_err(actual[real].float(), expected[real]) < 2 * TOLERANCE[torch.bfloat16]
    labels = ids.masked_fill(mask == 0, -100)
    labels[torch.arange(ids.shape[0]), mask.argmax(dim=1)] = -100  # as check_against_eager
    for model in (ref, ours):
        model(ids, attention_mask=mask, labels=labels).loss.backward()
    for (key, p_ref), (_, p_ours) in zip(ref.named_parameters(), ours.named_parameters()):
        if p_ref.grad is not None and ("sinks" in key or "q_proj.weight" in key):
            assert rel_err(p_ours.grad.float(), p_ref.grad) < 5e-2, key


def test_gpt_oss_decode_steps_with_a_window_and_padding_match_eager():
    """gpt-oss decoding past its window over a left-padded batch, bf16 on cuDNN: one query token
    per step with its sinks (through varlen, whose query length bucket keeps cuDNN off its
    decode-only kernels); each step's logits against eager attention in float32 on the same cache."""
    from test_transformers_integration import batch, gpt_oss_models

    ref, ours = gpt_oss_models(4, "cuda")
    ours = ours.to(torch.bfloat16)
    ids, mask = batch("left", "cuda")
    with torch.no_grad():
        past_ref = ref(ids, attention_mask=mask, use_cache=True).past_key_values
        past_ours = ours(ids, attention_mask=mask, use_cache=True).past_key_values
        token = torch.randint(1, 100, (ids.shape[0], 1), device="cuda")
        for _ in range(3):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            a = ref(token, attention_mask=mask, past_key_values=past_ref, use_cache=True)
            b = ours(token, attention_mask=mask, past_key_values=past_ours, use_cache=True)
            assert rel_err(b.logits.float(), a.logits) < 2 * TOLERANCE[torch.bfloat16]
            past_ref, past_ours = a.past_key_values, b.past_key_values
            token = a.logits[:, -1:].argmax(-1)


def test_a_folded_sink_runs_on_the_handles_stream():
    """A decode sink is folded in after cuDNN's run (ops/cudnn/folded_sink.py): on the stream the
    run went on. Here a handle's own stream (``set_stream``, as the frontend's tests do) is kept
    busy first; a fold on torch's current stream would read O and the stats before cuDNN wrote
    them (the NaN the frontend's FP8 sink tests showed, intermittently, before this was fixed)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(B, H, 1, D, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(B, H_KV, 256, D, device="cuda", generator=gen).bfloat16() for _ in range(2))
    sink = (torch.randn(1, H, 1, 1, device="cuda", generator=gen) * 2).float()
    side = torch.cuda.Stream()
    handle = cudnn_attn.create_handle()
    cudnn_attn.set_stream(handle=handle, stream=side.cuda_stream)
    dt = cudnn_attn.data_type.BFLOAT16
    g = cudnn_attn.pygraph(
        io_data_type=dt,
        intermediate_data_type=cudnn_attn.data_type.FLOAT,
        compute_data_type=cudnn_attn.data_type.FLOAT,
        handle=handle,
    )
    tq, tk, tv = (g.tensor_like(t) for t in (q, k, v))
    ts = g.tensor_like(sink)
    o, _ = g.sdpa(q=tq, k=tk, v=tv, sink_token=ts, attn_scale=D**-0.5)
    o.set_output(True).set_dim(q.shape).set_stride(q.stride()).set_data_type(dt)
    g.build([cudnn_attn.heur_mode.A])
    ws = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device="cuda")
    with cudnn_attn.Graph(backend="reference") as ref:
        ref.sdpa(q, k, v, sink_token=sink, attn_scale=D**-0.5)
    want = ref(q, k, v, sink)  # one output: the tensor itself
    for _ in range(3):
        out = torch.full_like(q, float("nan"))
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)  # the handle's stream is busy for a while
        g.execute({tq: q, tk: k, tv: v, ts: sink, o: out}, ws, handle=handle)
        torch.cuda.synchronize()
        assert rel_err(out, want) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "batch 1", "packed", "strided d"])
def test_the_sink_gradients_row_dot_matches_float64_in_every_layout(layout):
    """dSink's reduction (``core.sink_fold.weighted_row_dot``): one batched matrix-vector product
    per head where the rows merge without a copy, torch's reduction where they do not; each
    against float64 on fresh random inputs, at bf16's tolerance."""
    from cudnn_attn.core.sink_fold import weighted_row_dot

    gen = torch.Generator(device="cuda").manual_seed(5)
    b, h, s, d = (1 if layout == "batch 1" else 3), 4, 300, 64
    shapes = {"bshd": (b, s, h, d), "batch 1": (b, s, h, d), "packed": (1, s, h, d)}
    made = [torch.randn(*shapes.get(layout, (b, h, s, 2 * d)), device="cuda", generator=gen) for _ in range(2)]
    if layout in shapes:
        d_o, o = (t.bfloat16().transpose(1, 2) for t in made)
    elif layout == "bhsd":
        d_o, o = (t[..., :d].contiguous().bfloat16() for t in made)
    else:  # every other element of D: no [rows, D] matrix without a copy
        d_o, o = (t.bfloat16()[..., ::2] for t in made)
    weight = torch.rand(d_o.shape[:3], device="cuda", generator=gen)
    want = ((d_o.double() * o.double()).sum(-1) * weight.double()).sum((0, 2))
    got = weighted_row_dot(d_o, o, weight)
    assert got.dtype == torch.float32 and got.shape == (h,)
    assert rel_err(got, want) < TOLERANCE[torch.bfloat16] / 2


def test_a_sink_gradient_beside_the_backward_waits_for_a_busy_stream():
    """dSink runs on a side stream beside cuDNN's sink-less backward (``ops/cudnn/plan.py``): it must
    start after O, dO and the stats are written on the run's stream and finish before the run's
    stream reads dSink. Here the run's stream is kept busy first and dO written last on it; the
    gradients must still equal the reference backend's."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    q, k, v = (
        torch.randn(B, 256, h, D, device="cuda", generator=gen).bfloat16().transpose(1, 2) for h in (H, H_KV, H_KV)
    )
    sinks = torch.randn(H, device="cuda", generator=gen)
    d_o = torch.randn(B, H, 256, D, device="cuda", generator=gen).bfloat16()
    grads = {}
    for backend in ("reference", "cudnn"):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
        with cudnn_attn.backend(backend):
            out = cudnn_attn.sdpa(*leaves[:3], is_causal=True, enable_gqa=True, sinks=leaves[3])
            late = torch.zeros_like(d_o)
            torch.cuda._sleep(20_000_000)  # the run's stream is busy for a while
            late.copy_(d_o)  # dO is written last, on the run's stream
            grads[backend] = torch.autograd.grad(out, leaves, late)
        torch.cuda.synchronize()
    for want, got in zip(grads["reference"], grads["cudnn"]):
        assert rel_err(got, want) < TOLERANCE[torch.bfloat16]


def test_a_packed_sink_gradient_reads_sequence_starts_made_on_a_busy_stream():
    """The packed dSink reads the sequences' starts, derived from fresh lengths on the run's
    stream: they must be written before the side stream reads them. The run's stream is kept busy
    before each backward, and each step's lengths are a new tensor (nothing cached); every
    step's dSink must equal the reference backend's."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    tokens = 4096
    for step, lengths in enumerate(([1024] * 4, [100, 2900, 1000, 96], [4000, 32, 32, 32])):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        longest = max(lengths)
        q = torch.randn(tokens, H, D, device="cuda", generator=gen).bfloat16()
        k, v = (torch.randn(tokens, H_KV, D, device="cuda", generator=gen).bfloat16() for _ in range(2))
        sinks = torch.randn(H, device="cuda", generator=gen)
        d_out = torch.randn(tokens, H, D, device="cuda", generator=gen).bfloat16()
        got = {}
        for backend in ("reference", "cudnn"):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
            with cudnn_attn.backend(backend):
                out = cudnn_attn.varlen_sdpa(
                    *leaves[:3], cu, cu, longest, longest, is_causal=True, enable_gqa=True, sinks=leaves[3]
                )
                torch.cuda._sleep(20_000_000)  # the run's stream is busy when the backward is queued
                got[backend] = torch.autograd.grad(out, leaves[3], d_out)[0]
            torch.cuda.synchronize()
        assert rel_err(got["cudnn"], got["reference"]) < TOLERANCE[torch.bfloat16], step
