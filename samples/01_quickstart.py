"""cudnn_attn quickstart: forward, causal, GQA, backward and a paged KV cache.

Runs on cuDNN when a GPU is present, on the pure-PyTorch reference backend otherwise, and
checks every result against the reference computed in float64-free plain torch.

    python samples/01_quickstart.py
"""

from __future__ import annotations

import math

import torch

import cudnn_attn as cudnn

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16
torch.manual_seed(0)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


def check(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float = 2e-2) -> None:
    """Print the relative error and exit non-zero unless the result is finite and within ``tol``."""
    finite = bool(torch.isfinite(actual).all())
    err = rel_err(actual, expected)
    ok = finite and err < tol  # written so that NaN fails: NaN < tol is False
    print(f"  {name:<34} rel_err={err:.2e}  {'ok' if ok else 'MISMATCH'}")
    if not ok:
        why = "non-finite values in the result" if not finite else f"relative error {err:.2e} over {tol}"
        raise SystemExit(f"{name}: {why}")


def torch_attention(q, k, v, **kwargs):
    return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs)


print(f"cudnn_attn {cudnn.__version__} on {device}")
b, h, s, d = 2, 8, 256, 64
q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype) for _ in range(3))

# 1. Forward, with the softmax stats a training step keeps for the backward.
with cudnn.Graph() as g:
    o, stats = g.sdpa(q, k, v, attn_scale=1 / math.sqrt(d), generate_stats=True)
out, lse = g(q, k, v)
check("forward", out, torch_attention(q, k, v))

# 2. Causal, in BSHD layout: a transposed view, no copy.
q_bshd, k_bshd, v_bshd = (torch.randn(b, s, h, d, device=device, dtype=dtype).transpose(1, 2) for _ in range(3))
with cudnn.Graph() as g:
    g.sdpa(q_bshd, k_bshd, v_bshd, use_causal_mask=True)
check("causal, BSHD", g(q_bshd, k_bshd, v_bshd), torch_attention(q_bshd, k_bshd, v_bshd, is_causal=True))

# 3. Grouped-query attention: 8 query heads share 2 K/V heads.
k_gqa, v_gqa = (torch.randn(b, 2, s, d, device=device, dtype=dtype) for _ in range(2))
with cudnn.Graph() as g:
    g.sdpa(q, k_gqa, v_gqa, use_causal_mask=True)
check("GQA 8/2, causal", g(q, k_gqa, v_gqa), torch_attention(q, k_gqa, v_gqa, is_causal=True, enable_gqa=True))

# 4. Backward: forward and backward in one graph, the backward reading O and Stats.
d_o = torch.randn_like(q)
with cudnn.Graph() as g:
    o, stats = g.sdpa(q, k, v, use_causal_mask=True, generate_stats=True)
    dq, dk, dv = g.sdpa_backward(q, k, v, o, d_o, stats, use_causal_mask=True)
_, _, grad_q, grad_k, grad_v = g(q, k, v, d_o)
leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True).backward(d_o.float())
for name, actual, leaf in zip(("dQ", "dK", "dV"), (grad_q, grad_k, grad_v), leaves):
    check(f"backward {name}", actual, leaf.grad)

# 5. Decode over a paged KV cache: one new token per sequence, caches in 16-token pages.
page, pages_per_seq = 16, s // 16
k_cache, v_cache = (torch.randn(b * pages_per_seq, page, 2, d, device=device, dtype=dtype) for _ in range(2))
table = torch.randperm(b * pages_per_seq, device=device).view(b, pages_per_seq).to(torch.int32)
lengths = torch.tensor([s, s - 37], device=device, dtype=torch.int32)
q_new = torch.randn(b, h, 1, d, device=device, dtype=dtype)
with cudnn.Graph() as g:
    g.sdpa_with_paged_cache(q_new, k_cache, v_cache, table, seq_len_kv=lengths)
decoded = g(q_new, k_cache, v_cache, table, lengths)
for i in range(b):  # the dense equivalent: gather this sequence's pages, keep its valid tokens
    n = int(lengths[i])
    k_seq = k_cache[table[i].long()].reshape(-1, 2, d)[:n].transpose(0, 1)[None]
    v_seq = v_cache[table[i].long()].reshape(-1, 2, d)[:n].transpose(0, 1)[None]
    check(
        f"paged decode, sequence {i}",
        decoded[i : i + 1],
        torch_attention(q_new[i : i + 1], k_seq, v_seq, enable_gqa=True),
    )

print("plan cache:", {k: v for k, v in cudnn.default_cache().stats().items() if k in ("builds", "hits", "misses")})
print("all results match")
