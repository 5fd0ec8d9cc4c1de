"""Score modifiers as the frontend's tests and examples write them (soft-capping, causal, arrow
and document masks, padding by sequence lengths), run through ``import cudnn_attn as cudnn`` and
checked against a float64 oracle. Shared by the CPU tests (reference backend) and the GPU tests."""

from __future__ import annotations

import math
from functools import partial

import torch

import cudnn_attn as cudnn

NEG = -1e9  # the frontend's examples mask with -1e9


def rand(*shape: int, seed: int, device: str, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def host_scalar(graph, name: str, value: float, dtype=torch.float32):
    """A pass-by-value [1, 1, 1, 1] graph tensor and its host value, as the frontend's tests make them."""
    cpu = torch.full((1, 1, 1, 1), value, dtype=dtype)
    return graph.tensor(
        name=name, dim=list(cpu.size()), stride=list(cpu.stride()), is_pass_by_value=True, data_type=cpu.dtype
    ), cpu


# --- score_mod callbacks in the frontend's own words ------------------------------------------------


def softcap(g, s, cap):
    return g.mul(a=g.tanh(input=g.div(a=s, b=cap)), b=cap)


def causal_mask(g, s, neg_inf):
    row = g.gen_index(input=s, axis=2)
    row.set_data_type(cudnn.data_type.INT32)
    col = g.gen_index(input=s, axis=3)
    col.set_data_type(cudnn.data_type.INT32)
    mask = g.cmp_ge(input=row, comparison=col, compute_data_type=cudnn.data_type.BOOLEAN)
    mask.set_data_type(cudnn.data_type.BOOLEAN)
    return g.binary_select(input0=s, input1=neg_inf, mask=mask)


def arrow_mask(g, s, row_bound, col_bound, diag_0, diag_1, neg_inf):
    """The frontend's test_sdpa_with_arrow_mask: keep the first rows and columns and a diagonal band."""
    row, col = g.gen_index(input=s, axis=2), g.gen_index(input=s, axis=3)
    near = g.sub(a=row, b=col, compute_data_type=cudnn.data_type.INT32)
    band = g.logical_and(g.cmp_ge(input=near, comparison=diag_0), g.cmp_le(input=near, comparison=diag_1))
    keep = g.logical_or(
        g.logical_or(g.cmp_lt(input=row, comparison=row_bound), g.cmp_lt(input=col, comparison=col_bound)), band
    )
    return g.binary_select(input0=s, input1=neg_inf, mask=keep)


def document_mask(g, s, doc, doc_t, neg_inf):
    """The frontend's test_sdpa_with_document_mask: a query sees the keys of its own document."""
    col = g.gen_index(input=s, axis=3, compute_data_type=cudnn.data_type.INT32)
    ones = g.cmp_le(input=col, comparison=col)
    ones.set_data_type(cudnn.data_type.INT32)
    rows = g.scale(input=ones, scale=doc)
    cols = g.scale(input=ones, scale=doc_t)
    return g.binary_select(input0=s, input1=neg_inf, mask=g.cmp_eq(input=rows, comparison=cols))


def key_padding(g, s, seq_len_kv, neg_inf):
    """Keys past each sequence's length masked inside the modifier (lengths [B, 1, 1, 1] on the device)."""
    col = g.gen_index(input=s, axis=3)
    return g.binary_select(input0=s, input1=neg_inf, mask=g.cmp_lt(input=col, comparison=seq_len_kv))


# --- the oracle ----------------------------------------------------------------------------------


def oracle_scores(s: torch.Tensor, kind: str, **values) -> torch.Tensor:
    """What the modifier ``kind`` does to float64 scores [B, H, S_q, S_kv]."""
    s_q, s_kv = s.shape[-2:]
    row = torch.arange(s_q).view(-1, 1)
    col = torch.arange(s_kv).view(1, -1)
    if kind in ("softcap", "softcap_causal"):
        cap = values["cap"]
        s = cap * torch.tanh(s / cap)
    if kind in ("causal", "softcap_causal"):
        return s.masked_fill(~(row >= col), NEG)
    if kind == "arrow":
        keep = (row < 2) | (col < 2) | (((row - col) >= 1) & ((row - col) <= 1))
        return s.masked_fill(~keep, NEG)
    if kind == "document":
        doc = values["doc"].view(-1)
        return s.masked_fill(~(doc.view(-1, 1) == doc.view(1, -1)), NEG)
    if kind == "padding":
        lengths = values["lengths"].view(-1, 1, 1, 1)
        return s.masked_fill(col.view(1, 1, 1, -1) >= lengths, NEG)
    if kind == "per_head":
        return s * values["temperature"].double()
    return s


def oracle(q, k, v, kind: str, scale: float, **values) -> torch.Tensor:
    q, k, v = (t.double().cpu() for t in (q, k, v))
    s = oracle_scores(q @ k.transpose(-1, -2) * scale, kind, **values)
    return torch.softmax(s, -1) @ v


# --- a whole frontend-style run --------------------------------------------------------------------


def run_forward(kind: str, device: str, dtype=torch.float16, b=2, h=2, s=64, d=64, seed=0):
    """One ``cudnn.pygraph`` sdpa with the ``kind`` modifier, executed as the frontend's tests do.
    Returns (O, expected O, the inputs)."""
    q, k, v = (rand(b, h, s, d, seed=seed + i, device=device, dtype=dtype) for i in range(3))
    scale = 1.0 / math.sqrt(d)
    g = cudnn.pygraph(
        io_data_type=cudnn.data_type.HALF if dtype == torch.float16 else cudnn.data_type.BFLOAT16,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
    )
    tq, tk, tv = g.tensor_like(q), g.tensor_like(k), g.tensor_like(v)
    pack = {tq: q, tk: k, tv: v}
    neg, neg_cpu = host_scalar(g, "neg_inf", NEG)
    pack[neg] = neg_cpu
    values: dict = {}
    extra: dict = {}
    if kind in ("softcap", "softcap_causal"):
        cap, cap_cpu = host_scalar(g, "softcap", 0.8)
        pack[cap] = cap_cpu
        values["cap"] = 0.8
        fn = partial(softcap, cap=cap)
        if kind == "softcap_causal":
            fn = lambda graph, scores: causal_mask(graph, softcap(graph, scores, cap), neg)  # noqa: E731
    elif kind == "causal":
        fn = partial(causal_mask, neg_inf=neg)
    elif kind == "arrow":
        bounds = [
            host_scalar(g, name, value, torch.int32)
            for name, value in (("row_bound", 2), ("col_bound", 2), ("diag_0", 1), ("diag_1", 1))
        ]
        pack.update({t: cpu for t, cpu in bounds})
        fn = partial(
            arrow_mask,
            row_bound=bounds[0][0],
            col_bound=bounds[1][0],
            diag_0=bounds[2][0],
            diag_1=bounds[3][0],
            neg_inf=neg,
        )
    elif kind == "document":
        doc_gpu = (
            torch.randint(0, 4, (1, 1, s, 1), generator=torch.Generator().manual_seed(seed + 7), dtype=torch.int32)
            .sort(dim=2)
            .values.to(device)
        )
        doc, doc_t = g.tensor_like(doc_gpu), g.tensor_like(doc_gpu.reshape(1, 1, 1, s))
        pack.update({doc: doc_gpu, doc_t: doc_gpu.reshape(1, 1, 1, s)})
        values["doc"] = doc_gpu.cpu()
        fn = partial(document_mask, doc=doc, doc_t=doc_t, neg_inf=neg)
    elif kind == "per_head":  # a temperature per head, [1, H, 1, 1] on the device
        temperature = (torch.rand(1, h, 1, 1, generator=torch.Generator().manual_seed(seed + 9)) + 0.5).to(device)
        t = g.tensor_like(temperature)
        pack[t] = temperature
        values["temperature"] = temperature.cpu()
        fn = lambda graph, scores: graph.mul(a=scores, b=t)  # noqa: E731
    elif kind == "padding":
        lengths = torch.tensor([s // 2 + 3, s], dtype=torch.int32)[:b].view(b, 1, 1, 1).to(device)
        seq_kv = g.tensor_like(lengths)
        pack[seq_kv] = lengths
        values["lengths"] = lengths.cpu()
        fn = partial(key_padding, seq_len_kv=seq_kv, neg_inf=neg)
    else:
        raise ValueError(kind)
    o, _ = g.sdpa(q=tq, k=tk, v=tv, generate_stats=False, attn_scale=scale, score_mod=fn, **extra)
    o.set_output(True).set_dim(list(q.shape)).set_stride(list(q.stride()))
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    pack[o] = out
    g.execute(pack, None)
    if device != "cpu":
        torch.cuda.synchronize()
    return out, oracle(q, k, v, kind, scale, **values)


def run_softcap_training(device: str, dtype=torch.float16, b=2, h=2, s=64, d=64, cap=0.8, seed=3):
    """The frontend's soft-capping forward and backward (its C++ Softcap modifier, written in
    Python): the bprop reads the forward's value before its tanh. Returns (ours, expected), each
    (O, dQ, dK, dV)."""
    q, k, v, d_o = (rand(b, h, s, d, seed=seed + i, device=device, dtype=dtype) for i in range(4))
    scale = 1.0 / math.sqrt(d)
    io = cudnn.data_type.HALF if dtype == torch.float16 else cudnn.data_type.BFLOAT16
    fwd = cudnn.pygraph(
        io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT
    )
    tq, tk, tv = fwd.tensor_like(q), fwd.tensor_like(k), fwd.tensor_like(v)
    cap_t, cap_cpu = host_scalar(fwd, "softcap", cap)
    neg, neg_cpu = host_scalar(fwd, "neg_inf", NEG)
    o, stats = fwd.sdpa(
        q=tq,
        k=tk,
        v=tv,
        generate_stats=True,
        attn_scale=scale,
        score_mod=lambda g, t: causal_mask(g, softcap(g, t, cap_t), neg),
    )
    o.set_output(True).set_dim(list(q.shape)).set_stride(list(q.stride()))
    stats.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    fwd.build([cudnn.heur_mode.A])
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, h, s, 1), float("nan"), device=device)
    fwd.execute({tq: q, tk: k, tv: v, o: out, stats: lse, cap_t: cap_cpu, neg: neg_cpu}, None)

    bwd = cudnn.pygraph(
        io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT
    )
    t = {name: bwd.tensor_like(x) for name, x in (("q", q), ("k", k), ("v", v), ("o", out), ("dO", d_o), ("st", lse))}
    cap_b, _ = host_scalar(bwd, "softcap", cap)
    neg_b, _ = host_scalar(bwd, "neg_inf", NEG)
    saved = {}

    def forward_mod(g, scores):
        saved["before_tanh"] = g.div(a=scores, b=cap_b)
        return causal_mask(g, g.mul(a=g.tanh(input=saved["before_tanh"]), b=cap_b), neg_b)

    def backward_mod(g, d_p):
        return g.div(a=g.tanh_backward(loss=g.mul(a=d_p, b=cap_b), input=saved["before_tanh"]), b=cap_b)

    d_q, d_k, d_v = bwd.sdpa_backward(
        q=t["q"],
        k=t["k"],
        v=t["v"],
        o=t["o"],
        dO=t["dO"],
        stats=t["st"],
        attn_scale=scale,
        score_mod=forward_mod,
        score_mod_bprop=backward_mod,
    )
    grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
    for handle, x in zip((d_q, d_k, d_v), (q, k, v)):
        handle.set_output(True).set_dim(list(x.shape)).set_stride(list(x.stride()))
    bwd.build([cudnn.heur_mode.A])
    bwd.execute(
        {
            t["q"]: q,
            t["k"]: k,
            t["v"]: v,
            t["o"]: out,
            t["dO"]: d_o,
            t["st"]: lse,
            d_q: grads[0],
            d_k: grads[1],
            d_v: grads[2],
            cap_b: cap_cpu,
            neg_b: neg_cpu,
        },
        None,
    )
    if device != "cpu":
        torch.cuda.synchronize()

    qd, kd, vd = (x.detach().double().cpu().requires_grad_() for x in (q, k, v))
    expected = torch.softmax(oracle_scores(qd @ kd.transpose(-1, -2) * scale, "softcap_causal", cap=cap), -1) @ vd
    expected.backward(d_o.double().cpu())
    return (out, *grads), (expected.detach(), qd.grad, kd.grad, vd.grad)


def softcap_torch_oracle(q, k, v, cap, causal, sinks=None, left=None):
    """float64 attention, soft-capped (``cap``, None: not), with torch's causal (top-left) mask,
    optional sinks and a window of ``left`` keys before the diagonal (FlashAttention's left bound)."""
    q, k, v = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    kk, vv = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    s = q @ kk.transpose(-1, -2) * q.shape[-1] ** -0.5
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    if left is not None:
        rows, cols = torch.arange(s.shape[-2])[:, None], torch.arange(s.shape[-1])[None, :]
        s = s.masked_fill(cols < rows - left, float("-inf"))
    leaves = [q, k, v]
    if sinks is not None:
        sink = sinks.detach().double().cpu().requires_grad_()
        leaves.append(sink)
        s = torch.cat([s, sink.view(1, -1, 1, 1).expand(*s.shape[:3], 1)], -1)
        return torch.softmax(s, -1)[..., :-1] @ vv, leaves
    return torch.softmax(s, -1) @ vv, leaves
