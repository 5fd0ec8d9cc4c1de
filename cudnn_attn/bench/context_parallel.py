"""Context parallelism benchmark: ``context_parallel_sdpa`` over W GPUs against one GPU.

    python3 -m cudnn_attn.bench.context_parallel --gpus 8 --seq 131072 [--mode p2p] [--json out.json]

Spawns one process per GPU (NCCL) and times a causal bf16 training step (forward+backward,
B1 H16 d128 by default) of the whole sequence S sharded over W GPUs (zigzag), beside the
library's single-GPU attention (``cudnn_attn.sdpa``) over the same S on GPU 0. For the p2p
ring it also times the overlap evidence: the same ring with every transfer left out
(``compute only``: each rank reuses its own K/V every step) and the transfers alone
(``communication only``). With full overlap, p2p takes max(compute, communication), not
their sum. ``--cpu`` runs the same on gloo CPU processes with tiny shapes (a smoke test).

``--packed`` times packed documents instead: S tokens in all (128k, 256k), document lengths
drawn from a long-tailed (lognormal, seeded) distribution and rounded to multiples of 64W, each
document causal within itself. Columns: packed context parallelism over W GPUs, the same
packing on one GPU (``cudnn_attn.varlen_sdpa``), and the documents padded to the longest on
one GPU (``cudnn_attn.sdpa``, causal, padding computed; left out with ``--no-padded``). It
also reports each column's memory (``memory.step_memory``: peak bytes beyond the step's
tensors and bytes held after, the largest over ranks). ``--kv-heads`` makes it GQA.

Columns are timed in short interleaved rounds in a shuffled order (``host.round_order``,
the same on every rank) after equal warm-up; a round's time is the slowest rank's wall time
per step (a step ends when every rank's GPU is done); each column reports its median over
rounds and its spread (lowest to highest round). A difference inside the spread is "same".
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..distributed import context_parallel_sdpa, shard, unshard
from ..distributed.checks import CONTEXT, checked
from ..distributed.context_parallel import Setup, attend
from ..distributed.exchange import Pending, Ring
from ..distributed.process_group import Members, members
from ..functional import sdpa
from ..varlen import varlen_sdpa
from . import memory
from .host import round_order

SINGLE = "single device (cudnn_attn.sdpa)"
VARLEN = "same packing, one device (varlen_sdpa)"
PADDED = "padded to the longest, one device (sdpa)"


class LocalRing(Ring):
    """The ring's schedule with the transfers left out: each rank receives its own buffer back."""

    def __init__(self, m: Members):
        self.members = m
        self.rank, self.world, self.group = m.rank, m.world, m.group

    def shift(self, buffer: torch.Tensor, tag: int, into: torch.Tensor | None = None) -> Pending:
        return Pending([], buffer)


