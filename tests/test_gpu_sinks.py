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
    g = mod.pygraph(io_data_type=dt, intermediate_data_type=mod.data_type.FLOAT, compute_data_type=mod.data_type.FLOAT,
                    **options)  # fmt: skip
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
    b = mod.pygraph(io_data_type=dt, intermediate_data_type=mod.data_type.FLOAT, compute_data_type=mod.data_type.FLOAT,
                    **options)  # fmt: skip
    bq, bk, bv, bo, bdo = (b.tensor(dim=t.shape, stride=t.stride(), data_type=dt) for t in (q, k, v, out, d_o))
    bst = b.tensor(dim=lse.shape, stride=lse.stride(), data_type=mod.data_type.FLOAT)
    bs = b.tensor(dim=sink.shape, stride=sink.stride(), data_type=mod.data_type.FLOAT)
    bds = b.tensor(dim=sink.shape, stride=sink.stride(), data_type=mod.data_type.FLOAT)
    dq, dk, dv = b.sdpa_backward(q=bq, k=bk, v=bv, o=bo, dO=bdo, stats=bst, sink_token=bs, dSink_token=bds,
                                 attn_scale=D**-0.5, **masks)  # fmt: skip
    grads = {}
    for handle, like, name in ((dq, q, "dQ"), (dk, k, "dK"), (dv, v, "dV")):
        handle.set_output(True).set_dim(like.shape).set_stride(like.stride()).set_data_type(dt)
        grads[name] = torch.full_like(like, float("nan"))
    grads["dSink"] = torch.full_like(sink, float("nan"))
    b.build([mod.heur_mode.A, mod.heur_mode.FALLBACK])
    ws = torch.empty(max(b.get_workspace_size(), 1), dtype=torch.uint8, device="cuda")
    b.execute({bq: q, bk: k, bv: v, bo: out, bdo: d_o, bst: lse, bs: sink, bds: grads["dSink"],
               dq: grads["dQ"], dk: grads["dK"], dv: grads["dV"]}, ws)  # fmt: skip
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


def test_a_sink_in_decode_is_refused_with_the_reason():
    q = torch.randn(B, H, 1, D, device="cuda").bfloat16()
    kv = torch.randn(B, H_KV, 64, D, device="cuda").bfloat16()
    sink = torch.zeros(1, H, 1, 1, device="cuda")
    with pytest.raises(cudnn_attn.UnsupportedError, match="sink_token with S_q = 1"):
        with cudnn_attn.Graph() as g:
            g.sdpa(q, kv, kv, sink_token=sink)


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
    """Forward on any cuDNN with sinks; the ragged backward needs cuDNN >= 9.26 and is refused
    by name before it (the frontend: older versions read out of bounds)."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    cu = torch.tensor([0, 100, 357, 512], dtype=torch.int32, device="cuda")
    q = torch.randn(512, H, D, device="cuda", generator=gen).bfloat16().requires_grad_()
    k, v = (torch.randn(512, H_KV, D, device="cuda", generator=gen).bfloat16().requires_grad_() for _ in range(2))
    sinks = torch.randn(H, device="cuda", generator=gen).requires_grad_()
    out = cudnn_attn.varlen_sdpa(q, k, v, cu, cu, 257, 257, is_causal=True, enable_gqa=True, sinks=sinks)
    d_out = torch.randn(out.shape, device="cuda", generator=gen).bfloat16()
    leaves = [t.detach().cpu().float().requires_grad_() for t in (q, k, v, sinks)]
    ref = cudnn_attn.varlen_sdpa(*leaves[:3], cu.cpu(), cu.cpu(), 257, 257, is_causal=True, enable_gqa=True,
                                 sinks=leaves[3])  # fmt: skip
    assert rel_err(out.float().cpu(), ref) < TOLERANCE[torch.bfloat16]
    if cudnn_attn.backend_version() < 92600:
        with pytest.raises(cudnn_attn.UnsupportedError, match="ragged .THD. backward needs cuDNN >= 9.26"):
            torch.autograd.grad(out, (q, k, v, sinks), d_out)
        return
    grads = torch.autograd.grad(out, (q, k, v, sinks), d_out)
    expected = torch.autograd.grad(ref, leaves, d_out.cpu().float())
    for name, a, e in zip(("dQ", "dK", "dV", "dSinks"), grads, expected):
        assert rel_err(a.float().cpu(), e) < 2e-2, name
