"""The benchmarks behind the project's targets: ``bench --stack``, ``--paged-decode``, ``--naive``.

- ``--stack``: a 4-layer decoder training step with torch's SDPA and with ``cudnn_attn.sdpa``
  on the same weights: what swapping the attention call buys a whole model, not one kernel.
- ``--paged-decode``: decode over a paged K/V cache, a bandwidth-bound call, through a built
  graph and through the frontend's own ``execute`` of the same plan, beside a plain device
  copy of as many bytes: how much of the memory bandwidth the library leaves on the table.
- ``--naive``: fused attention against ``softmax(q @ k^T * scale) @ v`` in torch, as a user
  times it (wall time of back-to-back calls and one synchronize).

Every section times its columns in short interleaved rounds after equal warm-up and reports
each column's median over rounds and its spread (lowest to highest round), never a best-of:
a difference inside the spread is noise.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from .. import Graph, sdpa
from ..core import synthetic
from . import host

Attend = Callable[..., torch.Tensor]  # torch's scaled_dot_product_attention signature
Timings = dict[str, dict[str, float]]  # column -> median_us, low_us, high_us

torch_sdpa: Attend = torch.nn.functional.scaled_dot_product_attention


# ---- timing ------------------------------------------------------------------------------------


def _event_us_per_call(fn: Callable[[], object], calls: int) -> float:
    """GPU time per call of a block of back-to-back calls, between two CUDA events: for
    GPU-bound calls, where the host stays ahead and the GPU's time is the figure."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def interleaved_events(
    paths: Mapping[str, Callable[[], object]], rounds: int = 12, calls: int = 50, warmup_calls: int = 50
) -> Timings:
    """``host.interleaved`` with CUDA-event timing: each round times a block of ``calls``
    of every path in a freshly shuffled order (``host.round_order``), after equal warm-up."""
    for fn in paths.values():
        _event_us_per_call(fn, warmup_calls)
    samples: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    for r in range(rounds):
        for name in host.round_order(names, r):
            samples[name].append(_event_us_per_call(paths[name], calls))
    return {
        name: {"median_us": statistics.median(v), "low_us": min(v), "high_us": max(v)} for name, v in samples.items()
    }


def wall_blocks(paths: Mapping[str, Callable[[], object]], rounds: int, calls: int) -> Timings:
    """Wall time per call of ``calls`` back-to-back calls followed by one synchronize, as a user
    timing a loop sees it: host overhead shows wherever it exceeds the GPU's work."""

    def block(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(calls):
                fn()

        return run

    per_block = host.interleaved({name: block(fn) for name, fn in paths.items()}, rounds, 1, sync=True)
    return {name: {key: us / calls for key, us in r.items()} for name, r in per_block.items()}


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.float()
    return float((actual.float() - expected).norm() / expected.norm())


def _spread(r: dict[str, float], scale: float = 1.0, digits: int = 1) -> str:
    return f"{r['low_us'] * scale:.{digits}f} - {r['high_us'] * scale:.{digits}f}"


# ---- --stack: a decoder training step ----------------------------------------------------------


class DecoderBlock(nn.Module):
    """Pre-norm decoder block: RMSNorm -> causal self-attention -> residual, RMSNorm -> MLP
    (4x, GELU) -> residual. Q, K and V stay BSHD views of one fused projection, as in
    ``cudnn_attn.nn.Attention``, so both attention calls see the same strided inputs."""

    def __init__(self, hidden: int, heads: int, *, device: Any = None, dtype: torch.dtype | None = None):
        super().__init__()
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.heads, self.head_dim = heads, hidden // heads
        self.attn_norm = nn.RMSNorm(hidden, eps=1e-5, **factory)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False, **factory)
        self.out = nn.Linear(hidden, hidden, bias=False, **factory)
        self.mlp_norm = nn.RMSNorm(hidden, eps=1e-5, **factory)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False, **factory)
        self.down = nn.Linear(4 * hidden, hidden, bias=False, **factory)

    def forward(self, x: torch.Tensor, attend: Attend) -> torch.Tensor:
        b, s, hidden = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(b, s, 3 * self.heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.split(self.heads, dim=2))
        o = attend(q, k, v, is_causal=True)
        x = x + self.out(o.transpose(1, 2).reshape(b, s, hidden))
        return x + self.down(nn.functional.gelu(self.up(self.mlp_norm(x)), approximate="tanh"))


