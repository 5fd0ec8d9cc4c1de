"""Today's model families: gpt-oss's attention sinks and sliding windows, Gemma-2's logit
soft-capping, DeepSeek's MLA decode, each against plain float64 torch on the same inputs.

    python samples/09_model_families.py

1. A gpt-oss attention layer training: ``cudnn_attn.nn.Attention(sinks=True, window=W)``, its
   learned sinks getting gradients like any parameter.
2. Gemma-2's soft-capped attention, dense (``sdpa(softcap=)``) and over packed sequences of
   different lengths (``varlen_sdpa(softcap=)``), forward and backward.
3. A gpt-oss server's decode step with sinks: ``PagedAttention.run(..., sinks=)``.
4. DeepSeek-V3's MLA decode: one latent K/V head for 128 query heads, V a view of the latent
   cache (``PagedAttention(..., head_dim_v=512)``).

Runs on a GPU (cuDNN, and our Triton kernels where they serve better) or, smaller, on the CPU
(the reference backend).
"""

from __future__ import annotations

import torch

import cudnn_attn
from cudnn_attn.nn import Attention

device = "cuda" if torch.cuda.is_available() else "cpu"
gpu = device == "cuda"
dtype = torch.bfloat16
torch.manual_seed(0)
errors: list[float] = []


