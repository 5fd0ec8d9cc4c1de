"""transformers' continuous batching on a GPU (``integrations/transformers_batching.py``): every
attention call inside ``generate_batch`` equals the reference backend's on the same inputs, and
the CUDA graphs transformers captures for cudnn_attn's name replay the eager steps exactly."""

from __future__ import annotations

import pytest
import torch
from conftest import TOLERANCE, rel_err

import cudnn_attn

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "ContinuousBatchingConfig"):
    pytest.skip("this transformers has no continuous batching", allow_module_level=True)

from transformers import GenerationConfig  # noqa: E402

import cudnn_attn.integrations.transformers_batching as batching  # noqa: E402

pytestmark = pytest.mark.gpu


def _model_and_prompts():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 200, (12,), generator=gen)
    return model, [torch.randint(0, 512, (int(n),), generator=gen).tolist() for n in lengths]


def _generate(model, prompts, graphs: bool):
    generation = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=0)
    config = transformers.ContinuousBatchingConfig(num_blocks=128, max_batch_tokens=2048, use_cuda_graph=graphs)
    results = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=config)
    return {key: r.generated_tokens for key, r in results.items()}


def test_every_attention_call_of_generate_batch_matches_the_reference(monkeypatch):
    import cudnn_attn.integrations.transformers as layers

    model, prompts = _model_and_prompts()
    errors = []
    layer = layers.attention_forward

    def checked(module, query, key, value, attention_mask, **kwargs):
        out, weights = layer(module, query, key, value, attention_mask, **kwargs)
        with cudnn_attn.backend("reference"):
            want, _ = layer(module, query, key, value, attention_mask, **kwargs)
        errors.append(rel_err(out, want))
        return out, weights

    # Registered as transformers' layer (5.2x), and called by the paged form (5.17)
    monkeypatch.setattr(layers, "attention_forward", checked)
    monkeypatch.setattr(batching, "attention_forward", checked)
    batching.for_continuous_batching(model)
    tokens = _generate(model, prompts, graphs=False)
    monkeypatch.undo()
    batching.for_continuous_batching(model)  # the unchecked layer registered again
    assert all(len(t) == 8 for t in tokens.values())
    assert errors and max(errors) < TOLERANCE[torch.bfloat16], max(errors)


def test_captured_steps_replay_the_eager_ones():
    """A replay that skipped work or read a stale step's lengths would change most tokens. With
    graphs transformers pads each step's tokens, so its own layers' products may round otherwise
    and a near-tie pick another token later on: every request's first token must agree, and 90%
    of all (576 of 576 on an H200)."""
    model, prompts = _model_and_prompts()
    batching.for_continuous_batching(model)
    captured, eager = _generate(model, prompts, graphs=True), _generate(model, prompts, graphs=False)
    assert captured.keys() == eager.keys()
    assert all(captured[key][0] == eager[key][0] for key in eager)
    same = sum(a == b for key in eager for a, b in zip(captured[key], eager[key]))
    assert same >= 0.9 * sum(map(len, eager.values()))


def test_a_cpu_layer_refuses_a_cuda_graph_capture_naming_the_setting():
    """transformers captures CUDA graphs for cudnn_attn's name whenever a GPU is present, even for a
    model on the CPU, whose work a replay would skip: refused, naming the setting that avoids it."""
    from cudnn_attn.errors import UnsupportedError
    from cudnn_attn.integrations.transformers import attention_forward

    layer = torch.nn.Module()
    layer.is_causal = True
    q, k, v = (torch.randn(1, 4, 8, 16) for _ in range(3))
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(UnsupportedError, match="use_cuda_graph=False"):
        with torch.cuda.graph(graph):
            attention_forward(layer, q, k, v, None)
    out, _ = attention_forward(layer, q, k, v, None)  # outside a capture: runs
    assert out.shape == (1, 8, 4, 16)