def compute_only_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False) -> torch.Tensor:
    """The p2p ring's schedule and attention calls with every transfer left out: each rank attends
    to its own K/V at every step. Wrong results by design: the compute-only column, timed beside
    ``context_parallel_sdpa``, never read."""
    m = members(None, CONTEXT)
    c = checked(q, k, v, m, is_causal, None, "p2p", False, "zigzag")
    return attend(q, k, v, Setup(m, c.scale, c.is_causal, "p2p", "zigzag", ring_type=LocalRing))


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the ranks, print the table (and write ``--json``). Returns the exit code."""
    args = _parser().parse_args(argv)
    if not args.cpu and torch.cuda.device_count() < 2:
        print(
            f"bench.context_parallel: needs 2+ CUDA GPUs ({torch.cuda.device_count()} here); "
            "--cpu runs a small smoke test on gloo CPU processes",
            file=sys.stderr,
        )
        return 2
    world = args.gpus or (2 if args.cpu else torch.cuda.device_count())
    if not args.cpu and world > torch.cuda.device_count():
        print(f"bench.context_parallel: --gpus {world} but {torch.cuda.device_count()} here", file=sys.stderr)
        return 2
    seq = args.seq or (64 if args.cpu else 131072 if args.packed else 65536)
    if world < 1 or seq % (2 * world):
        print(
            f"bench.context_parallel: --seq {seq} must be a multiple of 2 x {world} ranks (zigzag: 2 chunks each)",
            file=sys.stderr,
        )
        return 2
    report = run(world, vars(args))
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python3 -m cudnn_attn.bench.context_parallel", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--gpus", type=int, default=None, help="ranks (one per GPU); default: every GPU (2 with --cpu)")
    parser.add_argument("--seq", type=int, default=None, help="whole sequence length (default 65536; 64 with --cpu)")
    parser.add_argument("--mode", choices=("p2p", "all_gather"), default="p2p")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=None, help="default 16 (2 with --cpu)")
    parser.add_argument("--head-dim", type=int, default=None, help="default 128 (32 with --cpu)")
    parser.add_argument("--kv-heads", type=int, default=None, help="K/V heads (GQA); default: --heads")
    parser.add_argument("--no-padded", action="store_true", help="--packed: leave out the padded column")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (the spread comes from these)")
    parser.add_argument("--steps", type=int, default=None, help="steps per column per round (default 3; 1 with --cpu)")
    parser.add_argument("--cpu", action="store_true", help="gloo CPU processes and tiny shapes: a smoke test")
    parser.add_argument(
        "--packed", action="store_true", help="packed documents of long-tailed lengths, S tokens in all"
    )
    parser.add_argument("--seed", type=int, default=0, help="the document lengths' seed (--packed)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    return parser


def run(world: int, options: dict[str, Any]) -> dict[str, Any]:
    """Spawn ``world`` ranks, measure, return rank 0's report (raises with a rank's traceback)."""
    cpu = bool(options.get("cpu"))
    options = {
        **options,
        "seq": options.get("seq") or (64 if cpu else 131072 if options.get("packed") else 65536),
        "heads": options.get("heads") or (2 if cpu else 16),
        "kv_heads": options.get("kv_heads") or options.get("heads") or (2 if cpu else 16),
        "head_dim": options.get("head_dim") or (32 if cpu else 128),
        "steps": options.get("steps") or (1 if cpu else 3),
        "batch": options.get("batch") or 1,
        "rounds": options.get("rounds") or 7,
        "mode": options.get("mode") or "p2p",
        "packed": bool(options.get("packed")),
        "seed": options.get("seed") or 0,
    }
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        ranks = [context.Process(target=_rank, args=(rank, world, init, options, results)) for rank in range(world)]
        for process in ranks:
            process.start()
        try:
            report = _first_report(results, ranks)
        finally:
            for process in ranks:
                process.join(timeout=60)
                if process.is_alive():
                    process.kill()
    if "error" in report:
        raise RuntimeError(f"rank {report['rank']} failed:\n{report['error']}")
    return report


def _first_report(results: Any, ranks: list) -> dict[str, Any]:
    """Rank 0's report or the first rank's error; a rank that died without one (a crash) ends the wait."""
    while True:
        try:
            return results.get(timeout=5)
        except queue.Empty:
            dead = [(i, p.exitcode) for i, p in enumerate(ranks) if p.exitcode not in (None, 0)]
            if dead:
                return {"rank": dead[0][0], "error": f"exited with code {dead[0][1]} and no report"}


def _rank(rank: int, world: int, init: str, options: dict[str, Any], results: Any) -> None:
    cpu = options["cpu"]
    if cpu:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        device, backend = torch.device("cpu"), "gloo"
    else:
        torch.cuda.set_device(rank)
        device, backend = torch.device("cuda", rank), "nccl"
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        report = (_measure_packed if options["packed"] else _measure)(rank, world, device, options)
        if rank == 0:
            results.put(report)
    except Exception:
        results.put({"rank": rank, "error": traceback.format_exc()})
    finally:
        dist.destroy_process_group()


def _measure(rank: int, world: int, device: torch.device, o: dict[str, Any]) -> dict[str, Any]:
    b, h, s, d, mode = o["batch"], o["heads"], o["seq"], o["head_dim"], o["mode"]
    gen = torch.Generator(device).manual_seed(0)  # the same whole sequence on every rank
    whole = [torch.randn(b, h, s, d, generator=gen, device=device).to(torch.bfloat16) for _ in range(4)]
    local = [shard(t) for t in whole]
    leaves = [t.detach().requires_grad_() for t in local[:3]]
    if rank != 0:
        whole = []  # only rank 0 runs the single-device column

    columns = {
        f"context_parallel {mode}": _step(
            lambda q, k, v: context_parallel_sdpa(q, k, v, is_causal=True, mode=mode), leaves, local[3]
        )
    }
    if mode == "p2p":
        columns["context_parallel p2p, compute only"] = _step(
            lambda q, k, v: compute_only_ring(q, k, v, is_causal=True), leaves, local[3]
        )
        columns["communication only"] = _ring_transfers(leaves[1], leaves[2])
    if rank == 0:
        single = [t.detach().requires_grad_() for t in whole[:3]]
        columns[SINGLE] = _step(lambda q, k, v: sdpa(q, k, v, is_causal=True), single, whole[3])
    else:
        columns[SINGLE] = lambda: None  # the others wait at the barrier: the slowest rank is rank 0

    out = unshard(context_parallel_sdpa(*leaves, is_causal=True, mode=mode).detach())
    error = float("nan")
    if rank == 0:
        expected = sdpa(whole[0], whole[1], whole[2], is_causal=True).float()
        error = float((out.float() - expected).norm() / expected.norm())

    flops = 3.5 * 4.0 * b * h * s * s * d / 2  # causal forward (half the square) + backward (2.5x)
    cells = _cells(columns, o, device, flops)
    overlap = None
    if mode == "p2p":
        exposed = cells["context_parallel p2p"]["median_ms"] - cells["context_parallel p2p, compute only"]["median_ms"]
        transfers = cells["communication only"]["median_ms"]
        hidden = min(1.0, max(0.0, 1.0 - max(0.0, exposed) / transfers)) if transfers > 0 else float("nan")
        overlap = {"exposed_ms": exposed, "transfers_ms": transfers, "hidden_fraction": hidden}
    return {
        "world": world,
        "seq": s,
        "batch": b,
        "heads": h,
        "head_dim": d,
        "mode": mode,
        "layout": "zigzag",
        "dtype": "bfloat16",
        "device": _device_name(device),
        "rounds": o["rounds"],
        "steps": o["steps"],
        "cells": cells,
        "overlap": overlap,
        "rel_err_vs_single": error,
        "baseline": SINGLE,
    }


def _step(attend: Callable[..., torch.Tensor], inputs: list[torch.Tensor], d_out: torch.Tensor) -> Callable[[], None]:
    """One training step of ``attend`` on ``inputs`` (fresh gradients each time)."""

    def run() -> None:
        for leaf in inputs:
            leaf.grad = None
        attend(*inputs).backward(d_out)

    return run


def _cells(
    columns: dict[str, Callable[[], None]], o: dict[str, Any], device: torch.device, flops: float
) -> dict[str, dict[str, float]]:
    """Each column's median, spread and TFLOP/s over interleaved rounds, after equal warm-up."""
    samples: dict[str, list[float]] = {name: [] for name in columns}
    for name in sorted(columns):  # equal warm-up: builds, allocator, communicators
        _timed(columns[name], 2, device)
    for r in range(o["rounds"]):
        for name in round_order(sorted(columns), r):  # sorted: the same order on every rank
            samples[name].append(_timed(columns[name], o["steps"], device))
    cells = {}
    for name, values in samples.items():
        median = statistics.median(values)
        cells[name] = {
            "median_ms": median,
            "low_ms": min(values),
            "high_ms": max(values),
            "spread_pct": 100.0 * (max(values) - min(values)) / median,
        }
        if name != "communication only":
            cells[name]["tflops"] = flops / (median * 1e-3) / 1e12
    return cells


