"""Host time per call, every path beside torch's and the frontend's own (``bench --overhead``).

On a tiny shape (b1 h8 s128 d64 bf16) the GPU finishes each kernel before the host issues
the next, so time per call is host time. Paths are timed in short interleaved rounds, each
round a block of calls of every path in a freshly shuffled order after equal warm-up; the table gives each
path's median over rounds and the spread (lowest to highest round). A difference inside the
spread is "same".
"""

from __future__ import annotations

import functools
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from .. import Graph, sdpa, varlen_sdpa
from ..core import synthetic
from ..nn import Attention
from .progress import progress
from .shapes import Shape

ROUNDS = 15
CALLS = 200


def round_order(names: list[str], round_: int) -> list[str]:
    """The order of one round: shuffled afresh each round (seeded, so runs repeat). A fixed
    cyclic order, even rotated, has each path always follow the same one, and a path after a
    light one (a pause, a low-power kernel) reads fast while the GPU's clocks are still up."""
    return random.Random(round_).sample(names, len(names))


def _per_call_us(fn: Callable[[], object], calls: int, sync: bool) -> float:
    """Microseconds per call: host time, or with ``sync`` the whole step, GPU work included."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
        if sync:
            torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def interleaved(
    paths: dict[str, Callable[[], object]], rounds: int = ROUNDS, calls: int = CALLS, sync: bool = False
) -> dict[str, dict]:
    """Median and spread of per-call microseconds of each path, rounds interleaved."""
    for fn in paths.values():
        _per_call_us(fn, 50, sync)  # warm-up: builds, handles, workspaces, allocator
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    for r in progress(range(rounds), "host rounds"):
        for name in round_order(names, r):
            samples[name].append(_per_call_us(paths[name], calls, sync))
            torch.cuda.synchronize()
    return {
        name: {"median_us": statistics.median(v), "low_us": min(v), "high_us": max(v)} for name, v in samples.items()
    }


def _frontend_runs(graph: Graph, t: dict) -> dict[str, Callable[[], object]]:
    """The same plan through the frontend's execute: a prepared dict, and its ordered form."""
    node = graph.nodes[0]
    plan: Any = node.plan
    outputs = {role: synthetic.empty(graph.problems[0].o) for role in node.outputs}
    pack = plan.variant_pack({role: t[role] for role in ("q", "k", "v")}, outputs)
    workspace = torch.empty(max(plan.workspace_size, 1), dtype=torch.uint8, device="cuda")
    from ..ops.cudnn.platform import cudnn_handle

    handle = cudnn_handle(torch.cuda.current_device())
    buffers, uids = tuple(pack.values()), tuple(pack)
    return {
        "frontend execute (dict)": lambda: plan.graph.execute(pack, workspace, handle=handle),
        "frontend execute (ordered)": lambda: plan.graph.execute(buffers, workspace, handle=handle, tensor_uids=uids),
    }


