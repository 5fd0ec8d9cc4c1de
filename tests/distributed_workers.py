"""The ranks of tests/test_distributed.py: one process per rank runs every case of a world size.

Starting a process and importing torch takes seconds, so each world size starts its ranks
once and they run the whole case list; each case's outcome (measured relative errors, or the
error it raised) goes back through a queue as ``(case id, rank, outcome)``. Assertions are the
parent's: a worker only measures, so one failing case never hides the others.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

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
    window: int | None = None  # a causal sliding window's left bound (window_size=(window, 0))
    sinks: bool = False  # a learnable logit per head (its gradient summed over ranks is checked)


@dataclass(frozen=True)
class Packed:
    """Packed documents (THD shards with ``cu_seqlens``): results, q/k/v gradients (and the sinks'
    summed over ranks) against float64 attention over the whole packed sequence, block-diagonal."""

    id: str
    docs: tuple[int, ...] = (3, 1, 2)  # each document's length in chunks (of 2W or W per document)
    mode: str = "p2p"
    is_causal: bool = True
    layout: str = "zigzag"
    heads: int = 2
    kv_heads: int = 2
    head_dim: int = 16
    dtype: str = "bfloat16"
    window: int | None = None
    sinks: bool = False


@dataclass(frozen=True)
class RoundTrip:
    """``unshard(shard(x)) == x`` and the shard holds the layout's chunks."""

    id: str
    layout: str
    seq_dim: int


@dataclass(frozen=True)
class PackedRoundTrip:
    """``unshard(shard(x, cu_seqlens=cu))`` is ``x`` and the shard holds each document's chunks."""

    id: str
    layout: str
    docs: tuple[int, ...] = (2, 1, 3)


@dataclass(frozen=True)
class Refusal:
    """A call every rank must refuse alike. ``per_rank``: rank -> overrides of the base call's
    arguments (``seq``, ``heads``, ``dtype``, ``dims``, ``mode``, ``layout``, ``enable_gqa``,
    ``cu``: packed documents' lengths in units of W tokens, or ``"float"``; ``window``; ``sinks``: a shape;
    ``dims`` may also be ``"nested"`` or ``"meta"``; ``max_seqlen``)."""

    id: str
    expected: str  # the error class's name
    text: str  # a phrase every rank's message holds
    call: dict[str, Any] = field(default_factory=dict)
    per_rank: dict[int, dict[str, Any]] = field(default_factory=dict)
    op: str = "context_parallel_sdpa"  # or "shard", "unshard"
    # Overrides of a valid call every rank makes first: its agreed signature must not let a
    # malformed argument equal to it (True == 1, (2.0, 0) == (2, 0)) skip the checks.
    after: dict[str, Any] | None = None


@dataclass(frozen=True)
class Fault:
    """A fault on one rank (``rank``; -1: the last) in the middle of a call: every rank must end
    it with an exception. ``inject``: ``"forward"``/``"backward"``, a block's attention raises
    out of memory there (the library's block function, replaced on that rank for the case);
    ``"shard"``: two calls, that rank's shard twice as long on the second."""

    id: str
    inject: str
    mode: str = "p2p"
    packed: bool = False
    rank: int = 0


def main(rank: int, world: int, init_file: str, backend: str, cases: list, results: Any) -> None:
    """A rank's process: join the group, run every case in order, report each outcome."""
    os.environ.setdefault("CUDNN_ATTN_CACHE_DIR", "")
    torch.set_num_threads(1)  # W ranks share a couple of cores
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
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
    sinks = _sinks(case.sinks, case.heads, gen, device)
    window = (-1, -1) if case.window is None else (case.window, 0)
    out = context_parallel_sdpa(
        leaves["q"],
        leaves["k"],
        leaves["v"],
        is_causal=case.is_causal,
        scale=case.scale,
        mode=case.mode,
        enable_gqa=case.kv_heads != case.heads,
        layout=case.layout,
        window_size=window,
        sinks=sinks,
    )
    out.backward(local["d_out"])
    gathered = {"out": out, **{f"d{n}": leaves[n].grad for n in "qkv"}}
    ours = {name: unshard(t.contiguous(), seq_dim=2, layout=case.layout) for name, t in gathered.items()}
    positions = torch.arange(s)
    allowed = _allowed(positions, positions, case.is_causal, case.window)
    scale = case.scale if case.scale is not None else case.head_dim**-0.5
    whole = {n: full[n].transpose(1, 2) for n in full}
    return _compare(ours, sinks, whole, allowed, scale)


