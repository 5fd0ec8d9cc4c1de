"""transformers' continuous batching on cudnn_attn: ``model.generate_batch`` (a paged KV cache,
a scheduler, prompt chunks and decode tokens in one step) with the library's attention, its
greedy tokens against transformers' own attention on the same weights.

    python samples/10_continuous_batching.py

Three small random models stand for the families: a GQA decoder (Llama), gpt-oss's attention
sinks over sliding and full layers, and Gemma-2's logit soft-capping. Each serves 16 requests of
mixed lengths. ``for_continuous_batching(model)`` is the one call: transformers' continuous
batching admits its own implementations and FlashAttention ones by name, so the library
registers itself under a FlashAttention-style name and sets it on the model
(``cudnn_attn.integrations.transformers_batching``). The models here run on the CPU (the
reference backend) on any host; ``cudnn-attn bench --batching`` serves one on a GPU against
``"sdpa"`` (its H200 figures are in docs/benchmarks.md). Prints the share of greedy tokens that
differ (as ``rel_err=``, which the test suite reads) and exits non-zero on a mismatch.
"""

from __future__ import annotations

from itertools import zip_longest

import torch
import transformers
from transformers import GenerationConfig

from cudnn_attn.integrations.transformers_batching import for_continuous_batching

torch.manual_seed(0)
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def models():
    """(label, model, transformers' attention to compare with)."""
    llama = transformers.LlamaConfig(**COMMON, num_key_value_heads=2)
    yield "Llama (GQA 4/2)", transformers.LlamaForCausalLM(llama), "sdpa"
    oss = transformers.GptOssConfig(
        **COMMON,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
    )
    model = transformers.GptOssForCausalLM(oss)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 2)  # sinks that weigh
    yield "gpt-oss (sinks, sliding window)", model, "eager"
    gemma = transformers.Gemma2Config(
        **COMMON, num_key_value_heads=2, head_dim=16, sliding_window=16, attn_logit_softcapping=20.0
    )
    yield "Gemma-2 (soft-capping, sliding window)", transformers.Gemma2ForCausalLM(gemma), "eager"


prompts = [torch.randint(0, 256, (int(n),)).tolist() for n in torch.randint(1, 48, (16,))]
generation = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=-1, pad_token_id=0)
# A cache of its own size, stepped synchronously, no CUDA graphs: the model is on the CPU, and
# transformers otherwise sizes the cache by a GPU's memory and captures graphs when the host has one
batching = transformers.ContinuousBatchingConfig(num_blocks=16, use_async_batching=False, use_cuda_graph=False)
ok = True
for label, model, reference in models():
    model.eval()
    model.set_attn_implementation(reference)
    want = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=batching)
    for_continuous_batching(model)
    got = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=batching)
    pairs = [(got[k].generated_tokens, want[k].generated_tokens) for k in want]
    # a token missing from either side differs too
    differing = sum(a != b for g, w in pairs for a, b in zip_longest(g, w)) / sum(len(w) for _, w in pairs)
    ok &= differing == 0
    print(f"{label:<40} greedy tokens unlike {reference}'s: rel_err={differing:.2e} (a share)")
if not ok:
    raise SystemExit("MISMATCH")
print("all results match")