def _decode_runs() -> dict[str, Callable[[], object]]:
    """Eager decode layers of one sequence at 2k (bf16, page 64): a GQA model's (32/8 heads, d128)
    and an MLA model's (16 heads, the 576/512 latent); the GPU's work is a few microseconds. Each
    planned from lengths on the GPU and from host lengths, as a server's scheduler holds them
    (then no sequence is known empty without a sync, and eager layers skip the empty rows' fill)."""
    from ..serving.paged_attention import PagedAttention

    pages = 32
    table = torch.arange(pages, dtype=torch.int32).view(1, pages)
    lengths = torch.tensor([pages * 64], dtype=torch.int32)
    runs: dict[str, Callable[[], object]] = {}
    for name, (hq, hkv, d, dv) in {"GQA": (32, 8, 128, 128), "MLA": (16, 1, 576, 512)}.items():
        cache = torch.randn(pages, hkv, 64, d, device="cuda", dtype=torch.bfloat16)
        v_cache = cache[..., :dv] if dv != d else torch.randn_like(cache)
        q = torch.randn(1, hq, 1, d, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(1, hq, 1, dv, device="cuda", dtype=torch.bfloat16)
        for planned, device in (("", "cuda"), (", host lengths", "cpu")):
            attn = PagedAttention(hq, hkv, d, 64, head_dim_v=dv, dtype=torch.bfloat16, device="cuda")
            attn.plan(table.to(device), lengths.to(device))
            attn.run(q, cache, v_cache, out)
            runs[f"PagedAttention.run, {name} decode{planned}"] = functools.partial(attn.run, q, cache, v_cache, out)
    return runs


def _varlen_runs() -> dict[str, Callable[[], object]]:
    """A packed batch of two 64-token sequences (h8 d64 bf16, causal), forward and fwd+bwd."""
    cu = torch.tensor([0, 64, 128], dtype=torch.int32, device="cuda")
    q, k, v, d_o = (torch.randn(128, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    lq, lk, lv = (x.clone().requires_grad_() for x in (q, k, v))

    def packed(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return varlen_sdpa(a, b, c, cu, cu, 64, 64, is_causal=True)

    return {
        "varlen_sdpa": lambda: packed(q, k, v),
        "varlen_sdpa fwd+bwd": lambda: torch.autograd.grad(packed(lq, lk, lv), [lq, lk, lv], d_o),
    }


def host_paths() -> dict[str, dict]:
    shape = Shape(b=1, h=8, sq=128, skv=128, d=64, layout="BHSD")
    t = shape.tensors("cuda")
    q, k, v, d_o = t["q"], t["k"], t["v"], t["grad_o"]
    lq, lk, lv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    sinks = torch.zeros(shape.h, device="cuda", requires_grad=True)
    with Graph() as g:
        g.sdpa(q, k, v)
    out = torch.empty_like(q)
    torch_sdpa = torch.nn.functional.scaled_dot_product_attention

    def rebuild() -> None:
        with Graph() as h:
            h.sdpa(q, k, v)

    def fwd_bwd(attend: Callable[..., torch.Tensor]) -> Callable[[], object]:
        return lambda: torch.autograd.grad(attend(lq, lk, lv), [lq, lk, lv], d_o)

    paths: dict[str, Callable[[], object]] = {
        "torch sdpa": lambda: torch_sdpa(q, k, v),
        "cudnn_attn.sdpa": lambda: sdpa(q, k, v),
        "torch sdpa, requires_grad": lambda: torch_sdpa(lq, lk, lv),
        "cudnn_attn.sdpa, requires_grad": lambda: sdpa(lq, lk, lv),
        "torch sdpa fwd+bwd": fwd_bwd(torch_sdpa),
        "cudnn_attn.sdpa fwd+bwd": fwd_bwd(sdpa),
        # The score terms of today's models (one autograd function of ours, causal): gpt-oss, Gemma-2.
        "sdpa(sinks=), requires_grad": lambda: sdpa(lq, lk, lv, is_causal=True, sinks=sinks),
        "sdpa(sinks=) fwd+bwd": fwd_bwd(lambda a, b, c: sdpa(a, b, c, is_causal=True, sinks=sinks)),
        "sdpa(softcap=) fwd+bwd": fwd_bwd(lambda a, b, c: sdpa(a, b, c, is_causal=True, softcap=30.0)),
        "sdpa(window_size=) fwd+bwd": fwd_bwd(lambda a, b, c: sdpa(a, b, c, is_causal=True, window_size=(63, 0))),
        "g(q, k, v, out=o)": lambda: g(q, k, v, out=out),
        **_varlen_runs(),
        **_frontend_runs(g, t),
        "with Graph() on a cache hit": rebuild,
        **_decode_runs(),
    }
    return interleaved(paths)


def layer_steps(batch: int, seq: int) -> dict[str, dict]:
    """Wall time of one nn.Attention training step (hidden 2048, 16 heads, causal, bf16),
    synchronised per step, on torch's SDPA and on ours (same weights, same input)."""
    torch.manual_seed(0)
    ours = Attention(2048, 16, causal=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(batch, seq, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step(use_torch: bool) -> Callable[[], object]:
        def run() -> object:
            if use_torch:
                b, s, _ = x.shape
                qkv = ours.qkv(x).view(b, s, 48, 128)
                q_, k_, v_ = (z.transpose(1, 2) for z in qkv.split([16, 16, 16], dim=2))
                o = torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, is_causal=True)
                y = ours.out(o.transpose(1, 2).reshape(b, s, 2048))
            else:
                y = ours(x)
            return torch.autograd.grad(y.float().sum(), [x, *ours.parameters()])

        return run

    steps = {"torch sdpa layer": step(True), "cudnn_attn layer": step(False)}
    return interleaved(steps, rounds=9, calls=20, sync=True)  # a step's time is the GPU's too


def format_host(results: dict[str, dict], title: str) -> str:
    lines = [title, f"  {'path':<46}{'median us':>11}{'spread us':>20}"]
    for name, r in results.items():
        lines.append(f"  {name:<46}{r['median_us']:>11.1f}{r['low_us']:>10.1f} - {r['high_us']:<8.1f}")
    return "\n".join(lines)
