"""The ranks of tests/test_distributed.py: one process per rank runs every case of a world size.

Starting a process and importing torch takes seconds, so each world size starts its ranks
once and they run the whole case list; each case's outcome (measured relative errors, or the
error it raised) goes back through a queue as ``(case id, rank, outcome)``. Assertions are the
parent's: a worker only measures, so one failing case never hides the others.
"""

from __future__ import annotations

import datetime
import os
import traceback
from dataclasses import dataclass, field
from typing import Any

import oracle
import torch
import torch.distributed as dist

from cudnn_attn.distributed import context_parallel_sdpa, shard, unshard


@dataclass(frozen=True)
class Attention:
    """One attention case: results and q/k/v gradients against float64 attention on the whole sequence."""

    id: str
    mode: str = "p2p"
    is_causal: bool = True
    layout: str = "zigzag"
    batch: int = 1
    heads: int = 2
    kv_heads: int = 2
    chunk: int = 4  # positions per chunk: the sequence is chunk * 2W long
    head_dim: int = 32
    dtype: str = "bfloat16"
    bshd: bool = False  # shards as BSHD views (sharded along dim 1)
    scale: float | None = None


@dataclass(frozen=True)
class RoundTrip:
    """``unshard(shard(x)) == x`` and the shard holds the layout's chunks."""

    id: str
    layout: str
    seq_dim: int


@dataclass(frozen=True)
class Refusal:
    """A call every rank must refuse alike. ``per_rank``: rank -> overrides of the base call's
    arguments (``seq``, ``heads``, ``dtype``, ``dims``, ``mode``, ``layout``, ``enable_gqa``)."""

    id: str
    expected: str  # the error class's name
    text: str  # a phrase every rank's message holds
    call: dict[str, Any] = field(default_factory=dict)
    per_rank: dict[int, dict[str, Any]] = field(default_factory=dict)
    op: str = "context_parallel_sdpa"  # or "shard", "unshard"


def main(rank: int, world: int, init_file: str, backend: str, cases: list, results: Any) -> None:
    """A rank's process: join the group, run every case in order, report each outcome."""
    os.environ.setdefault("CUDNN_ATTN_CACHE_DIR", "")
    torch.set_num_threads(1)  # W ranks share a couple of cores
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    try:
        for index, case in enumerate(cases):
            try:
                outcome = RUNNERS[type(case)](case, rank, world, device, index)
            except Exception as error:  # the parent says which case, on which rank
                outcome = {"unexpected": f"{type(error).__name__}: {error}\n{traceback.format_exc()}"}
            results.put((case.id, rank, outcome))
    finally:
        dist.destroy_process_group()


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||a - e|| / ||e|| in float64; NaN in ``actual`` stays NaN (and fails any tolerance)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if a.shape != e.shape:
        return float("nan")
    return float((a - e).norm() / e.norm())


def _attention(case: Attention, rank: int, world: int, device: torch.device, index: int) -> dict[str, float]:
    dtype = getattr(torch, case.dtype)
    gen = torch.Generator().manual_seed(1000 + index)  # the same full tensors on every rank
    s = case.chunk * 2 * world
    heads = {"q": case.heads, "k": case.kv_heads, "v": case.kv_heads, "d_out": case.heads}
    shapes = {name: (case.batch, s, h, case.head_dim) for name, h in heads.items()}  # BSHD
    # Fresh random values (never zeros), rounded to the dtype once: the oracle sees the same inputs.
    full = {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in shapes.items()}
    if case.bshd:  # [B, S, H, D] shards, passed as BSHD views of [B, H, S, D]
        local = {n: shard(t, seq_dim=1, layout=case.layout).to(device).transpose(1, 2) for n, t in full.items()}
    else:
        local = {n: shard(t.transpose(1, 2), seq_dim=2, layout=case.layout).to(device) for n, t in full.items()}
    leaves = {n: local[n].detach().requires_grad_() for n in "qkv"}
    out = context_parallel_sdpa(leaves["q"], leaves["k"], leaves["v"], is_causal=case.is_causal, scale=case.scale,
                                mode=case.mode, enable_gqa=case.kv_heads != case.heads, layout=case.layout)  # fmt: skip
    out.backward(local["d_out"])
    gathered = {"out": out, **{f"d{n}": leaves[n].grad for n in "qkv"}}
    ours = {name: unshard(t.contiguous(), seq_dim=2, layout=case.layout) for name, t in gathered.items()}

    ref = {n: full[n].transpose(1, 2).double().requires_grad_() for n in "qkv"}
    allowed = torch.ones(s, s, dtype=torch.bool).tril() if case.is_causal else None
    scale = case.scale if case.scale is not None else case.head_dim**-0.5
    expected_out = oracle.attention_autograd(ref["q"], ref["k"], ref["v"], scale=scale, allowed=allowed)
    expected_out.backward(full["d_out"].transpose(1, 2).double())
    expected = {"out": expected_out, **{f"d{n}": ref[n].grad for n in "qkv"}}
    return {name: _rel_err(ours[name], expected[name]) for name in expected}


def _round_trip(case: RoundTrip, rank: int, world: int, device: torch.device, index: int) -> dict[str, float]:
    per_rank = 2 if case.layout == "zigzag" else 1
    c = 3
    shape = [2, 3, 4]
    shape.insert(case.seq_dim, c * per_rank * world)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(index)).to(device)
    local = shard(x, seq_dim=case.seq_dim, layout=case.layout)
    ids = (rank, 2 * world - 1 - rank) if case.layout == "zigzag" else (rank,)
    expected = torch.cat([x.narrow(case.seq_dim, i * c, c) for i in ids], dim=case.seq_dim)
    back = unshard(local, seq_dim=case.seq_dim, layout=case.layout)
    return {
        "shard_exact": float(torch.equal(local, expected)),
        "shard_contiguous": float(local.is_contiguous()),
        "round_trip_exact": float(torch.equal(back, x)),
    }


def _refusal(case: Refusal, rank: int, world: int, device: torch.device, index: int) -> dict[str, str]:
    call = {"seq": 8, "heads": 2, "kv_heads": 2, "dtype": "bfloat16", "dims": 4, "mode": "p2p", "layout": "zigzag",
            "enable_gqa": False, "is_causal": True, **case.call, **case.per_rank.get(rank, {})}  # fmt: skip
    dtype = getattr(torch, call["dtype"])
    lead = (1,) if call["dims"] == 4 else ()

    def tensor(heads: int) -> torch.Tensor:
        return torch.randn(*lead, heads, call["seq"], 16).to(device, dtype)

    try:
        if case.op == "shard":
            shard(tensor(call["heads"]), seq_dim=2, layout=call["layout"])
        elif case.op == "unshard":
            unshard(tensor(call["heads"]), seq_dim=2, layout=call["layout"])
        else:
            context_parallel_sdpa(tensor(call["heads"]), tensor(call["kv_heads"]), tensor(call["kv_heads"]),
                                  is_causal=call["is_causal"], mode=call["mode"], layout=call["layout"],
                                  enable_gqa=call["enable_gqa"])  # fmt: skip
    except Exception as error:
        return {"raised": type(error).__name__, "message": str(error)}
    return {"raised": "nothing", "message": ""}


RUNNERS: dict[type, Any] = {Attention: _attention, RoundTrip: _round_trip, Refusal: _refusal}