def document_lengths(total: int, world: int, seed: int = 0, tile: int = 32) -> list[int]:
    """The packed benchmark's documents: long-tailed lengths summing to ``total``
    (``memory.document_lengths``: lognormal, median about 3.7k), each a multiple of
    2 x ``world`` x ``tile``: every document splits into 2W equal zigzag chunks of whole tiles
    (64W tokens by default; the CPU smoke test passes ``tile=1``)."""
    return memory.document_lengths(total, 2 * world * tile, seed=seed)


def _measure_packed(rank: int, world: int, device: torch.device, o: dict[str, Any]) -> dict[str, Any]:
    """Packed documents: context parallelism over ``world`` ranks against one device, packed and padded."""
    h, h_kv, d, total, mode = o["heads"], o["kv_heads"], o["head_dim"], o["seq"], o["mode"]
    lengths = document_lengths(total, world, o["seed"], tile=1 if o["cpu"] else 32)
    longest = max(lengths)
    cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(device, torch.int32)

    def whole() -> list[torch.Tensor]:  # the same whole sequence on every rank: q, k, v, d_out
        gen = torch.Generator(device).manual_seed(0)
        return [torch.randn(total, n, d, generator=gen, device=device).to(torch.bfloat16) for n in (h, h_kv, h_kv, h)]

    def local() -> list[torch.Tensor]:
        return [shard(t, cu_seqlens=cu) for t in whole()]

    def packed_cp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return context_parallel_sdpa(
            q, k, v, cu_seqlens=cu, max_seqlen=longest, is_causal=True, mode=mode, enable_gqa=h_kv != h
        )

    def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return varlen_sdpa(q, k, v, cu, cu, longest, longest, is_causal=True)

    name = f"context_parallel {mode}, packed"
    # Memory first, on fresh plans (as a job's first step); each rank its own, the largest reported.
    memories = {}
    if device.type == "cuda":  # torch's allocator counts device memory only
        memories[name] = _largest(memory.step_memory(packed_cp, local, device), device)
        if rank == 0:
            memories[VARLEN] = memory.step_memory(varlen, whole, device)
        dist.barrier()
    shards = local()
    leaves = [t.detach().requires_grad_() for t in shards[:3]]
    columns: dict[str, Callable[[], None]] = {name: _step(packed_cp, leaves, shards[3])}
    error = float("nan")
    out = unshard(packed_cp(*leaves).detach(), cu_seqlens=cu)
    if rank == 0:
        everything = whole()
        single = [t.detach().requires_grad_() for t in everything[:3]]
        columns[VARLEN] = _step(varlen, single, everything[3])
        if not o.get("no_padded"):
            padded = [_padded(t, lengths, longest) for t in everything]
            leaves_padded = [t.requires_grad_() for t in padded[:3]]
            columns[PADDED] = _step(
                lambda q, k, v: sdpa(q, k, v, is_causal=True, enable_gqa=h_kv != h), leaves_padded, padded[3]
            )
        expected = varlen(*everything[:3]).float()
        error = float((out.float() - expected).norm() / expected.norm())
    else:
        columns[VARLEN] = lambda: None  # the others wait at the barrier
        if not o.get("no_padded"):
            columns[PADDED] = lambda: None
    flops = 3.5 * 4.0 * h * d * sum(n * n for n in lengths) / 2  # each document causal, forward + backward
    cells = _cells(columns, o, device, flops)
    for column, used in memories.items():
        cells[column].update(used)
    return {
        "world": world,
        "seq": total,
        "batch": 1,
        "heads": h,
        "kv_heads": h_kv,
        "head_dim": d,
        "mode": mode,
        "layout": "zigzag",
        "dtype": "bfloat16",
        "device": _device_name(device),
        "rounds": o["rounds"],
        "steps": o["steps"],
        "cells": cells,
        "overlap": None,
        "rel_err_vs_single": error,
        "baseline": VARLEN,
        "documents": {
            "count": len(lengths),
            "shortest": min(lengths),
            "median": int(statistics.median(lengths)),
            "longest": longest,
            "seed": o["seed"],
        },
    }


