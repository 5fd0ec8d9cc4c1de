"""``cudnn-attn bench --varlen``: mixed-length batches, packed against padded, same run.

- Forward+backward of a batch of causal sequences with lengths drawn from 128-8192 (H16 d128
  bf16): ``varlen_sdpa`` on the packed batch; torch's SDPA on the batch padded to its longest
  sequence (``is_causal`` alone is exact for the real rows: a real query's keys are all real);
  our dense graph path (``cudnn_attn.sdpa``) on a fixed-length batch of the same total tokens.
  Throughput is effective: only the real tokens' attention work counts.
- Plans built over 1,000 random packings (the plan cache's misses), forward and backward.
- Memory of a packed training step at 32k and 128k tokens (``packed_memory``: GQA 32/8 heads,
  d128 bf16, long-tailed documents): peak bytes beyond the step's tensors and bytes still
  allocated once they are freed (``memory.step_memory``), beside the step's time.

Columns are timed in shuffled interleaved rounds (``host.round_order``): medians, spreads.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from .. import default_cache, varlen_sdpa
from ..functional import sdpa
from .host import round_order
from .memory import document_lengths, step_memory
from .progress import progress

HEADS, HEAD_DIM = 16, 128
LENGTHS = (128, 8192)


def _lengths(gen: torch.Generator, count: int, low: int = LENGTHS[0], high: int = LENGTHS[1]) -> list[int]:
    return torch.randint(low, high + 1, (count,), generator=gen).tolist()


def _causal_flops(lengths: list[int], h: int = HEADS, d: int = HEAD_DIM) -> float:
    """Forward work of causal attention over these sequences (half of each square)."""
    return sum(4.0 * h * n * n * d / 2 for n in lengths)


def _training_step(attend: Callable[..., torch.Tensor], inputs: list[torch.Tensor], d_out: torch.Tensor) -> Callable:
    leaves = [x.detach().requires_grad_() for x in inputs]

    def step() -> None:
        for leaf in leaves:
            leaf.grad = None
        attend(*leaves).backward(d_out)

    return step


def mixed_batch(count: int = 16, seed: int = 0, rounds: int = 10) -> dict[str, Any]:
    """One mixed-length batch, forward+backward, three ways (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = _lengths(gen, count)
    tokens, longest = sum(lengths), max(lengths)
    dev, dt = "cuda", torch.bfloat16
    packed = [torch.randn(tokens, HEADS, HEAD_DIM, generator=gen).to(dev, dt) for _ in range(3)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    padded = [torch.zeros(count, HEADS, longest, HEAD_DIM, device=dev, dtype=dt) for _ in range(3)]
    for b, n in enumerate(lengths):
        start = int(cu[b])
        for dense, flat in zip(padded, packed):
            dense[b, :, :n] = flat[start : start + n].transpose(0, 1)
    # The fixed-length batch of the same tokens: sequences of the mean length (a multiple of 128).
    fixed_len = max(128, round(tokens / count / 128) * 128)
    fixed = [
        torch.randn(max(1, tokens // fixed_len), HEADS, fixed_len, HEAD_DIM, generator=gen).to(dev, dt)
        for _ in range(3)
    ]

    def torch_padded(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    steps = {
        "varlen_sdpa, packed": _training_step(
            lambda q, k, v: varlen_sdpa(q, k, v, cu, cu, longest, longest, is_causal=True),
            packed,
            torch.randn_like(packed[0]),
        ),
        "torch sdpa, padded": _training_step(torch_padded, padded, torch.randn_like(padded[0])),
        "cudnn_attn.sdpa, fixed-length batch": _training_step(
            lambda q, k, v: sdpa(q, k, v, is_causal=True), fixed, torch.randn_like(fixed[0])
        ),
    }
    work = {
        "varlen_sdpa, packed": _causal_flops(lengths),
        "torch sdpa, padded": _causal_flops(lengths),  # only the real tokens' work counts
        "cudnn_attn.sdpa, fixed-length batch": _causal_flops([fixed_len] * fixed[0].shape[0]),
    }
    # Correctness: the packed result against torch's on the padded batch, real rows only.
    out = varlen_sdpa(packed[0], packed[1], packed[2], cu, cu, longest, longest, is_causal=True)
    reference = torch_padded(*padded)
    expected = torch.cat([reference[b, :, :n].transpose(0, 1) for b, n in enumerate(lengths)])
    error = float((out.float() - expected.float()).norm() / expected.float().norm())
    cells = _time(steps, rounds)
    for name, cell in cells.items():
        cell["tflops"] = 3.5 * work[name] / (cell["ms"] * 1e-3) / 1e12  # forward 1 + backward 2.5
    return {"lengths": lengths, "tokens": tokens, "fixed_length": fixed_len, "rel_err_vs_torch": error, "cells": cells}


def plans_over_packings(packings: int = 1000, token_budget: int = 32768, seed: int = 1) -> dict[str, Any]:
    """Random packings (sequences of 128-8192 tokens until ``token_budget`` is filled), each
    run forward and backward through ``varlen_sdpa``; the plans the run built."""
    cache = default_cache()  # varlen plans through it; cleared so that its counts are this run's
    cache.clear()
    gen = torch.Generator().manual_seed(seed)
    batches: dict[int, int] = {}
    for _ in progress(range(packings), "packings", unit="packing"):
        lengths: list[int] = []
        while sum(lengths) < token_budget:
            lengths += _lengths(gen, 1)
        lengths[-1] -= sum(lengths) - token_budget  # fill the budget exactly
        lengths = [n for n in lengths if n > 0]
        batches[len(lengths)] = batches.get(len(lengths), 0) + 1
        q, k, v = (torch.randn(token_budget, 1, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        q.requires_grad_()
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        longest = max(lengths)
        varlen_sdpa(q, k, v, cu, cu, longest, longest, is_causal=True).sum().backward()
    stats = cache.stats()
    return {
        "packings": packings,
        "plans_built": int(stats["builds"]),
        "batch_sizes_seen": len(batches),
        "build_seconds": stats["build_seconds"],
    }


MEMORY_TOKENS = (32768, 131072)
MEMORY_HEADS, MEMORY_KV_HEADS = 32, 8


def packed_memory(tokens: tuple[int, ...] = MEMORY_TOKENS, seed: int = 0, rounds: int = 5) -> list[dict[str, Any]]:
    """A packed causal training step (``varlen_sdpa``, GQA 32/8 heads, d128 bf16) over documents
    of long-tailed lengths (``memory.document_lengths``, multiples of 256): its memory
    (``memory.step_memory``, run first, on a fresh plan) and its median time, per token count."""
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for total in tokens:
        lengths = document_lengths(total, 256, seed=seed)
        longest = max(lengths)
        cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(device, torch.int32)

        def make(total: int = total) -> list[torch.Tensor]:
            gen = torch.Generator(device).manual_seed(seed)
            shapes = [(total, MEMORY_HEADS, HEAD_DIM), *[(total, MEMORY_KV_HEADS, HEAD_DIM)] * 2]
            shapes.append((total, MEMORY_HEADS, HEAD_DIM))  # d_out
            return [torch.randn(s, generator=gen, device=device, dtype=torch.bfloat16) for s in shapes]

        def attend(q, k, v, cu=cu, longest=longest):
            return varlen_sdpa(q, k, v, cu, cu, longest, longest, is_causal=True)

        memory = step_memory(attend, make, device)
        inputs = make()
        cell = _time({"step": _training_step(attend, inputs[:3], inputs[3])}, rounds)["step"]
        del inputs
        rows.append({"tokens": total, "documents": len(lengths), "longest": longest, **memory, **cell})
    return rows


def llama_step(budget: int = 16384, longest: int = 4096, seed: int = 2, rounds: int = 6) -> dict[str, Any]:
    """Training-step throughput of a small Llama (8 layers, hidden 1024, 16/4 heads, random
    weights from a config) on documents of 128-4096 tokens: packed into one row of ``budget``
    tokens (position ids restarting at 0) through ``attn_implementation="cudnn_attn"``, against
    the same documents padded to the longest with an attention mask through ``"sdpa"``.
    Tokens/s counts real tokens only. Needs the ``transformers`` extra."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..integrations import transformers as hf

    hf.register()
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < budget:
        lengths += _lengths(gen, 1, 128, longest)
    lengths[-1] -= sum(lengths) - budget
    lengths = [n for n in lengths if n > 0]
    config = LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=8192,
    )
    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(config)
    model.to("cuda", torch.bfloat16)
    docs = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in lengths]
    packed = torch.cat(docs)[None].cuda()
    positions = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    padded = torch.zeros(len(docs), max(lengths), dtype=torch.long)
    mask = torch.zeros(len(docs), max(lengths), dtype=torch.long)
    for i, doc in enumerate(docs):
        padded[i, : len(doc)], mask[i, : len(doc)] = doc, 1
    padded, mask = padded.cuda(), mask.cuda()
    labels_padded = padded.masked_fill(mask == 0, -100)

    def packed_step() -> None:
        model.set_attn_implementation("cudnn_attn")
        model.zero_grad(set_to_none=True)
        model(input_ids=packed, position_ids=positions, labels=packed, use_cache=False).loss.backward()

    def padded_step() -> None:
        model.set_attn_implementation("sdpa")
        model.zero_grad(set_to_none=True)
        model(input_ids=padded, attention_mask=mask, labels=labels_padded, use_cache=False).loss.backward()

    cells = _time({"cudnn_attn, packed": packed_step, "sdpa, padded": padded_step}, rounds)
    for cell in cells.values():
        cell["tokens_per_s"] = budget / (cell["ms"] * 1e-3)
    return {"documents": len(docs), "tokens": budget, "padded_tokens": len(docs) * max(lengths), "cells": cells}


def _time(steps: dict[str, Callable], rounds: int) -> dict[str, dict]:
    from ..ops.cudnn import autotune

    device = torch.device("cuda", torch.cuda.current_device())
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds):
        for name in round_order(list(steps), r):
            samples[name].append(autotune.time_plan(steps[name], device, 2, 5))
    return {
        name: {"ms": statistics.median(v), "spread_pct": 100.0 * (max(v) - min(v)) / statistics.median(v)}
        for name, v in samples.items()
    }


def format_memory(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"Packed training step memory (varlen_sdpa, causal, GQA {MEMORY_HEADS}/{MEMORY_KV_HEADS} heads, "
        f"d{HEAD_DIM} bf16, long-tailed documents; GB = 1e9 bytes):"
    ]
    lines.append(
        f"  {'tokens':>8}{'docs':>6}{'longest':>9}{'tensors':>10}{'peak extra':>12}{'x':>7}{'held after':>12}{'ms':>9}"
    )
    for r in rows:
        lines.append(
            f"  {r['tokens']:>8}{r['documents']:>6}{r['longest']:>9}{r['io_bytes'] / 1e9:>9.2f}G"
            f"{r['peak_extra'] / 1e9:>11.2f}G{r['peak_extra'] / r['io_bytes']:>6.2f}x"
            f"{r['held_after'] / 1e9:>11.3f}G{r['ms']:>9.2f}"
        )
    return "\n".join(lines)


def format_varlen(mixed: dict[str, Any], plans: dict[str, Any], llama: dict[str, Any] | None = None) -> str:
    lines = [
        f"Mixed-length batch, forward+backward ({len(mixed['lengths'])} causal sequences of "
        f"{min(mixed['lengths'])}-{max(mixed['lengths'])} tokens, {mixed['tokens']} in all, H{HEADS} d{HEAD_DIM} bf16; "
        f"effective TFLOP/s; x = over torch's padded batch):"
    ]
    base = mixed["cells"]["torch sdpa, padded"]["tflops"]
    for name, cell in mixed["cells"].items():
        lines.append(
            f"  {name:<38}{cell['tflops']:>8.1f} TFLOP/s  {cell['tflops'] / base:>5.2f}x  "
            f"(spread {cell['spread_pct']:.0f}%)"
        )
    lines.append(
        f"  fixed-length batch: sequences of {mixed['fixed_length']} tokens; packed vs torch padded "
        f"relative error {mixed['rel_err_vs_torch']:.4f}"
    )
    lines.append(
        f"Plans built over {plans['packings']} random packings ({plans['batch_sizes_seen']} batch sizes): "
        f"{plans['plans_built']} ({plans['build_seconds']:.1f} s building)"
    )
    if llama is not None:
        lines.append(
            f"Llama training step (8 layers, hidden 1024, 16/4 heads, bf16; {llama['documents']} documents of "
            f"128-4096 tokens, {llama['tokens']} tokens; padded: {llama['padded_tokens']}):"
        )
        for name, cell in llama["cells"].items():
            lines.append(
                f"  {name:<20}{cell['tokens_per_s']:>10,.0f} tokens/s  ({cell['ms']:.1f} ms, "
                f"spread {cell['spread_pct']:.0f}%)"
            )
    return "\n".join(lines)