class DecoderStack(nn.Module):
    """``layers`` decoder blocks whose attention is ``attend`` (torch's SDPA signature)."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        layers: int = 4,
        *,
        attend: Attend = torch_sdpa,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.hidden, self.heads, self.attend = hidden, heads, attend
        self.blocks = nn.ModuleList(DecoderBlock(hidden, heads, device=device, dtype=dtype) for _ in range(layers))

    def with_attention(self, attend: Attend) -> DecoderStack:
        """A stack sharing these very blocks (the same parameter tensors) but attending with
        ``attend``: the two stacks cannot drift apart in their weights."""
        twin = DecoderStack(self.hidden, self.heads, layers=0, attend=attend)
        twin.blocks = self.blocks
        return twin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, self.attend)
        return x


def training_step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Forward and backward: the output, then the gradients w.r.t. ``x`` and every parameter."""
    y = model(x)
    grads = torch.autograd.grad(y.float().sum(), [x, *model.parameters()])
    return (y, *grads)


STACK_SHAPES = ((2, 512), (8, 2048))
STACK_HIDDEN, STACK_HEADS, STACK_LAYERS = 2048, 16, 4


def _stack_errors(theirs: nn.Module, ours: nn.Module, x: torch.Tensor) -> dict[str, float]:
    """Ours against torch's on the output, the input's gradient and the worst parameter gradient."""
    expected, actual = training_step(theirs, x), training_step(ours, x)
    params = [_relative_error(a, e) for a, e in zip(actual[2:], expected[2:])]
    return {
        "out": _relative_error(actual[0], expected[0]),
        "grad_x": _relative_error(actual[1], expected[1]),
        "grad_params_max": max(params),
    }