def _packed(case: Packed, rank: int, world: int, device: torch.device, index: int) -> dict[str, float]:
    dtype = getattr(torch, case.dtype)
    gen = torch.Generator().manual_seed(2000 + index)  # the same whole tensors on every rank
    parts = (2 if case.layout == "zigzag" else 1) * world
    lengths = [n * parts for n in case.docs]
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    t = int(cu[-1])
    heads = {"q": case.heads, "k": case.kv_heads, "v": case.kv_heads, "d_out": case.heads}
    full = {name: torch.randn(t, h, case.head_dim, generator=gen).to(dtype) for name, h in heads.items()}
    local = {n: shard(x, cu_seqlens=cu, layout=case.layout).to(device) for n, x in full.items()}
    leaves = {n: local[n].detach().requires_grad_() for n in "qkv"}
    sinks = _sinks(case.sinks, case.heads, gen, device)
    window = (-1, -1) if case.window is None else (case.window, 0)
    out = context_parallel_sdpa(
        leaves["q"],
        leaves["k"],
        leaves["v"],
        cu_seqlens=cu,
        max_seqlen=max(lengths),
        is_causal=case.is_causal,
        mode=case.mode,
        enable_gqa=case.kv_heads != case.heads,
        layout=case.layout,
        window_size=window,
        sinks=sinks,
    )
    out.backward(local["d_out"])
    gathered = {"out": out, **{f"d{n}": leaves[n].grad for n in "qkv"}}
    ours = {name: unshard(x.contiguous(), cu_seqlens=cu, layout=case.layout) for name, x in gathered.items()}
    ours = {name: x.transpose(0, 1).unsqueeze(0) for name, x in ours.items()}  # as [1, H, T, D]
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    position = torch.arange(t) - cu.cpu().long()[doc]
    allowed = _allowed(position, position, case.is_causal, case.window) & (doc[:, None] == doc[None, :])
    whole = {n: x.transpose(0, 1).unsqueeze(0) for n, x in full.items()}
    return _compare(ours, sinks, whole, allowed, case.head_dim**-0.5)


def _sinks(wanted: bool, heads: int, gen: torch.Generator, device: torch.device) -> torch.Tensor | None:
    """A learnable logit per head, float32, the same on every rank (None when not wanted)."""
    if not wanted:
        return None
    return torch.randn(heads, generator=gen, dtype=torch.float32).to(device).requires_grad_()


def _allowed(rows: torch.Tensor, cols: torch.Tensor, causal: bool, window: int | None) -> torch.Tensor:
    """Which keys each query may see, from positions: causal, and at most ``window`` back."""
    distance = rows[:, None] - cols[None, :]
    allowed = torch.ones(distance.shape, dtype=torch.bool)
    if causal or window is not None:
        allowed &= distance >= 0
    if window is not None:
        allowed &= distance <= window
    return allowed


def _compare(ours: dict, sinks: torch.Tensor | None, whole: dict, allowed: torch.Tensor, scale: float) -> dict:
    """Relative errors of ours against float64 attention over the whole ``[B, H, S, D]`` inputs
    (the sinks' gradient summed over ranks: each rank's is its rows' share)."""
    ref = {n: whole[n].double().requires_grad_() for n in "qkv"}
    ref_sinks = None if sinks is None else sinks.detach().cpu().double().requires_grad_()
    expected_out = _oracle(ref["q"], ref["k"], ref["v"], scale, allowed, ref_sinks)
    expected_out.backward(whole["d_out"].double())
    expected = {"out": expected_out, **{f"d{n}": ref[n].grad for n in "qkv"}}
    errors = {name: _rel_err(ours[name], expected[name]) for name in expected}
    if sinks is not None:
        d_sinks = sinks.grad.detach().clone()
        dist.all_reduce(d_sinks)
        # dSink_h = -sum over rows of p_sink * rowsum(dO * O): terms of both signs, whose sum can
        # cancel far below their size. Its error is measured against the size of its terms (the
        # scale bf16's rounding of O and dO acts on), not against the sum.
        with torch.no_grad():
            p_sink = _sink_probability(ref["q"], ref["k"], scale, allowed, ref_sinks)
            terms = p_sink * (whole["d_out"].double() * expected_out).sum(-1)
            size = terms.abs().sum(dim=(0, 2))
        errors["dsinks"] = float((d_sinks.cpu().double() - ref_sinks.grad).norm() / size.norm())
    return errors


