"""Training with cudnn_attn: a drop-in for torch's SDPA and an attention layer, with gradients
checked against plain torch and a few optimizer steps.

    python samples/03_training.py
"""

from __future__ import annotations

import torch

import cudnn_attn

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16
torch.manual_seed(0)

# 1. The drop-in: same call as torch.nn.functional.scaled_dot_product_attention, same gradients.
q, k, v = (torch.randn(2, 8, 128, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
out = cudnn_attn.sdpa(q, k, v, is_causal=True)
out.float().square().mean().backward()
leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True).square().mean().backward()
for name, ours, theirs in zip("qkv", (q, k, v), leaves):
    finite = bool(torch.isfinite(ours.grad).all())
    err = float((ours.grad.float() - theirs.grad).norm() / theirs.grad.norm())
    print(f"  d{name} against torch: rel_err={err:.2e}")
    if not (finite and err < 3e-2):  # written so that NaN fails: NaN < tol is False
        why = "non-finite values in the gradient" if not finite else f"relative error {err:.2e} over 3e-2"
        raise SystemExit(f"d{name} against torch: {why}")

# 2. A tiny model with the attention layer, trained for a few steps.
model = torch.nn.Sequential(
    cudnn_attn.nn.Attention(256, 8, num_kv_heads=2, causal=True, device=device, dtype=dtype),
    torch.nn.Linear(256, 256, device=device, dtype=dtype),
)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(4, 64, 256, device=device, dtype=dtype)
target = torch.randn_like(x)
losses = []
for _ in range(20):
    optimizer.zero_grad()
    loss = (model(x).float() - target.float()).square().mean()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
print(f"  loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
if not losses[-1] < losses[0]:  # also false for a NaN loss
    raise SystemExit(f"the loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}")
print("all results match")
