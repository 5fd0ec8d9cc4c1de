"""transformers' continuous batching (``model.generate_batch``, ``ContinuousBatchingManager``)
on cudnn_attn's attention.

transformers 5.x serves continuous batching with ``"sdpa"``, ``"paged|eager"`` or a
FlashAttention implementation, and tells them apart by name: a name containing ``"flash"``
gets FlashAttention's keywords (``cu_seq_lens_q/k``, ``max_length_q/k``, no dense mask), and
its paged cache hands each layer the step's keys and values packed by sequence. cudnn_attn's
layers (``transformers.attention_forward``) take exactly that: one packed varlen call, each
sequence causal aligned bottom-right (its new tokens are the last of its keys), sinks and
soft-capping included. Any other name is refused ("Implementation cudnn_attn is not supported
for continuous batching").

Before transformers 5.2x (5.17, say) the batching names the implementation ``"paged|" + name``
and hands it the paged cache itself: the implementation writes the step's keys and values and
reads each sequence's back (``cache.update``), and the lengths come as ``max_seqlen_q/k``, the
keys' per layer kind. ``for_continuous_batching`` registers that form too where transformers has
it (``_paged_forward``), and sets the name it runs under.

So cudnn_attn registers itself under ``BATCHING_NAME`` as well. ``model.set_attn_implementation``
would then look for a FlashAttention package or hub kernel of that name, and there is none to
load, so ``for_continuous_batching`` sets the name on the model's configs as that method sets
it, without the load. No digit follows ``"flash"`` in the name: transformers reserves block
tables (``flash_attn_with_kvcache``) for FlashAttention 2 and 3, and keeps its index-based cache
path for everything else.
"""

from __future__ import annotations

from typing import Any

from .transformers import attention_forward, register

BATCHING_NAME = "cudnn_attn_flash_varlen"


def for_continuous_batching(model: Any) -> str:
    """Run ``model``'s attention on cudnn_attn in ``generate_batch`` and
    ``ContinuousBatchingManager`` (and in plain calls: the layers are the same).

    Args:
        model: a transformers ``PreTrainedModel`` whose attention follows ``AttentionInterface``.

    Returns:
        The implementation's name, ``BATCHING_NAME``; ``model.set_attn_implementation("sdpa")``
        switches back.

    Example:
        ```python
        import torch
        from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

        from cudnn_attn.integrations.transformers_batching import for_continuous_batching

        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2)
        model = LlamaForCausalLM(config).eval()
        for_continuous_batching(model)
        generation = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
        results = model.generate_batch([[1, 2, 3], [4, 5]], generation_config=generation)
        assert all(len(r.generated_tokens) == 4 for r in results.values())
        ```
    """
    name = register(BATCHING_NAME)
    if _paged_names():
        from transformers import AttentionInterface, AttentionMaskInterface

        from .transformers import token_mask

        name = PAGED_PREFIX + BATCHING_NAME
        AttentionInterface.register(name, _paged_forward)
        AttentionMaskInterface.register(name, token_mask)
    for config in _configs(model):
        config._attn_implementation_internal = name
    return name


PAGED_PREFIX = "paged|"


def _paged_names() -> bool:
    """Whether this transformers runs batching under ``"paged|"`` names whose implementation
    updates the paged cache itself (before 5.2x: ``"paged|sdpa"`` is one of its own)."""
    from transformers import AttentionInterface

    return PAGED_PREFIX + "sdpa" in AttentionInterface._global_mapping


def _paged_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
    """One layer of transformers' batching before 5.2x: the step's keys and values written into
    the paged cache and every sequence's read back, packed (``[1, H, T, D]``), then the layer."""
    cache = kwargs.pop("cache", None)
    if cache is not None:
        key, value = cache.update(
            key_states=key,
            value_states=value,
            layer_idx=module.layer_idx,
            read_index=kwargs.pop("read_index"),
            write_index=kwargs.pop("write_index"),
        )
        key, value = key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0)
    kind = "sliding_attention" if getattr(module, "sliding_window", None) else "full_attention"
    for old, new in (("max_seqlen_q", "max_length_q"), ("max_seqlen_k", "max_length_k")):
        if old in kwargs:
            kwargs[new] = kwargs.pop(old)
    for length in ("cu_seq_lens_k", "max_length_k"):
        if isinstance(kwargs.get(length), dict):
            kwargs[length] = kwargs[length][kind]
    kwargs.pop("block_table", None)
    if kwargs.get("cu_seq_lens_q") is not None:
        attention_mask = None  # the step's sequence ids by query token: the lengths say it, keys included
    return attention_forward(module, query, key, value, attention_mask, **kwargs)


def _configs(model: Any) -> list[Any]:
    """The model's config, its submodels' and every sub-config below them, each once."""
    found: dict[int, Any] = {}
    pending = [module.config for module in model.modules() if hasattr(module, "config")]
    while pending:
        config = pending.pop()
        if id(config) in found or not hasattr(config, "_attn_implementation_internal"):
            continue
        found[id(config)] = config
        pending += [getattr(config, key) for key in getattr(config, "sub_configs", {}) if getattr(config, key, None)]
    return list(found.values())
