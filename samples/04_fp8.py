"""FP8 attention: the graph op with scales by hand, then the drop-in that scales for you.

On a Hopper (or newer) GPU it runs cuDNN's FP8 kernels; elsewhere the reference backend's
exact emulation of them. Every result is checked against attention in float32 on the
unquantised inputs: FP8 keeps about 6% relative error (five quantisations of ~3% each).

    python samples/04_fp8.py
"""

from __future__ import annotations

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
print("all results match")