def stack_step(batch: int, seq: int, rounds: int = 10, calls: int = 10) -> dict[str, Any]:
    """One training step of the decoder stack with each attention, synchronised per step (a
    step's time includes the GPU's), same weights and input; ms per step and ours/torch."""
    torch.manual_seed(0)
    theirs = DecoderStack(STACK_HIDDEN, STACK_HEADS, STACK_LAYERS, device="cuda", dtype=torch.bfloat16)
    ours = theirs.with_attention(sdpa)
    x = torch.randn(batch, seq, STACK_HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    steps: dict[str, Callable[[], object]] = {
        "torch sdpa": lambda: training_step(theirs, x),
        "cudnn_attn.sdpa": lambda: training_step(ours, x),
    }
    timings = host.interleaved(steps, rounds=rounds, calls=calls, sync=True)
    ratio = timings["cudnn_attn.sdpa"]["median_us"] / timings["torch sdpa"]["median_us"]
    return {"timings": timings, "ratio_ours_over_torch": ratio, "rel_err": _stack_errors(theirs, ours, x)}


def stack_steps(shapes: tuple[tuple[int, int], ...] = STACK_SHAPES) -> dict[str, Any]:
    config = {"layers": STACK_LAYERS, "hidden": STACK_HIDDEN, "heads": STACK_HEADS, "causal": True, "dtype": "bf16"}
    results: dict[str, Any] = {"config": config, "shapes": {}}
    for batch, seq in shapes:
        results["shapes"][f"B{batch} S{seq}"] = stack_step(batch, seq)
        torch.cuda.empty_cache()
    return results


def format_stack(results: dict[str, Any]) -> str:
    c = results["config"]
    lines = [
        f"decoder stack training step ({c['layers']} layers, hidden {c['hidden']}, {c['heads']} heads, causal, "
        f"{c['dtype']}), synchronised per step:"
    ]
    for label, r in results["shapes"].items():
        err = r["rel_err"]
        lines += [
            f"  {label}: ours/torch {r['ratio_ours_over_torch']:.3f}  (ours vs torch, relative error: output "
            f"{err['out']:.1e}, dx {err['grad_x']:.1e}, worst parameter gradient {err['grad_params_max']:.1e})",
            f"    {'path':<20}{'median ms':>11}{'spread ms':>20}",
        ]
        for name, t in r["timings"].items():
            lines.append(f"    {name:<20}{t['median_us'] / 1e3:>11.2f}{_spread(t, 1e-3, 2):>20}")
    return "\n".join(lines)


# ---- --paged-decode: bandwidth of a paged K/V decode ------------------------------------------


@dataclass(frozen=True)
class PagedDecodeShape:
    batch: int = 64
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    seq_kv: int = 4096
    page_size: int = 64


def paged_decode_inputs(
    shape: PagedDecodeShape, *, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> dict[str, torch.Tensor]:
    """One decode step's tensors: q ``[B, Hq, 1, d]``, caches ``[num_pages, page_size, Hkv, d]``
    whose pages a random permutation hands out (so reads scatter, as in a server), full lengths."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = math.ceil(shape.seq_kv / shape.page_size)
    num_pages = shape.batch * pages_per_seq

    def randn(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=gen).to(device=device, dtype=dtype)

    table = torch.randperm(num_pages, generator=gen).view(shape.batch, pages_per_seq)
    return {
        "q": randn(shape.batch, shape.heads, 1, shape.head_dim),
        "k_cache": randn(num_pages, shape.page_size, shape.kv_heads, shape.head_dim),
        "v_cache": randn(num_pages, shape.page_size, shape.kv_heads, shape.head_dim),
        "page_table": table.to(device=device, dtype=torch.int32),
        "lengths": torch.full((shape.batch,), shape.seq_kv, dtype=torch.int32, device=device),
    }


def _paged_args(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The graph's positional inputs, in ``sdpa_with_paged_cache``'s parameter order."""
    return t["q"], t["k_cache"], t["v_cache"], t["page_table"], t["lengths"]


def paged_graph(t: dict[str, torch.Tensor]) -> Graph:
    with Graph() as g:
        g.sdpa_with_paged_cache(t["q"], t["k_cache"], t["v_cache"], t["page_table"], seq_len_kv=t["lengths"])
    return g


def dense_paged_attention(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The decode computed densely in float32: each sequence's pages gathered in table order,
    cut to its length, through torch's SDPA. Independent of every paged code path."""
    k_cache, v_cache, table = t["k_cache"], t["v_cache"], t["page_table"].long()
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    outs = []
    for i, length in enumerate(t["lengths"].tolist()):
        k, v = (c[table[i]].reshape(-1, kv_heads, head_dim)[:length].transpose(0, 1)[None] for c in (k_cache, v_cache))
        outs.append(torch_sdpa(t["q"][i : i + 1].float(), k.float(), v.float(), enable_gqa=True))
    return torch.cat(outs)


def output_buffer(g: Graph) -> torch.Tensor:
    """A buffer with the geometry of the graph's one output, for ``out=`` and the frontend's pack."""
    spec = g.outputs[0].spec
    assert spec is not None, "a built graph's outputs have their geometry"
    return synthetic.empty(spec)


def frontend_direct(g: Graph, args: tuple[torch.Tensor, ...]) -> tuple[Callable[[], object], torch.Tensor]:
    """The graph's plan run through the frontend's ``execute`` on a variant pack prepared once
    (page tables and lengths included, clamped once here rather than per call), and the output
    buffer it writes."""
    from ..ops.cudnn.platform import cudnn_handle

    node = g.nodes[0]
    plan: Any = node.plan
    by_handle: dict[Any, torch.Tensor] = dict(zip(g.inputs, args))
    inputs = {role: by_handle[handle] for role, handle in node.inputs.items()}
    out = output_buffer(g)
    pack = plan.variant_pack(inputs, {"o": out})
    workspace = torch.empty(max(plan.workspace_size, 1), dtype=torch.uint8, device="cuda")
    handle = cudnn_handle(torch.cuda.current_device())
    return lambda: plan.graph.execute(pack, workspace, handle=handle), out


def paged_bytes(t: dict[str, torch.Tensor]) -> dict[str, int]:
    """Bytes one decode call must move: the K and V pages it reads (each sequence's valid
    tokens), plus q and o; a copy of the K+V bytes moves them twice (read, then write)."""
    kv_heads, head_dim = t["k_cache"].shape[2], t["k_cache"].shape[3]
    tokens = int(t["lengths"].sum())
    kv = 2 * tokens * kv_heads * head_dim * t["k_cache"].element_size()
    q = t["q"].numel() * t["q"].element_size()
    return {"kv": kv, "decode": kv + 2 * q, "copy": 2 * kv}


def paged_decode(shape: PagedDecodeShape = PagedDecodeShape(), rounds: int = 12, calls: int = 50) -> dict[str, Any]:
    """Paged decode through the library, with a preallocated output, through the frontend's
    ``execute`` of the same plan, and a device copy of the K+V bytes; each column's relative
    error against a dense float32 computation."""
    t = paged_decode_inputs(shape)
    args = _paged_args(t)
    g = paged_graph(t)
    o = output_buffer(g)
    direct, direct_out = frontend_direct(g, args)
    moved = paged_bytes(t)
    src = torch.empty(moved["kv"], dtype=torch.uint8, device="cuda").random_(0, 256)
    dst = torch.empty_like(src)
    paths: dict[str, Callable[[], object]] = {
        "g(q, k, v, table, lengths)": lambda: g(*args),
        "g(..., out=o)": lambda: g(*args, out=o),
        "frontend direct": direct,
        "copy of the K+V bytes": lambda: dst.copy_(src),
    }
    timings = interleaved_events(paths, rounds=rounds, calls=calls)
    expected = dense_paged_attention(t)
    errors = {"g(q, k, v, table, lengths)": g(*args), "g(..., out=o)": o, "frontend direct": direct_out}
    return {
        "config": {**asdict(shape), "dtype": "bf16", "bytes": moved},
        "columns": _bandwidth_columns(
            timings, moved, {name: _relative_error(x, expected) for name, x in errors.items()}
        ),
    }


def _bandwidth_columns(timings: Timings, moved: dict[str, int], errors: dict[str, float]) -> dict[str, dict]:
    """Each column's GB/s (the copy counted by what it reads and writes) and its percentage of
    the frontend-direct column's bandwidth."""
    columns: dict[str, dict] = {}
    for name, t in timings.items():
        nbytes = moved["copy"] if name.startswith("copy") else moved["decode"]
        columns[name] = {**t, "gbps": nbytes / (t["median_us"] * 1e-6) / 1e9}
        if name in errors:
            columns[name]["rel_err"] = errors[name]
    reference = columns["frontend direct"]["gbps"]
    for cell in columns.values():
        cell["pct_of_frontend"] = 100.0 * cell["gbps"] / reference
    return columns


def format_paged_decode(results: dict[str, Any]) -> str:
    c = results["config"]
    lines = [
        f"paged decode, B{c['batch']} Hq{c['heads']}/Hkv{c['kv_heads']} d{c['head_dim']} S_kv {c['seq_kv']}, "
        f"page {c['page_size']}, {c['dtype']}: {c['bytes']['decode'] / 1e9:.3f} GB per call (K, V pages, q, o); "
        f"the copy moves {c['bytes']['copy'] / 1e9:.3f} GB (reads and writes the K+V bytes)",
        f"  {'column':<30}{'median us':>11}{'spread us':>22}{'GB/s':>9}{'% frontend':>12}{'rel err':>10}",
    ]
    for name, r in results["columns"].items():
        error = f"{r['rel_err']:.1e}" if "rel_err" in r else "-"
        lines.append(
            f"  {name:<30}{r['median_us']:>11.1f}{_spread(r):>22}{r['gbps']:>9.0f}"
            f"{r['pct_of_frontend']:>11.1f}%{error:>10}"
        )
    return "\n".join(lines)


# ---- --naive: fused against three-kernel attention --------------------------------------------

NAIVE_BATCH, NAIVE_HEADS, NAIVE_HEAD_DIM = 4, 16, 64
NAIVE_SEQS = (512, 2048, 8192)


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, scale: float | None = None
) -> torch.Tensor:
    """``softmax(q @ k^T * scale) @ v`` as three S x S kernels (scores, softmax, weighted sum);
    the scale is folded into q, a pass over ``S x d`` elements rather than ``S x S`` scores.
    ``is_causal`` (one more pass, masking the scores) lets it stand in for torch's SDPA."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q * scale) @ k.transpose(-2, -1)
    if is_causal:
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def naive_calls(seq: int) -> int:
    """Calls per timed block: enough that a block lasts a millisecond or more at short
    sequences, few enough that the longest naive blocks stay short."""
    return max(4, min(50, 102400 // seq))


def naive_row(seq: int, rounds: int = 10) -> dict[str, Any]:
    """One sequence length: wall time per call of each column, speedups over naive, and each
    column's relative error against torch's SDPA in float32."""
    gen = torch.Generator().manual_seed(seq)
    shape = (NAIVE_BATCH, NAIVE_HEADS, seq, NAIVE_HEAD_DIM)
    q, k, v = (torch.randn(shape, generator=gen).to("cuda", torch.float16) for _ in range(3))
    with Graph() as g:
        g.sdpa(q, k, v)
    paths: dict[str, Callable[[], torch.Tensor]] = {
        "naive (3 kernels)": lambda: naive_attention(q, k, v),
        "cudnn_attn.sdpa": lambda: sdpa(q, k, v),
        "g(q, k, v)": lambda: g(q, k, v),
        "torch sdpa": lambda: torch_sdpa(q, k, v),
    }
    timings = wall_blocks(paths, rounds, naive_calls(seq))
    expected = torch_sdpa(q.float(), k.float(), v.float())
    errors = {name: _relative_error(fn(), expected) for name, fn in paths.items()}
    naive_us = timings["naive (3 kernels)"]["median_us"]
    speedups = {name: naive_us / t["median_us"] for name, t in timings.items() if not name.startswith("naive")}
    return {"calls_per_block": naive_calls(seq), "timings": timings, "speedup_over_naive": speedups, "rel_err": errors}


def naive_vs_fused(seqs: tuple[int, ...] = NAIVE_SEQS) -> dict[str, Any]:
    config = {"batch": NAIVE_BATCH, "heads": NAIVE_HEADS, "head_dim": NAIVE_HEAD_DIM, "dtype": "fp16", "causal": False}
    results: dict[str, Any] = {"config": config, "seqs": {}}
    for seq in seqs:
        results["seqs"][str(seq)] = naive_row(seq)
        torch.cuda.empty_cache()  # the naive scores (B*H*S*S halves) go back before the next length
    return results


def format_naive(results: dict[str, Any]) -> str:
    c = results["config"]
    lines = [
        f"naive vs fused attention, B{c['batch']} H{c['heads']} d{c['head_dim']} {c['dtype']}, non-causal; "
        "wall time per call of back-to-back calls and one synchronize:"
    ]
    for seq, r in results["seqs"].items():
        lines += [
            f"  S={seq} ({r['calls_per_block']} calls per block):",
            f"    {'column':<20}{'median us':>11}{'spread us':>22}{'x over naive':>14}{'rel err':>10}",
        ]
        for name, t in r["timings"].items():
            speedup = r["speedup_over_naive"].get(name)
            cell = f"{speedup:.2f}x" if speedup is not None else "-"
            lines.append(f"    {name:<20}{t['median_us']:>11.1f}{_spread(t):>22}{cell:>14}{r['rel_err'][name]:>10.1e}")
    return "\n".join(lines)
