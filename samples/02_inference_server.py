"""An inference server's pattern: warm plans once, serve many lengths with few plans, decode
from a paged KV cache. Plans persist under CUDNN_ATTN_CACHE_DIR, so a restarted server
skips building and tuning.

    python samples/02_inference_server.py
"""

from __future__ import annotations

import time

import torch

import cudnn_attn

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16
heads, kv_heads, head_dim, page = 8, 2, 64, 16
torch.manual_seed(0)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def check(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float = 2e-2) -> None:
    """Print the relative error and exit non-zero unless the result is finite and within ``tol``."""
    finite = bool(torch.isfinite(actual).all())
    err = rel_err(actual, expected)
    ok = finite and err < tol  # written so that NaN fails: NaN < tol is False
    print(f"  {name:<40} rel_err={err:.2e}  {'ok' if ok else 'MISMATCH'}")
    if not ok:
        why = "non-finite values in the result" if not finite else f"relative error {err:.2e} over {tol}"
        raise SystemExit(f"{name}: {why}")


print(
    f"serving on {device}; plan store: {cudnn_attn.default_cache().store.path if cudnn_attn.default_cache().store else 'off'}"
)

# 1. Prefill: prompts of many lengths, served by a handful of bucketed plans (autotuned on a GPU).
prefill = cudnn_attn.BucketedAttention(buckets=(64, 128, 256), causal="bottom_right", autotune=True)
for length in (17, 50, 64, 99, 130, 200, 255):
    q, k, v = (torch.randn(1, h, length, head_dim, device=device, dtype=dtype) for h in (heads, kv_heads, kv_heads))
    start = time.perf_counter()
    out = prefill(q, k, v)
    took = (time.perf_counter() - start) * 1e3
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True
    )
    check(f"prefill, {length:3d} tokens ({took:6.1f} ms)", out, expected)
print(f"  {prefill.plan_count} plans served 7 prompt lengths")

# 2. Decode: one new token per sequence, against a paged KV cache of 16-token pages.
batch, pages_per_seq = 4, 16
k_cache, v_cache = (
    torch.randn(batch * pages_per_seq, page, kv_heads, head_dim, device=device, dtype=dtype) for _ in range(2)
)
table = torch.randperm(batch * pages_per_seq, device=device).view(batch, pages_per_seq).to(torch.int32)
lengths = torch.tensor([256, 100, 31, 200], device=device, dtype=torch.int32)
q_new = torch.randn(batch, heads, 1, head_dim, device=device, dtype=dtype)
with cudnn_attn.Graph() as decode:
    decode.sdpa_with_paged_cache(q_new, k_cache, v_cache, table, seq_len_kv=lengths)
for step in range(3):  # every step reuses the built plan: same shapes, new data
    q_new.normal_()
    out = decode(q_new, k_cache, v_cache, table, lengths)
    i = step % batch
    n = int(lengths[i])
    k_seq = k_cache[table[i].long()].reshape(-1, kv_heads, head_dim)[:n].transpose(0, 1)[None]
    v_seq = v_cache[table[i].long()].reshape(-1, kv_heads, head_dim)[:n].transpose(0, 1)[None]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q_new[i : i + 1].float(), k_seq.float(), v_seq.float(), enable_gqa=True
    )
    check(f"decode step {step}, sequence {i} ({n} cached tokens)", out[i : i + 1], expected)

print("plan cache:", {k: v for k, v in cudnn_attn.default_cache().stats().items() if k in ("builds", "hits", "misses")})
print("all results match")
