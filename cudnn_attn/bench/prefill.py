"""``cudnn-attn bench --serving``, chunked prefill: mixed query chunks over paged caches.

A serving step that prefills: ``BATCH`` sequences, each with a chunk of 1-512 new tokens at the
end of a cache of up to 16k tokens (bottom-right causal), Hq32 Hkv8 d128 bf16, pages of 64.
Effective TFLOP/s count only the visible (query, key) pairs, ``4 * H * D`` each, and are
compared with the same measure on a dense causal batch of similar work (the rate a plain
prefill reaches) and with what torch offers for the mixed step: its SDPA on queries padded to
the longest chunk, K/V gathered contiguously, and a boolean mask. Each column is ``LAYERS``
layers captured in a CUDA graph, timed in interleaved rounds; each is checked against float32.

``prefill_memory`` runs the same step once eagerly on a fresh ``PagedAttention`` and reads
torch's allocator: bytes beyond the step's tensors (query, one layer's caches, the output) at
the peak, what the planner keeps between steps, and what stays once it and the tensors are freed.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from .. import PagedAttention
from ..functional import sdpa
from .serving import LAYERS, _captured, _time

HQ, HKV, D, PAGE = 32, 8, 128, 64
BATCH, LONGEST_CHUNK, LONGEST_CACHE = 16, 512, 16384
DENSE_SEQ = 2048


def _mixed_step(seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    q_lens = torch.randint(1, LONGEST_CHUNK + 1, (BATCH,), generator=gen, dtype=torch.int32)
    kv_lens = (q_lens + (torch.rand(BATCH, generator=gen) * (LONGEST_CACHE - q_lens)).int()).to(torch.int32)
    pages = LONGEST_CACHE // PAGE
    table = torch.randperm(BATCH * pages, generator=gen).view(BATCH, pages).int()
    caches = [
        [torch.randn(BATCH * pages, HKV, PAGE, D, generator=gen).to("cuda", torch.bfloat16) for _ in range(2)]
        for _ in range(LAYERS)
    ]
    q = torch.randn(int(q_lens.sum()), HQ, D, generator=gen).to("cuda", torch.bfloat16)
    return {"q": q, "q_lens": q_lens, "kv_lens": kv_lens, "table": table, "caches": caches}


def _visible_pairs(q_lens: torch.Tensor, kv_lens: torch.Tensor) -> int:
    """(query, key) pairs a bottom-right causal chunk sees: query i of n sees kv - n + i + 1 keys."""
    return sum(n * (kv - n) + n * (n + 1) // 2 for n, kv in zip(q_lens.tolist(), kv_lens.tolist()))


def _padded_torch(t: dict[str, Any]) -> tuple[torch.Tensor, list, torch.Tensor, torch.Tensor]:
    """torch's form of the step: q padded to the longest chunk, contiguous K/V, a boolean mask."""
    q_lens, kv_lens = t["q_lens"], t["kv_lens"]
    longest, cache = int(q_lens.max()), int(kv_lens.max())
    padded = torch.zeros(BATCH, HQ, longest, D, dtype=torch.bfloat16, device="cuda")
    starts = torch.cumsum(q_lens, 0) - q_lens
    for b, (start, n) in enumerate(zip(starts.tolist(), q_lens.tolist())):
        padded[b, :, :n] = t["q"][start : start + n].transpose(0, 1)
    table = t["table"].long().cuda()
    dense = [
        tuple(c[table].permute(0, 2, 1, 3, 4).flatten(2, 3)[:, :, :cache].contiguous() for c in layer)
        for layer in t["caches"]
    ]
    rows = torch.arange(longest, device="cuda").view(1, -1, 1)
    keys = torch.arange(cache, device="cuda").view(1, 1, -1)
    n, kv = q_lens.cuda().view(-1, 1, 1), kv_lens.cuda().view(-1, 1, 1)
    mask = ((keys <= kv - n + rows) & (keys < kv)) | (rows >= n)  # padded rows see every key: no NaN
    return padded, dense, mask.unsqueeze(1), starts


