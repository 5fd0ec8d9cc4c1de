"""Context parallelism: one long sequence's attention layer trained across 2 processes, each
holding half of the sequence, with ``cudnn_attn.distributed.context_parallel_sdpa``.

    python samples/07_context_parallel.py

On 2+ GPUs: one process per GPU over NCCL, a long sequence. Otherwise: 2 gloo processes on
the CPU (the reference backend) with tiny shapes. Each rank holds a zigzag shard of the
sequence (``shard``); the layer's QKV and output projections are per token and need nothing
from other ranks; attention is the one step that does. Parameter gradients are summed over
the ranks (as data parallelism would), so every rank takes the same optimizer step. Last,
packed documents: several in one sequence, sharded per document (``shard(x, cu_seqlens=cu)``).
"""

from __future__ import annotations

import datetime
import itertools
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import cudnn_attn
from cudnn_attn.distributed import context_parallel_sdpa, shard, unshard

WORLD = 2
GPU = torch.cuda.device_count() >= WORLD
SEQ, EMBED, HEADS, KV_HEADS = (32768, 1024, 16, 4) if GPU else (64, 64, 4, 2)
STEPS = 10 if GPU else 5
TOLERANCE = 3e-2  # bf16 throughout: weights, activations and gradients


class ContextParallelAttention(nn.Module):
    """Causal self-attention on this rank's shard ``[B, S_shard, E]`` of a sequence sharded
    across ``group``; ``sharded=False`` runs the same weights on a whole sequence on one device."""

    def __init__(self, embed_dim: int, heads: int, kv_heads: int, **factory):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, embed_dim // heads
        self.qkv = nn.Linear(embed_dim, (heads + 2 * kv_heads) * self.head_dim, **factory)
        self.out = nn.Linear(embed_dim, embed_dim, **factory)

    def forward(self, x: torch.Tensor, sharded: bool = True) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=2))
        attend = context_parallel_sdpa if sharded else cudnn_attn.sdpa
        o = attend(q, k, v, is_causal=True, enable_gqa=True)  # BSHD views in, no copies
        return self.out(o.transpose(1, 2).reshape(b, s, -1))


def rel_err(ours: torch.Tensor, expected: torch.Tensor) -> float:
    ours, expected = ours.detach().float(), expected.detach().float()
    return float((ours - expected).norm() / expected.norm())


def check(name: str, err: float, failures: list[str]) -> None:
    print(f"  {name}: rel_err={err:.2e}", flush=True)
    if not err < TOLERANCE:  # written so that NaN fails
        failures.append(f"{name}: relative error {err:.2e} over {TOLERANCE}")


def rank_main(rank: int, init_file: str) -> None:
    device = torch.device("cuda", rank) if GPU else torch.device("cpu")
    if GPU:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    # A bounded timeout: a rank that fails leaves the other waiting in a collective at most this long.
    dist.init_process_group(
        "nccl" if GPU else "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(minutes=5),
    )
    torch.manual_seed(0)  # the same weights and data on every rank
    factory = {"device": device, "dtype": torch.bfloat16}
    layer = ContextParallelAttention(EMBED, HEADS, KV_HEADS, **factory)
    x = torch.randn(1, SEQ, EMBED, **factory)
    target = torch.randn(1, SEQ, EMBED, **factory)
    x_local, target_local = shard(x, seq_dim=1), shard(target, seq_dim=1)
    say = print if rank == 0 else (lambda *a, **k: None)

    # 1. The sharded layer against the same layer on the whole sequence, on one device.
    say(
        f"Context parallelism over {WORLD} {'GPUs (NCCL)' if GPU else 'CPU processes (gloo)'}: "
        f"causal attention layer, sequence of {SEQ} tokens, {SEQ // WORLD} per rank",
        flush=True,
    )
    x_leaf = x_local.detach().requires_grad_()
    y_local = layer(x_leaf)
    y_local.float().square().sum().backward()
    sharded_grad = layer.qkv.weight.grad.float()
    dist.all_reduce(sharded_grad)  # each rank's share of the weight gradient, summed
    y = unshard(y_local.detach(), seq_dim=1)
    dx = unshard(x_leaf.grad, seq_dim=1)
    layer.zero_grad()
    failures: list[str] = []  # raised at the end: a rank leaving early would strand the other
    if rank == 0:
        whole = x.detach().requires_grad_()
        expected = layer(whole, sharded=False)
        expected.float().square().sum().backward()
        check("layer output against one device", rel_err(y, expected), failures)
        check("input gradient against one device", rel_err(dx, whole.grad), failures)
        check("qkv weight gradient against one device", rel_err(sharded_grad, layer.qkv.weight.grad), failures)
    layer.zero_grad()
    dist.barrier()

    # 2. A few training steps: every rank its shard, gradients summed over ranks.
    optimizer = torch.optim.AdamW(layer.parameters(), lr=2e-3)
    losses = []
    for step in range(STEPS):
        if GPU:
            torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad()
        loss_local = (layer(x_local).float() - target_local.float()).square().sum() / target.numel()
        loss_local.backward()
        for p in layer.parameters():
            dist.all_reduce(p.grad)
        optimizer.step()
        loss = loss_local.detach()
        dist.all_reduce(loss)
        if GPU:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        losses.append(loss.item())
        say(f"  step {step}: loss {losses[-1]:.4f}, {SEQ / seconds:,.0f} tokens/s", flush=True)

    # 3. Packed documents (long-context training packs many into one sequence): each causal within
    #    itself under a sliding window, each cut into the ranks' zigzag chunks (shard with
    #    cu_seqlens, the whole sequence's), against varlen_sdpa over the whole packing on one device.
    lengths = [SEQ // 4, SEQ // 8, 3 * SEQ // 8, SEQ // 4]  # each a multiple of 2 x ranks
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    window = (SEQ // 16, 0)
    q, k, v = (torch.randn(SEQ, heads, EMBED // HEADS, **factory) for heads in (HEADS, KV_HEADS, KV_HEADS))
    q_local, k_local, v_local = (shard(t, cu_seqlens=cu) for t in (q, k, v))
    out_local = context_parallel_sdpa(
        q_local, k_local, v_local, cu_seqlens=cu, is_causal=True, enable_gqa=True, window_size=window
    )
    out = unshard(out_local, cu_seqlens=cu)
    say(f"Packed documents of {lengths} tokens, causal within each, window {window[0]}", flush=True)
    if rank == 0:
        expected = cudnn_attn.varlen_sdpa(
            q, k, v, cu, cu, max(lengths), max(lengths), is_causal=True, window_size=window
        )
        check("packed documents against one device", rel_err(out, expected), failures)
    dist.barrier()
    dist.destroy_process_group()
    if not losses[-1] < losses[0]:  # also false for a NaN loss
        failures.append(f"the loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}")
    if failures:
        raise SystemExit("\n".join(failures))
    say("all results match", flush=True)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.get_context("spawn")
        ranks = [context.Process(target=rank_main, args=(rank, os.path.join(tmp, "init"))) for rank in range(WORLD)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(timeout=600)
            if process.is_alive():
                process.kill()
        codes = [process.exitcode for process in ranks]
    if any(codes):
        raise SystemExit(f"a rank failed (exit codes {codes})")
