"""Code written for the cuDNN frontend (``import cudnn``), run through cudnn_attn with only the
import changed: the frontend's low-level graph (pygraph, tensor_like, the build steps, execute
with a variant pack), its pythonic Graph(inputs=, outputs=), a training step's forward and
backward, and its THD form (sequences packed in one buffer, placed by ragged offsets). What stays different: docs/coming_from_the_frontend.md.

    python samples/08_frontend_dropin.py

Runs on a GPU (cuDNN) or on the CPU (the reference backend, float32 there).
"""

from __future__ import annotations

import math

import torch

import cudnn_attn as cudnn  # was: import cudnn

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype, io = (torch.half, cudnn.data_type.HALF) if device == "cuda" else (torch.float32, cudnn.data_type.FLOAT)
B, S, H, D = 2, 256, 8, 64
scale = 1.0 / math.sqrt(D)
torch.manual_seed(0)
q_t, k_t, v_t, d_o_t = (torch.randn(B, S, H, D, device=device, dtype=dtype).transpose(1, 2) for _ in range(4))
handle = cudnn.create_handle()


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


# 1. The low-level graph, as the frontend's notebook 50 writes it.
graph = cudnn.pygraph(
    io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT
)
q, k, v = (graph.tensor_like(t) for t in (q_t, k_t, v_t))
o, _ = graph.sdpa(name="sdpa", q=q, k=k, v=v, is_inference=True, attn_scale=scale, use_causal_mask=True)
o.set_output(True).set_dim(q_t.shape).set_stride(q_t.stride())
graph.validate()
graph.build_operation_graph()
graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
graph.check_support()
graph.build_plans()
out = torch.empty_like(q_t)
workspace = torch.empty(graph.get_workspace_size(), device=device, dtype=torch.uint8)
graph.execute({q: q_t, k: k_t, v: v_t, o: out}, workspace, handle=handle)
expected = torch.nn.functional.scaled_dot_product_attention(q_t.double(), k_t.double(), v_t.double(), is_causal=True)
print(f"low-level graph, forward: rel_err={rel_err(out, expected):.2e}")

# 2. The pythonic Graph, declaring its inputs and outputs by name (notebook 51's training flow).
with cudnn.Graph(inputs=["fwd::q", "fwd::k", "fwd::v"], outputs=["o", "stats"]) as fwd:
    o, stats = fwd.sdpa(name="fwd", q=q_t, k=k_t, v=v_t, attn_scale=scale, generate_stats=True, use_causal_mask=True)
    o.set_output(True).set_name("o")
    stats.set_output(True).set_name("stats").set_data_type(cudnn.data_type.FLOAT)
out, lse = fwd(q_t, k_t, v_t, handle=handle)
print(f"pythonic Graph, forward: rel_err={rel_err(out, expected):.2e}")

names = ["bwd::q", "bwd::k", "bwd::v", "bwd::o", "bwd::stats", "bwd::dO"]  # the frontend's order
with cudnn.Graph(inputs=names, outputs=["dQ", "dK", "dV"]) as bwd:
    grads = bwd.sdpa_backward(
        name="bwd", q=q_t, k=k_t, v=v_t, o=out, dO=d_o_t, stats=lse, attn_scale=scale, use_causal_mask=True
    )
    for grad, name in zip(grads, ("dQ", "dK", "dV")):
        grad.set_output(True).set_name(name)
d_q, d_k, d_v = bwd(q_t, k_t, v_t, out, lse, d_o_t, handle=handle)
leaves = [t.detach().double().requires_grad_() for t in (q_t, k_t, v_t)]
torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True).backward(d_o_t.double())
worst = max(rel_err(got, leaf.grad) for got, leaf in zip((d_q, d_k, d_v), leaves))
print(f"pythonic Graph, backward: rel_err={worst:.2e}")

# 3. Rebuilding the graph every step, as frontend code often does, costs a cache lookup here.
for _ in range(3):
    with cudnn.Graph(inputs=["fwd::q", "fwd::k", "fwd::v"], outputs=["o"]) as again:
        o, _ = again.sdpa(name="fwd", q=q_t, k=k_t, v=v_t, attn_scale=scale, is_inference=True, use_causal_mask=True)
        o.set_output(True).set_name("o")
    assert rel_err(again(q_t, k_t, v_t, handle=handle), expected) < 2e-2
print(f"plan cache after three rebuilds: {cudnn.default_cache().stats()['builds']} plans built in all")

# 4. The frontend's THD form: sequences packed back to back in one BSHD buffer, each placed by a
#    ragged offset (in elements); seq_len_q/seq_len_kv say how many rows each has.
lengths = torch.tensor([100, 256], dtype=torch.int32, device=device).view(B, 1, 1, 1)
offsets = (torch.cat([lengths.new_zeros(1, 1, 1, 1), lengths.cumsum(0)]) * H * D).to(torch.int64)
packed = [
    torch.randn(B * S * H * D, device=device, dtype=dtype).as_strided((B, H, S, D), (S * H * D, D, H * D, 1))
    for _ in range(4)
]  # q, k, v and O, each one buffer with room for B * S tokens
thd = cudnn.pygraph(
    io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT
)
q, k, v = (thd.tensor_like(t) for t in packed[:3])
ragged_offset = thd.tensor_like(offsets)
for t in (q, k, v):
    t.set_ragged_offset(ragged_offset)
seq_len = thd.tensor_like(lengths)
o, _ = thd.sdpa(
    name="sdpa",
    q=q,
    k=k,
    v=v,
    is_inference=True,
    attn_scale=scale,
    use_causal_mask=True,
    use_padding_mask=True,
    seq_len_q=seq_len,
    seq_len_kv=seq_len,
)
o.set_output(True).set_dim(packed[3].shape).set_stride(packed[3].stride()).set_ragged_offset(ragged_offset)
thd.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
thd.execute({q: packed[0], k: packed[1], v: packed[2], o: packed[3], ragged_offset: offsets, seq_len: lengths}, None)
flat = [t.as_strided((B * S, H, D), (H * D, D, 1)) for t in packed]  # the buffers as [tokens, H, D]
worst, start = 0.0, 0
for n in lengths.flatten().tolist():  # each sequence alone, as torch computes it
    q_s, k_s, v_s = (x[start : start + n].transpose(0, 1).double() for x in flat[:3])
    want = torch.nn.functional.scaled_dot_product_attention(q_s, k_s, v_s, is_causal=True)
    worst = max(worst, rel_err(flat[3][start : start + n].transpose(0, 1), want))
    start += n
print(f"THD with ragged offsets, forward: rel_err={worst:.2e}")

cudnn.destroy_handle(handle)
print("all results match")
