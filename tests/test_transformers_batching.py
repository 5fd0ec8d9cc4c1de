"""transformers' continuous batching on cudnn_attn (``integrations/transformers_batching.py``):
greedy tokens of ``generate_batch`` equal transformers' own attention on the same weights, for a
plain GQA model, gpt-oss's sinks over sliding and full layers, and Gemma-2's soft-capping."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "ContinuousBatchingConfig"):
    pytest.skip("this transformers has no continuous batching", allow_module_level=True)

from transformers import GenerationConfig  # noqa: E402

from cudnn_attn.integrations.transformers_batching import BATCHING_NAME, for_continuous_batching  # noqa: E402
from cudnn_attn.integrations.transformers_packing import Packing, packed_mask  # noqa: E402

LENGTHS = (5, 9, 3, 17, 1, 12)
# A cache of its own size, synchronous, no CUDA graphs: left to itself, transformers sizes the cache
# by a GPU's memory, steps on CUDA streams and captures CUDA graphs when the host has a GPU, though
# the model is on the CPU (a graph's replay then runs none of the CPU's work: the tokens after the
# first come out 0). It decides graphs by the implementation's name: on for a FlashAttention name
# such as cudnn_attn's, off for "sdpa".
BATCHING = transformers.ContinuousBatchingConfig(
    block_size=16, num_blocks=64, max_batch_tokens=128, use_async_batching=False, use_cuda_graph=False
)


def _tiny(kind: str):
    torch.manual_seed(0)
    common = dict(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval(), "sdpa"
    if kind == "gpt-oss":
        config = transformers.GptOssConfig(
            **common,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        )
        model = transformers.GptOssForCausalLM(config).eval()
        with torch.no_grad():
            for layer in model.model.layers:  # sinks that weigh: a zero sink would hide a dropped one
                layer.self_attn.sinks.normal_(0, 2)
        return model, "eager"
    config = transformers.Gemma2Config(
        **common, head_dim=16, sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=None
    )
    return transformers.Gemma2ForCausalLM(config).eval(), "eager"


@pytest.mark.parametrize("kind", ["llama", "gpt-oss", "gemma-2"])
def test_generate_batch_gives_transformers_greedy_tokens(kind):
    model, reference = _tiny(kind)
    prompts = [torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in LENGTHS]
    generation = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)
    model.set_attn_implementation(reference)
    want = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=BATCHING)
    name = for_continuous_batching(model)
    assert name.removeprefix("paged|") == BATCHING_NAME and name == model.config._attn_implementation
    got = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=BATCHING)
    for results in (want, got):  # generate_batch keeps a failed request's error to itself
        _all_served(results, len(prompts), 6)
    assert {k: r.generated_tokens for k, r in got.items()} == {k: r.generated_tokens for k, r in want.items()}
    model.set_attn_implementation(reference)  # and back
    assert model.config._attn_implementation == reference


def _all_served(results, requests: int, tokens: int) -> None:
    assert len(results) == requests and all(len(r.generated_tokens) == tokens for r in results.values())


@pytest.mark.parametrize("kind", ["gpt-oss", "gemma-2"])
def test_long_prompts_prefilled_in_chunks_over_a_crowded_cache_keep_the_tokens(kind):
    """Prompts longer than the sliding window (8) and than a page (16), prefilled 8 tokens a step
    over a cache of 12 blocks, fewer than the requests need together, so they wait their turn."""
    model, reference = _tiny(kind)
    lengths = (70, 133, 1, 40, 95, 3)
    prompts = [torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]
    crowded = transformers.ContinuousBatchingConfig(
        block_size=16, num_blocks=12, max_batch_tokens=8, use_async_batching=False, use_cuda_graph=False
    )
    generation = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=-1, pad_token_id=0)
    model.set_attn_implementation(reference)
    want = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=crowded)
    name = for_continuous_batching(model)
    ours = transformers.AttentionInterface._global_mapping[name]
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return ours(*args, **kwargs)

    transformers.AttentionInterface.register(name, counted)
    try:
        got = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=crowded)
    finally:
        transformers.AttentionInterface.register(name, ours)
    for results in (want, got):
        _all_served(results, len(prompts), 10)
    assert {k: r.generated_tokens for k, r in got.items()} == {k: r.generated_tokens for k, r in want.items()}
    layers = model.config.num_hidden_layers
    assert len(calls) >= layers * -(-sum(lengths) // 8)  # every prompt token went through ours, 8 a step


def test_the_plain_name_is_refused_by_transformers_continuous_batching():
    """Why the batching name exists: transformers admits 'sdpa', 'paged|eager' and FlashAttention
    names only; this test fails when it admits others (then the plain name could serve)."""
    import cudnn_attn.integrations.transformers as cudnn_hf

    model, _ = _tiny("llama")
    model.set_attn_implementation(cudnn_hf.register())
    generation = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with pytest.raises(ValueError, match="not supported for continuous batching|paged.cudnn_attn.* is not supported"):
        model.generate_batch([[1, 2, 3]], generation_config=generation, continuous_batching_config=BATCHING)


def test_packed_mask_is_per_sequence_bottom_right_and_windowed():
    cu_q, cu_k = torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([0, 4, 7], dtype=torch.int32)
    mask = packed_mask(Packing(cu_q, cu_k, 2, 4, 7, None), 4, 7, causal=True, window=1)[0, 0]
    expected = torch.tensor(
        [
            [0, 1, 1, 0, 0, 0, 0],  # sequence 0's query at position 2: keys 1-2 (a window of 2)
            [0, 0, 1, 1, 0, 0, 0],  # position 3: keys 2-3
            [0, 0, 0, 0, 0, 1, 1],  # sequence 1's query at position 2: keys 1-2 of its own
            [1, 1, 1, 1, 1, 1, 1],  # a row past the last sequence: any (its output is unused)
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