def check(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
    err = float((got.detach().double() - want.detach().double()).norm() / want.detach().double().norm())
    errors.append(err)
    print(f"{label:<52} rel_err={err:.2e}")


def attention(q, k, v, *, causal=True, window=None, sinks=None, softcap=None, offset=0):
    """float64 attention as the models define it: [B, H, S, D] (K/V heads repeated for GQA); the
    queries are the last S_q of the S_kv positions when ``offset`` = S_kv - S_q."""
    q, k, v = (t.double() for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    rows = torch.arange(q.shape[2], device=q.device)[:, None] + offset
    cols = torch.arange(k.shape[2], device=q.device)[None, :]
    if causal:
        s = s.masked_fill(cols > rows, float("-inf"))
    if window is not None:
        s = s.masked_fill(cols <= rows - window, float("-inf"))
    if sinks is not None:  # one more score per head that weighs no value
        s = torch.cat([s, sinks.double().view(1, -1, 1, 1).expand(*s.shape[:3], 1)], -1)
        return torch.softmax(s, -1)[..., :-1] @ v
    return torch.softmax(s, -1) @ v


# 1. gpt-oss: a layer with learned sinks and a sliding window, one training step --------------------
hidden, heads, kv_heads, window, seq = (4096, 64, 8, 128, 1024) if gpu else (256, 8, 2, 16, 64)  # head dim 64
layer = Attention(
    hidden, heads, num_kv_heads=kv_heads, causal=True, sinks=True, window=window, device=device, dtype=dtype
)
with torch.no_grad():
    layer.sinks.normal_()  # as trained sinks are: not the initial zeros
x = torch.randn(2, seq, hidden, device=device, dtype=dtype)
y = layer(x)
b, s, _ = x.shape
d = hidden // heads
q, k, v = (
    t.transpose(1, 2) for t in layer.qkv(x).view(b, s, heads + 2 * kv_heads, d).split([heads, kv_heads, kv_heads], 2)
)
o = attention(q, k, v, window=window, sinks=layer.sinks).to(dtype)
check("gpt-oss layer (sinks, window) forward", y, layer.out(o.transpose(1, 2).reshape(b, s, heads * d)))
y.float().square().mean().backward()
sinks_ref = layer.sinks.detach().clone().requires_grad_()
o_ref = attention(q.detach(), k.detach(), v.detach(), window=window, sinks=sinks_ref).to(dtype)
y_ref = layer.out(o_ref.transpose(1, 2).reshape(b, s, heads * d))
(sinks_grad,) = torch.autograd.grad(y_ref.float().square().mean(), sinks_ref)
check("gpt-oss layer: the sinks' gradient", layer.sinks.grad, sinks_grad)

# 2. Gemma-2: soft-capped attention, dense and packed --------------------------------------------------
heads, kv_heads, d, seq, cap = (16, 8, 256, 2048, 50.0) if gpu else (4, 2, 32, 64, 5.0)
q = torch.randn(2, heads, seq, d, device=device, dtype=dtype, requires_grad=True)
k, v = (torch.randn(2, kv_heads, seq, d, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
out = cudnn_attn.sdpa(q, k, v, is_causal=True, enable_gqa=True, softcap=cap)
check("Gemma-2 sdpa(softcap=) forward", out, attention(q, k, v, softcap=cap))
d_out = torch.randn_like(out)
grads = torch.autograd.grad(out, (q, k, v), d_out)
leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
want = torch.autograd.grad(attention(*leaves, softcap=cap), leaves, d_out.double())
check("Gemma-2 sdpa(softcap=) dQ", grads[0], want[0])
lengths = [seq // 2, seq, 7, seq // 4]
cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
qp = torch.randn(sum(lengths), heads, d, device=device, dtype=dtype)
kp, vp = (torch.randn(sum(lengths), kv_heads, d, device=device, dtype=dtype) for _ in range(2))
out = cudnn_attn.varlen_sdpa(qp, kp, vp, cu, cu, seq, seq, is_causal=True, enable_gqa=True, softcap=cap)
alone = [
    attention(*(t[int(cu[i]) : int(cu[i + 1])].transpose(0, 1)[None] for t in (qp, kp, vp)), softcap=cap)[0]
    for i in range(len(lengths))
]
check("Gemma-2 varlen_sdpa(softcap=), 4 packed sequences", out, torch.cat([o.transpose(0, 1) for o in alone]))


# 3. and 4. decode from paged caches: gpt-oss with sinks, DeepSeek-V3's MLA ------------------------------
def paged(lengths, pages, page, kv_heads, dim):
    """A cache of random pages handed out in a random order, and each sequence's gathered keys."""
    table = torch.randperm(len(lengths) * pages, device=device).int().view(len(lengths), pages)
    cache = torch.randn(len(lengths) * pages, kv_heads, page, dim, device=device, dtype=dtype)
    gathered = [cache[table[i].long()].transpose(0, 1).reshape(kv_heads, -1, dim)[:, :n] for i, n in enumerate(lengths)]
    return cache, table, torch.tensor(lengths, dtype=torch.int32, device=device), gathered


heads, kv_heads, d, page = (64, 8, 64, 64) if gpu else (8, 2, 32, 16)
lengths = [4000, 130, 1, 2500] if gpu else [40, 13, 1, 25]
cache_k, table, seq_lens, keys = paged(lengths, max(lengths) // page + 1, page, kv_heads, d)
cache_v = torch.randn_like(cache_k)
values = [cache_v[table[i].long()].transpose(0, 1).reshape(kv_heads, -1, d)[:, :n] for i, n in enumerate(lengths)]
sinks = torch.randn(heads, device=device)
q = torch.randn(len(lengths), heads, 1, d, device=device, dtype=dtype)
attn = cudnn_attn.PagedAttention(heads, kv_heads, d, page, dtype=dtype, device=device)
attn.plan(table, seq_lens)
out = attn.run(q, cache_k, cache_v, sinks=sinks)
want = torch.cat(
    [attention(q[i : i + 1], keys[i][None], values[i][None], causal=False, sinks=sinks) for i in range(len(lengths))]
)
check("gpt-oss decode step with sinks (PagedAttention)", out, want)

heads, latent, rope = (128, 512, 64) if gpu else (16, 64, 16)
lengths = [4096, 300, 1000] if gpu else [40, 3, 17]
cache, table, seq_lens, latents = paged(lengths, max(lengths) // page + 1, page, 1, latent + rope)
q = torch.randn(len(lengths), heads, 1, latent + rope, device=device, dtype=dtype)
mla = cudnn_attn.PagedAttention(
    heads, 1, latent + rope, page, head_dim_v=latent, scale=192**-0.5, dtype=dtype, device=device
)
mla.plan(table, seq_lens)
out = mla.run(q, cache, cache[..., :latent])  # V is the latent itself: a view, no copy
want = []
for i in range(len(lengths)):
    c = latents[i][0].double()  # [L, latent + rope]
    want.append(torch.softmax(q[i, :, 0].double() @ c.T * 192**-0.5, -1) @ c[:, :latent])
where = mla.schedule.kernel if device == "cuda" else "the reference backend"  # the CPU runs no GPU kernel
check(f"DeepSeek-V3 MLA decode, {heads} heads ({where})", out[:, :, 0], torch.stack(want))

tolerance = 3e-2
assert all(err < tolerance for err in errors), errors
print("all results match")
