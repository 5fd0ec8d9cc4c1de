"""``cudnn_attn.sdpa``: a drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

Same signature and semantics, differentiable, backed by cached graphs (cuDNN on CUDA
tensors, the reference backend on CPU tensors)::

    out = cudnn_attn.sdpa(q, k, v, is_causal=True)
    # == torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

``attn_mask`` may be boolean (True = takes part), additive (broadcastable to ``[B, H, L, S]``)
or one of torch's ``CausalBias`` objects (``causal_upper_left``/``causal_lower_right``: cuDNN's
top-left and bottom-right causal masks). Inputs are fp16/bf16/fp32 ``[B, H, L, E]`` (or
``[H, L, E]``); under ``torch.autocast`` they are cast to its dtype first, as torch does.
What cuDNN lacks or serves worse (float64; float32 on a GPU; a scale <= 0 on a GPU; bottom-right
causal with dropout or L > S) runs on torch's own kernel (``functional/torch_kernel.py`` says
when; the log says which ran). Dropout draws a
fresh seed from torch's default generator on each call, so ``torch.manual_seed`` makes it
repeatable; the backward reuses the forward's mask.

Eager calls take ``functional/eager.py``'s path (a flat key to a prepared run); under
``torch.compile`` the call is one opaque custom op (``functional/compiled.py``).
"""

from __future__ import annotations

import torch

from ..errors import ShapeMismatchError, UnsupportedError, ValidationError
from ..runtime import prepared
from . import eager as sdpa_eager
from . import score_terms, torch_kernel
from .arguments import (
    ARGUMENT_NAMES,
    autocast_inputs,
    batched,
    causal_from_mask,
    causal_kind,
    check_arguments,
)
from .compiled import sdpa_forward
from .nested import nested_sdpa
from .score_terms import sdpa_with_score_terms


def sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
) -> torch.Tensor:
    """Scaled dot-product attention with torch's signature, on cached cuDNN graphs.

    Beyond torch's arguments, as FlashAttention and FlashInfer name them
    (``functional/score_terms.py``):

    - ``sinks``: attention sinks, a logit per query head (``[H_q]``, gpt-oss's) in every
      softmax denominator, weighing no value; learnable.
    - ``softcap``: logit soft-capping (Gemma-2's), scores ``cap * tanh(s / cap)`` before the mask.
    - ``window_size=(left, right)``: query ``i`` keeps keys ``i - left .. i + right`` (-1: no
      bound; a right bound of 0 is the causal mask), measured from the top-left diagonal as
      ``is_causal``: gpt-oss's and Mistral's sliding windows."""
    try:  # nested tensors take the varlen door (functional/nested.py)
        nested = query.is_nested or key.is_nested or value.is_nested or attn_mask is not None and attn_mask.is_nested
    except AttributeError:
        nested = False  # not tensors: refused below, naming them
    if nested:
        return nested_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    attn_mask, is_causal = causal_from_mask(attn_mask, is_causal, query, key)
    query, key, value, attn_mask = autocast_inputs(query, key, value, attn_mask)
    if sinks is not None or softcap is not None or tuple(window_size) != (-1, -1):
        return sdpa_with_score_terms(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, sinks,
                                     softcap, window_size)  # fmt: skip
    if not torch.compiler.is_compiling():
        out = sdpa_eager.run(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if out is not None:
            return out
    check_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    causal = causal_kind(is_causal)
    train = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, attn_mask)
    )  # fmt: skip
    why = torch_kernel.reason(query, key, float(dropout_p), causal, train, scale)
    if why is not None:
        return torch_kernel.run(why, query, key, value, attn_mask, dropout_p, causal, scale, enable_gqa)
    query, key, value, bias, scale, squeeze = batched(query, key, value, attn_mask, scale)
    seed = offset = None
    if dropout_p > 0:
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        offset = torch.zeros(1, dtype=torch.int64)
    try:
        out, _ = sdpa_forward(query, key, value, bias, scale, causal.value, float(dropout_p), seed, offset, train)
    except (ValidationError, UnsupportedError, ShapeMismatchError) as error:
        raise error.renamed(ARGUMENT_NAMES, context="sdpa") from None
    return out.squeeze(0) if squeeze else out


def _clear_graphs() -> None:
    """Drop the functional form's prepared runs (their plans stay in the plan cache)."""
    sdpa_eager.clear()
    score_terms.clear()
    prepared.clear()


__all__ = ["sdpa"]
