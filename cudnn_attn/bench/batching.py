"""transformers' continuous batching on cudnn_attn against its own ``sdpa`` (``bench --batching``).

A small Llama-shaped model (random weights, bf16, GQA 16/4 heads of 128) serves 64 requests of
mixed prompt lengths (32-1024 tokens) with ``model.generate_batch``, greedy, 64 new tokens each:
once through transformers' ``"sdpa"`` and once through ``for_continuous_batching`` (cudnn_attn's
packed varlen layers over transformers' paged cache), in alternating rounds after a warm-up run
of each (plans, CUDA graphs). Tokens per second is the requests' new tokens over the call's wall
time; the columns' greedy tokens are compared (a random model's logits nearly tie, and bf16
rounding then picks another token, after which a request's tokens differ: a sanity check, not
an exactness test, which ``tests/test_gpu_transformers_batching.py`` is), beside how often
``"sdpa"`` agrees with itself when only its batches change (``OTHER_BATCH_TOKENS``): the
agreement rounding alone leaves.

Each column runs as transformers sets it up for its name: on a GPU, CUDA graphs and asynchronous
batching for a FlashAttention name such as cudnn_attn's, neither for ``"sdpa"`` (a model on the
CPU: neither, for both). The batch holds at most ``BATCH_TOKENS`` tokens, transformers' own
default: given the cache's size alone, transformers 5.17 sizes the batch by the GPU's free
memory, and its asynchronous batching then walks a Python list of that many tokens every step
(``infer_carry_over_ids``): 49.5 s against 5.2 s for 8 short requests on an H200, whatever the
attention.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

ROUNDS = 3
BATCH_TOKENS = 8192
OTHER_BATCH_TOKENS = 2048  # sdpa's run against itself: other batches, other rounding


@dataclass(frozen=True)
class Workload:
    requests: int = 64
    shortest: int = 32
    longest: int = 1024
    new_tokens: int = 64
    hidden: int = 2048
    layers: int = 8
    heads: int = 16
    kv_heads: int = 4
    vocab: int = 32000


def _model(w: Workload, device: str) -> Any:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=w.vocab,
        hidden_size=w.hidden,
        intermediate_size=2 * w.hidden,
        num_hidden_layers=w.layers,
        num_attention_heads=w.heads,
        num_key_value_heads=w.kv_heads,
        max_position_embeddings=w.longest + w.new_tokens,
    )
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = transformers.LlamaForCausalLM(config)
    return model.to(device=device, dtype=dtype).eval()  # type: ignore[call-arg]  # transformers wraps .to


def _prompts(w: Workload) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(w.shortest, w.longest + 1, (w.requests,), generator=gen)
    return [torch.randint(0, w.vocab, (int(n),), generator=gen).tolist() for n in lengths]


def measure(w: Workload = Workload(), device: str = "cuda", rounds: int = ROUNDS) -> dict[str, Any]:
    """Tokens per second of each column (median of ``rounds``, and the spread), how many greedy
    tokens the columns share, and (``sdpa_self``) how many ``"sdpa"`` shares with its own run
    over batches of ``OTHER_BATCH_TOKENS``."""
    import transformers

    from ..integrations.transformers_batching import for_continuous_batching

    model, prompts = _model(w, device), _prompts(w)
    generation = transformers.GenerationConfig(
        max_new_tokens=w.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    blocks = -(-sum(len(p) + w.new_tokens for p in prompts) // 256) + w.requests  # every request at once

    on_gpu = device == "cuda"  # a CPU model steps synchronously, whatever GPU the host has

    def batching(batch_tokens: int = BATCH_TOKENS) -> Any:  # afresh for every run, as a caller would pass it
        return transformers.ContinuousBatchingConfig(
            num_blocks=blocks,
            max_batch_tokens=batch_tokens,
            use_cuda_graph=None if on_gpu else False,
            use_async_batching=None if on_gpu else False,
        )

    def use(column: str) -> None:
        if column == "sdpa":
            model.set_attn_implementation("sdpa")
        else:
            for_continuous_batching(model)

    def run(column: str, batch_tokens: int = BATCH_TOKENS) -> tuple[float, dict[str, list[int]]]:
        use(column)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        config = batching(batch_tokens)
        results = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=config)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tokens = {key: list(r.generated_tokens) for key, r in results.items()}
        return sum(map(len, tokens.values())) / seconds, tokens

    columns = ("sdpa", "cudnn_attn")
    outputs = {c: run(c)[1] for c in columns}  # warm-up: plans, captured graphs
    rates: dict[str, list[float]] = {c: [] for c in columns}
    for round_ in range(rounds):
        for column in columns if round_ % 2 == 0 else columns[::-1]:
            rates[column].append(run(column)[0])
    other = run("sdpa", OTHER_BATCH_TOKENS)[1]
    model.set_attn_implementation("sdpa")
    theirs = outputs["sdpa"]
    tokens, requests = _agreement(outputs["cudnn_attn"], theirs)
    self_tokens, self_requests = _agreement(other, theirs)
    return {
        "workload": vars(w),
        "columns": {c: {"tokens_per_s": statistics.median(v), "low": min(v), "high": max(v)} for c, v in rates.items()},
        "tokens_equal": tokens,
        "requests_equal": requests,
        "sdpa_self": {"batch_tokens": OTHER_BATCH_TOKENS, "tokens_equal": self_tokens, "requests_equal": self_requests},
    }


def _agreement(ours: dict[str, list[int]], theirs: dict[str, list[int]]) -> tuple[float, float]:
    """The share of greedy tokens, and of requests whole, that ``ours`` shares with ``theirs``."""
    same = sum(a == b for key in theirs for a, b in zip(ours[key], theirs[key]))
    tokens = same / max(1, sum(map(len, theirs.values())))
    return tokens, sum(ours[key] == theirs[key] for key in theirs) / max(1, len(theirs))


def format_batching(r: dict[str, Any]) -> str:
    w = r["workload"]
    head = (
        f"continuous batching, {w['requests']} requests of {w['shortest']}-{w['longest']} prompt tokens, "
        f"{w['new_tokens']} new each; Llama-shaped {w['layers']} layers, {w['heads']}/{w['kv_heads']} heads"
    )
    cells = [
        f"  {name:<10} {c['tokens_per_s']:8.0f} tokens/s ({c['low']:.0f}-{c['high']:.0f})"
        for name, c in r["columns"].items()
    ]
    ratio = r["columns"]["cudnn_attn"]["tokens_per_s"] / r["columns"]["sdpa"]["tokens_per_s"]
    tail = (
        f"  cudnn_attn / sdpa {ratio:.2f}x; greedy tokens equal {100 * r['tokens_equal']:.1f}%, "
        f"requests equal {100 * r['requests_equal']:.0f}%"
    )
    own = r["sdpa_self"]
    baseline = (
        f"  sdpa against itself over batches of {own['batch_tokens']} tokens: greedy tokens equal "
        f"{100 * own['tokens_equal']:.1f}%, requests equal {100 * own['requests_equal']:.0f}%"
    )
    return "\n".join([head, *cells, tail, baseline])
