"""FP8 attention: the graph op with scales by hand, the drop-in that scales for you, FP8 in and
out for FP8 producers and consumers, and a paged decode over FP8 K/V caches.

On a Hopper (or newer) GPU it runs cuDNN's FP8 kernels; elsewhere the reference backend's
exact emulation of them. Every result is checked against attention in float32 on the
unquantised inputs: FP8 keeps about 6% relative error (five quantisations of ~3% each).

    python samples/04_fp8.py
"""

from __future__ import annotations

import math

import torch

import cudnn_attn as cudnn

fp8_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
device = "cuda" if fp8_gpu else "cpu"
torch.manual_seed(0)
E4M3 = torch.float8_e4m3fn


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm())


def check(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float = 0.07) -> None:
    finite = bool(torch.isfinite(actual).all())
    err = rel_err(actual, expected)
    ok = finite and err < tol  # written so that NaN fails
    print(f"  {name:<40} rel_err={err:.2e}  {'ok' if ok else 'MISMATCH'}")
    if not ok:
        raise SystemExit(f"{name}: {'non-finite values' if not finite else f'relative error {err:.2e} over {tol}'}")


def quantise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor current scaling: the largest magnitude lands on E4M3's largest value, 448."""
    scale = (448.0 / x.abs().max().float()).reshape(1, 1, 1, 1)
    return (x.float() * scale).clamp(-448, 448).to(E4M3), 1.0 / scale


print(f"cudnn_attn {cudnn.__version__}: FP8 on {'cuDNN' if fp8_gpu else 'the reference backend'}")
b, h, s, d = 2, 8, 256, 128
q, k, v = (torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16) for _ in range(3))
expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)

# 1. The graph op, with the frontend's names and order: FP8 data, float32 [1, 1, 1, 1] scales.
(q8, descale_q), (k8, descale_k), (v8, descale_v) = quantise(q), quantise(k), quantise(v)
scale_s = torch.full((1, 1, 1, 1), 448.0, device=device)  # P is in [0, 1]
scale_o = 1.0 / descale_v  # every row of O is a convex combination of V's rows: |O| <= max|V|
with cudnn.Graph() as g:
    o, _, amax_s, amax_o = g.sdpa_fp8(  # no stats: outputs O, Amax_S, Amax_O
        q8, k8, v8, descale_q, descale_k, descale_v, 1.0 / scale_s, scale_s, scale_o, use_causal_mask=True
    )
out8, _, o_amax = g(q8, k8, v8, descale_q, descale_k, descale_v, 1.0 / scale_s, scale_s, scale_o)
check("g.sdpa_fp8, dequantised O", out8.float() / scale_o, expected)
print(f"  Amax_O = {float(o_amax):.3f} (max |O| before scale_o; the next step's scale comes from it)")

# 2. The drop-in: bf16 in and out, scaling done for you, differentiable (gradients in bf16).
q.requires_grad_()
out = cudnn.sdpa_fp8(q, k, v, is_causal=True)
check("cudnn_attn.sdpa_fp8", out, expected)
(grad_q,) = torch.autograd.grad(out.float().sum(), [q])
leaf = q.detach().float().requires_grad_()
torch.nn.functional.scaled_dot_product_attention(leaf, k.float(), v.float(), is_causal=True).sum().backward()
check("cudnn_attn.sdpa_fp8 gradient of q", grad_q, leaf.grad)

# 3. A layer: nn.Attention(..., fp8=True) against the same weights in bf16.
layer = cudnn.nn.Attention(512, 4, causal=True, fp8=True, device=device, dtype=torch.bfloat16)
plain = cudnn.nn.Attention(512, 4, causal=True, device=device, dtype=torch.bfloat16)
plain.load_state_dict(layer.state_dict())
x = torch.randn(2, 128, 512, device=device, dtype=torch.bfloat16)
check("nn.Attention(fp8=True) vs bf16", layer(x), plain(x))
# 4. FP8 in and out: where the producer already writes FP8 (an FP8 projection or cache) and the
#    consumer reads it (an FP8 matmul), Fp8Tensor skips the casts around the kernel.
q8, k8, v8 = (cudnn.Fp8Tensor.quantise(x.detach()) for x in (q, k, v))  # E4M3 data and its descale
o8 = cudnn.sdpa_fp8(q8, k8, v8, is_causal=True)  # FP8 in, FP8 out: an Fp8Tensor
print(f"  O in {o8.data.dtype}, descale {float(o8.descale):.2e} (V's: |O| <= max|V|)")
check("sdpa_fp8 on Fp8Tensors, dequantised O", o8.dequantise(), expected)

# 5. Decode over FP8 K/V caches (vLLM's kv_cache_dtype="fp8"): half the bytes a step reads.
heads, kv_heads, page, lengths = 8, 2, 16, [40, 64, 7]
pages = math.ceil(max(lengths) / page)
table = torch.arange(len(lengths) * pages, dtype=torch.int32, device=device).view(len(lengths), pages)
k_cache, v_cache = (
    torch.randn(table.numel(), kv_heads, page, d, device=device, dtype=torch.bfloat16) for _ in range(2)
)
k_scale, v_scale = (float(c.abs().max()) / 448.0 for c in (k_cache, v_cache))  # real = scale * stored
k_cache8, v_cache8 = ((c.float() / sc).to(E4M3) for c, sc in ((k_cache, k_scale), (v_cache, v_scale)))
attn = cudnn.PagedAttention(heads, kv_heads, d, page, dtype=torch.bfloat16, kv_dtype=E4M3, device=device)
attn.plan(table, torch.tensor(lengths, dtype=torch.int32, device=device))
query = torch.randn(len(lengths), heads, 1, d, device=device, dtype=torch.bfloat16)
out = attn.run(query, k_cache8, v_cache8, k_scale=k_scale, v_scale=v_scale)
for i, n in enumerate(lengths):  # each sequence against float32 attention over its 16-bit cache
    keys, values = (c[table[i].long()].transpose(0, 1).flatten(1, 2)[:, :n].float() for c in (k_cache, v_cache))
    alone = torch.nn.functional.scaled_dot_product_attention(
        query[i : i + 1].float(), keys[None], values[None], enable_gqa=True
    )
    check(f"PagedAttention over FP8 caches, sequence {i}", out[i : i + 1], alone)
print("all results match")