def prefill_row(seed: int = 0) -> dict[str, Any]:
    t = _mixed_step(seed)
    q = t["q"]
    attn = PagedAttention(
        HQ,
        HKV,
        D,
        PAGE,
        dtype=torch.bfloat16,
        device="cuda",
        max_batch=BATCH,
        max_pages_per_seq=t["table"].shape[1],
        cuda_graph=True,
    )
    attn.plan(t["table"].cuda(), t["kv_lens"].cuda(), q_lens=t["q_lens"])
    outs = [torch.empty_like(q) for _ in range(LAYERS)]
    padded, dense, mask, starts = _padded_torch(t)
    torch_outs = [torch.empty_like(padded) for _ in range(LAYERS)]
    flops = 4 * HQ * D * _visible_pairs(t["q_lens"], t["kv_lens"])
    dense_batch = max(1, round(flops / (4 * HQ * D * DENSE_SEQ * (DENSE_SEQ + 1) / 2)))
    dq = torch.randn(dense_batch, HQ, DENSE_SEQ, D, dtype=torch.bfloat16, device="cuda")
    dkv = [torch.randn(dense_batch, HKV, DENSE_SEQ, D, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    dense_out = torch.empty_like(dq)

    def ours(layer: int) -> None:
        attn.run(q, t["caches"][layer][0], t["caches"][layer][1], out=outs[layer])

    def padded_torch(layer: int) -> None:
        k, v = dense[layer]
        torch_outs[layer].copy_(
            torch.nn.functional.scaled_dot_product_attention(padded, k, v, attn_mask=mask, enable_gqa=True)
        )

    def dense_causal(layer: int) -> None:
        dense_out.copy_(sdpa(dq, dkv[0], dkv[1], is_causal=True, enable_gqa=True))

    paths = {
        "PagedAttention, chunked prefill": _captured(ours),
        "torch sdpa, padded q + mask": _captured(padded_torch),
        f"dense causal B{dense_batch} S{DENSE_SEQ} (cudnn_attn.sdpa)": _captured(dense_causal),
    }
    timings = _time(paths, rounds=8, replays=5)
    dense_flops = dense_batch * 4 * HQ * D * DENSE_SEQ * (DENSE_SEQ + 1) // 2
    row: dict[str, Any] = {
        "batch": BATCH,
        "q_lens": t["q_lens"].tolist(),
        "kv_lens": t["kv_lens"].tolist(),
        "tflop": flops / 1e12,
        "schedule": str(attn.schedule),
        "columns": {},
    }
    errors = _errors(t, outs[-1], torch_outs[-1], starts)
    for name, cell in timings.items():
        per_layer = cell["us"] / LAYERS
        work = dense_flops if name.startswith("dense") else flops
        row["columns"][name] = {
            "us_per_layer": per_layer,
            "spread_pct": 100 * (cell["high"] - cell["low"]) / cell["us"],
            "tflops": work / (per_layer * 1e-6) / 1e12,
            "rel_err": errors.get(name),
        }
    return row


def prefill_memory(seed: int = 0) -> dict[str, int]:
    """Memory of one eager chunked-prefill step (plan and run, one layer) on a fresh planner:
    ``io_bytes`` (q, the layer's two caches, the output), ``peak_extra`` beyond them,
    ``planner_bytes`` what the planner holds between steps, ``held_after`` once it is freed too."""
    device = torch.device("cuda", torch.cuda.current_device())
    t = _mixed_step(seed)
    q, (k_cache, v_cache) = t["q"], t["caches"][0]
    del t["caches"][1:]
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    attn = PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device="cuda")
    attn.plan(t["table"].cuda(), t["kv_lens"].cuda(), q_lens=t["q_lens"])
    out = attn.run(q, k_cache, v_cache)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    io_bytes = sum(x.numel() * x.element_size() for x in (q, k_cache, v_cache, out))
    out_bytes = out.numel() * out.element_size()
    del out
    torch.cuda.synchronize(device)
    planner = torch.cuda.memory_allocated(device) - start
    del attn
    gc.collect()
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device) - start
    return {"io_bytes": io_bytes, "peak_extra": peak - start - out_bytes, "planner_bytes": planner, "held_after": held}


def _errors(t: dict[str, Any], ours: torch.Tensor, padded_out: torch.Tensor, starts: torch.Tensor) -> dict[str, float]:
    """Relative error of the last layer's outputs against float32 attention, sequence by sequence."""
    k_cache, v_cache = t["caches"][-1]
    table = t["table"].long().cuda()
    worst = {"PagedAttention, chunked prefill": 0.0, "torch sdpa, padded q + mask": 0.0}
    for b, (start, n, kv) in enumerate(zip(starts.tolist(), t["q_lens"].tolist(), t["kv_lens"].tolist())):
        k, v = (c[table[b]].permute(1, 0, 2, 3).flatten(1, 2)[:, :kv].float() for c in (k_cache, v_cache))
        qb = t["q"][start : start + n].transpose(0, 1).float()
        visible = torch.arange(kv, device="cuda")[None, :] <= (kv - n + torch.arange(n, device="cuda"))[:, None]
        want = torch.nn.functional.scaled_dot_product_attention(qb, k, v, attn_mask=visible, enable_gqa=True)
        for name, got in (
            ("PagedAttention, chunked prefill", ours[start : start + n].transpose(0, 1)),
            ("torch sdpa, padded q + mask", padded_out[b, :, :n]),
        ):
            worst[name] = max(worst[name], float((got.float() - want).norm() / want.norm()))
    return worst


def format_prefill(row: dict[str, Any]) -> str:
    lines = [
        f"Chunked prefill per layer inside a CUDA-graph replay (B{row['batch']}, chunks 1-{LONGEST_CHUNK} over "
        f"caches up to {LONGEST_CACHE}, Hq{HQ} Hkv{HKV} d{D} bf16; {row['tflop']:.2f} TFLOP of visible pairs):"
    ]
    for name, c in row["columns"].items():
        err = f", rel err {c['rel_err']:.1e}" if c["rel_err"] is not None else ""
        lines.append(
            f"    {name:<44}{c['us_per_layer']:>9.1f} us  {c['tflops']:>6.1f} TFLOP/s  "
            f"(spread {c['spread_pct']:.0f}%{err})"
        )
    memory = row.get("memory")
    if memory:
        lines.append(
            f"    memory of one eager step (plan + run, one layer): peak extra {memory['peak_extra'] / 1e6:.1f} MB "
            f"over {memory['io_bytes'] / 1e9:.2f} GB of tensors, planner holds "
            f"{memory['planner_bytes'] / 1e6:.2f} MB, held after {memory['held_after'] / 1e6:.2f} MB"
        )
    return "\n".join(lines)