def _largest(used: dict[str, int], device: torch.device) -> dict[str, int]:
    """Each figure's largest value over the ranks (every rank calls it)."""
    values = torch.tensor([used[k] for k in sorted(used)], dtype=torch.int64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return dict(zip(sorted(used), values.tolist()))


def _padded(packed: torch.Tensor, lengths: list[int], longest: int) -> torch.Tensor:
    """Packed ``[T, H, D]`` as ``[N, H, longest, D]``, each document padded at its end with zeros
    (under a causal mask a document's rows never see its padding)."""
    out = torch.zeros(len(lengths), packed.shape[1], longest, packed.shape[2], dtype=packed.dtype, device=packed.device)
    start = 0
    for i, n in enumerate(lengths):
        out[i, :, :n] = packed[start : start + n].transpose(0, 1)
        start += n
    return out


def _ring_transfers(k: torch.Tensor, v: torch.Tensor) -> Callable[[], None]:
    """The p2p ring's transfers of one training step with no attention: W-1 shifts of the
    packed K/V (forward), then W-1 of K/V and W of the float32 dK/dV (backward)."""
    ring = Ring(members(None, "bench"))
    kv = torch.cat([k.detach().reshape(-1), v.detach().reshape(-1)])
    grads = kv.float()

    def run() -> None:
        current = kv
        for _ in range(ring.world - 1):
            current = ring.shift(current, 0).wait()
        current, pending_grad = kv, None
        for i in range(ring.world):  # as ring.backward posts and waits them, less the attention
            pending = ring.shift(current, 0) if i + 1 < ring.world else None
            acc = grads if pending_grad is None else pending_grad.wait()
            pending_grad = ring.shift(acc, 1)
            if pending is not None:
                current = pending.wait()
        if pending_grad is not None:
            pending_grad.wait()

    return run


def _timed(fn: Callable[[], None], steps: int, device: torch.device) -> float:
    """Milliseconds per step of the slowest rank, from a common start."""
    _synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    _synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - start) * 1e3 / steps], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def format_report(r: dict[str, Any]) -> str:
    cells = r["cells"]
    docs = r.get("documents")
    what = (
        f"{docs['count']} packed documents (lengths {docs['shortest']}..{docs['longest']}, median {docs['median']}, "
        f"seed {docs['seed']}), each causal, "
        if docs
        else f"B{r['batch']} "
    )
    lines = [
        f"Context parallelism, causal bf16 training step (forward+backward), {what}H{r['heads']} "
        f"d{r['head_dim']}, S={r['seq']} over {r['world']} x {r['device']} ({r['mode']}, {r['layout']}); "
        f"median of {r['rounds']} interleaved rounds:"
    ]
    baseline = r.get("baseline", SINGLE)
    single = cells[baseline]["median_ms"]
    for name, cell in cells.items():
        work = f"{cell['tflops']:8.3g} TFLOP/s" if "tflops" in cell else " " * 16
        versus = f"  {single / cell['median_ms']:5.2f}x {'varlen' if docs else 'single'}" if name != baseline else ""
        used = (
            f"  peak extra {cell['peak_extra'] / 1e9:.2f} GB over {cell['io_bytes'] / 1e9:.2f} GB of tensors, "
            f"held after {cell['held_after'] / 1e9:.3f} GB"
            if "peak_extra" in cell
            else ""
        )
        lines.append(
            f"  {name:<38}{cell['median_ms']:10.3f} ms  (spread {cell['spread_pct']:3.0f}%)  {work}{versus}{used}"
        )
    overlap = r.get("overlap")
    if overlap:
        note = (
            " (the ring costs more than compute plus transfers)"
            if overlap["exposed_ms"] > overlap["transfers_ms"]
            else ""
        )
        lines.append(
            f"  overlap: the transfers add {overlap['exposed_ms']:.3f} ms over compute only; alone they take "
            f"{overlap['transfers_ms']:.3f} ms: {100 * overlap['hidden_fraction']:.0f}% hidden{note}"
        )
    against = "the same packing on one device" if docs else "single-device attention"
    lines.append(f"  output against {against}: rel_err={r['rel_err_vs_single']:.2e}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