def _oracle(q, k, v, scale: float, allowed: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Float64 attention with a sink column (a logit per head weighing no value), differentiable."""
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    probs = torch.softmax(_scores(q, k, scale, allowed, sinks), -1)[..., : allowed.shape[-1]] * allowed
    return probs @ v


def _sink_probability(q, k, scale: float, allowed: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Each row's probability of the sink column, ``[B, H, S]``."""
    return torch.softmax(_scores(q, k, scale, allowed, sinks.detach()), -1)[..., -1]


def _scores(q, k, scale: float, allowed: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Scaled scores (masked ones -1e30), the sink column appended when there is one."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = torch.where(allowed, (q @ k.transpose(-1, -2)) * scale, torch.full((), -1e30, dtype=q.dtype))
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
    return s


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


def _packed_round_trip(case: PackedRoundTrip, rank: int, world: int, device: torch.device, index: int) -> dict:
    parts = (2 if case.layout == "zigzag" else 1) * world
    lengths = [n * parts for n in case.docs]
    cu = torch.tensor([0, *lengths]).cumsum(0).to(device)
    x = torch.randn(int(cu[-1]), 3, 4, generator=torch.Generator().manual_seed(index)).to(device)
    local = shard(x, cu_seqlens=cu, layout=case.layout)
    ids = (rank, parts - 1 - rank) if case.layout == "zigzag" else (rank,)
    expected = torch.cat([x[int(cu[d]) : int(cu[d + 1])].chunk(parts)[i] for d in range(len(lengths)) for i in ids])
    back = unshard(local, cu_seqlens=cu, layout=case.layout)
    return {
        "shard_exact": float(torch.equal(local, expected)),
        "shard_contiguous": float(local.is_contiguous()),
        "round_trip_exact": float(torch.equal(back, x)),
    }


def _refusal(case: Refusal, rank: int, world: int, device: torch.device, index: int) -> dict[str, str]:
    if case.after is not None:
        agreed = Refusal(case.id, "nothing", "", {**case.call, **case.after}, op=case.op)
        assert _refusal(agreed, rank, world, device, index)["raised"] == "nothing", "the first call is valid"
    call = {
        "seq": 8,
        "heads": 2,
        "kv_heads": 2,
        "dtype": "bfloat16",
        "dims": 4,
        "mode": "p2p",
        "layout": "zigzag",
        "enable_gqa": False,
        "is_causal": True,
        "cu": None,
        "window": (-1, -1),
        "sinks": None,
        **case.call,
        **case.per_rank.get(rank, {}),
    }
    dtype = getattr(torch, call["dtype"])
    cu = None
    if call["cu"] == "float":
        cu = torch.tensor([0.0, 6.0 * world, 12.0 * world], device=device)
    elif call["cu"] is not None:
        cu = torch.tensor([0, *(n * world for n in call["cu"])]).cumsum(0).to(device)
    sinks = None if call["sinks"] is None else torch.zeros(call["sinks"], device=device)

    def tensor(heads: int) -> torch.Tensor:
        if call["dims"] == "nested":  # no sizes to read: refused by name, on every rank
            return torch.nested.nested_tensor([torch.randn(heads, n, 16) for n in (3, 5)], dtype=dtype, device=device)
        if call["dims"] == "meta":
            return torch.empty(1, heads, call["seq"], 16, dtype=dtype, device="meta")
        if call["dims"] == 3:  # packed [T, H, D]: a shard, or the whole sequence for shard()
            tokens = int(cu[-1]) if case.op == "shard" and cu is not None else call["seq"]
            return torch.randn(tokens, heads, 16).to(device, dtype)
        return torch.randn(1, heads, call["seq"], 16).to(device, dtype)

    seq_dim = 0 if call["dims"] == 3 else 2
    extra = {"max_seqlen": call["max_seqlen"]} if "max_seqlen" in call else {}
    try:
        if case.op == "shard":
            shard(tensor(call["heads"]), seq_dim=seq_dim, layout=call["layout"], cu_seqlens=cu)
        elif case.op == "unshard":
            unshard(tensor(call["heads"]), seq_dim=seq_dim, layout=call["layout"], cu_seqlens=cu)
        else:
            context_parallel_sdpa(
                tensor(call["heads"]),
                tensor(call["kv_heads"]),
                tensor(call["kv_heads"]),
                is_causal=call["is_causal"],
                mode=call["mode"],
                layout=call["layout"],
                enable_gqa=call["enable_gqa"],
                cu_seqlens=cu,
                window_size=call["window"],
                sinks=sinks,
                **extra,
            )
    except Exception as error:
        return {"raised": type(error).__name__, "message": str(error)}
    return {"raised": "nothing", "message": ""}


def _fault(case: Fault, rank: int, world: int, device: torch.device, index: int) -> dict[str, Any]:
    from cudnn_attn.distributed import blocks

    def call(chunks: int) -> None:
        gen = torch.Generator().manual_seed(3000 + index)
        tokens = chunks * 2 * world
        if case.packed:  # two documents of tokens / 2 each, sharded: this rank's share of each
            cu = torch.tensor([0, tokens // 2, tokens], dtype=torch.int32, device=device)
            shape: tuple[int, ...] = (tokens // world, 2, 16)
        else:
            cu, shape = None, (1, 2, tokens // world, 16)
        q, k, v = (torch.randn(shape, generator=gen).to(device, torch.bfloat16).requires_grad_() for _ in range(3))
        out = context_parallel_sdpa(q, k, v, is_causal=True, mode=case.mode, cu_seqlens=cu)
        out.backward(torch.randn_like(out))

    def out_of_memory(*args: Any, **kwargs: Any) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.13 GiB (injected)")

    faulty = rank == case.rank % world
    name = {"forward": "forward", "backward": "backward"}.get(case.inject)
    if name is not None and case.packed:
        name = f"packed_{name}"
    original = getattr(blocks, name) if name else None
    start = time.monotonic()
    try:
        if case.inject == "shard":
            call(4)
            call(8 if faulty else 4)  # this rank's signature is new; the others' is agreed already
        else:
            if faulty:
                setattr(blocks, name, out_of_memory)
            call(4)
    except Exception as error:
        return {"raised": type(error).__name__, "message": str(error), "seconds": time.monotonic() - start}
    finally:
        if name is not None:
            setattr(blocks, name, original)
    return {"raised": "nothing", "message": "", "seconds": time.monotonic() - start}


RUNNERS: dict[type, Any] = {
    Attention: _attention,
    Packed: _packed,
    RoundTrip: _round_trip,
    PackedRoundTrip: _packed_round_trip,
    Refusal: _refusal,
    Fault: _fault,
}


def absent_rank(rank: int, world: int, init_file: str, timeout_s: float, done: Any, results: Any) -> None:
    """The last rank joins the group and never calls; the others call ``context_parallel_sdpa``
    and report how they ended and after how long. The absent rank waits until they have."""
    os.environ.setdefault("CUDNN_ATTN_CACHE_DIR", "")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    if rank == world - 1:
        done.wait(timeout=120)
        os._exit(0)  # its group is broken by the others' timeout: no orderly teardown
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    start = time.monotonic()
    try:
        context_parallel_sdpa(q, k, v, is_causal=True)
        outcome = {"raised": "nothing", "seconds": time.monotonic() - start}
    except Exception as error:
        outcome = {"raised": type(error).__name__, "message": str(error), "seconds": time.monotonic() - start}
    results.put((rank, outcome))
    results.close()
    results.join_thread()  # the outcome is written before the process ends without teardown
    os._exit(0)
