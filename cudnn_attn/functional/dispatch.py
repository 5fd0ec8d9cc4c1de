"""``cudnn_attn.sdpa``: a drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

Same signature and semantics, differentiable, backed by cached graphs (cuDNN on CUDA
tensors, the reference backend on CPU tensors; plain CPU calls run on torch's own kernel)::

    out = cudnn_attn.sdpa(q, k, v, is_causal=True)
    # == torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

``attn_mask`` may be boolean (True = takes part), additive (broadcastable to ``[B, H, L, S]``)
or one of torch's ``CausalBias`` objects (``causal_upper_left``/``causal_lower_right``: cuDNN's
top-left and bottom-right causal masks). Inputs are fp16/bf16/fp32 ``[B, H, L, E]`` (or
``[H, L, E]``); under ``torch.autocast`` they are cast to its dtype first, as torch does.
What cuDNN lacks or serves worse (float64; float32 on a GPU; a scale <= 0 on a GPU; bottom-right
causal with dropout or L > S) runs on torch's own kernel (``ops/dispatch.py`` chooses,
``ops/torch/reasons.py`` says when; the log says which ran). Dropout draws a
fresh seed from torch's default generator on each call, so ``torch.manual_seed`` makes it
repeatable; the backward reuses the forward's mask.

Eager calls take ``functional/eager.py``'s path (a flat key to a prepared run); under
``torch.compile`` the call is one opaque custom op (``functional/compiled.py``).
"""

from __future__ import annotations

import torch

from ..core.mask import unbounded_window
from ..errors import ShapeMismatchError, UnsupportedError, ValidationError
from ..ops.dispatch import select_call
from ..ops.torch.call import Call
from ..runtime import backend_choice, prepared
from . import eager as sdpa_eager
from . import score_terms
from .arguments import (
    ARGUMENT_NAMES,
    autocast_inputs,
    batched,
    broadcast,
    broadcast_shapes,
    causal_from_mask,
    causal_kind,
    check_arguments,
    probability,
)
from .compiled import sdpa_forward
from .nested import nested_sdpa
from .problems import check_as_graph
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

    A drop-in for ``torch.nn.functional.scaled_dot_product_attention``: the same arguments,
    defaults, dtypes and results, differentiable; under ``torch.compile`` one opaque op. CUDA
    tensors run on cuDNN, CPU tensors on the reference backend (a plain CPU call, without
    ``sinks``/``softcap``/``window_size``, on torch's own kernel: the same result, 5-35x
    faster; inside ``cudnn_attn.backend("reference")`` on the reference backend); the first call of a signature
    (shapes, strides, dtypes, flags) builds or loads a plan, later calls reuse it. What cuDNN
    lacks or serves worse runs on torch's own kernel, and the log (``CUDNN_ATTN_LOG_LEVEL=info``)
    says so: float64; float32 on a GPU; a scale <= 0 on a GPU; a bottom-right ``CausalBias``
    with dropout or with L > S (inside ``cudnn_attn.backend("cudnn")`` such a call raises
    ``UnsupportedError`` instead). Under ``torch.autocast`` the inputs are cast to its dtype first,
    as torch does. Jagged nested tensors (``torch.nested``, ``layout=torch.jagged``,
    ``[B, H, (S), E]``) are taken too, with ``sinks``, ``softcap`` and ``window_size`` per sequence.

    Equivalent plain torch (``sinks``, ``softcap`` and ``window_size`` aside, torch's own
    reference implementation; the kernels never form the ``[L, S]`` scores):

    ```python
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False, sinks=None, softcap=None, window_size=(-1, -1)):
        L, S = query.size(-2), key.size(-2)
        scale = 1 / math.sqrt(query.size(-1)) if scale is None else scale
        if enable_gqa:
            key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
            value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
        scores = query @ key.transpose(-2, -1) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
        left, right = window_size
        keep = torch.ones(L, S, dtype=torch.bool)
        if is_causal:
            keep &= j <= i
        if left >= 0:
            keep &= j >= i - left
        if right >= 0:
            keep &= j <= i + right
        scores = scores.masked_fill(~keep, float("-inf"))
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        elif attn_mask is not None:
            scores = scores + attn_mask
        if sinks is not None:  # one more logit per head in each row's denominator
            sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(*scores.shape[:-1], 1)
            weights = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
        else:
            weights = torch.softmax(scores, -1)
        weights = torch.dropout(weights, dropout_p, train=True)
        return weights @ value
    ```

    Args:
        query: ``[B, H_q, L, E]``, or ``[H_q, L, E]`` unbatched; float16, bfloat16, float32 or
            float64; any strides.
        key: ``[B, H_kv, S, E]``, query's dtype and device. ``H_kv == H_q`` unless ``enable_gqa``.
        value: ``[B, H_kv, S, E_v]``, query's dtype and device.
        attn_mask: None; a bool mask (True takes part) or an additive float mask, broadcastable
            to ``[B, H_q, L, S]``; or torch's ``causal_upper_left(L, S)`` /
            ``causal_lower_right(L, S)`` (cuDNN's top-left and bottom-right causal masks, no
            memory read). With ``is_causal`` too, both apply (as torch 2.13's CPU and flash
            kernels apply them; its documentation and math kernel refuse the pair).
        dropout_p: probability of dropping an attention weight, ``0 <= p <= 1``. Applied whenever
            it is > 0 (pass 0.0 at inference, as with torch); the seed is drawn from torch's
            default generator (``torch.manual_seed`` repeats it), the backward reuses the mask.
        is_causal: top-left causal mask: query ``i`` sees keys ``j <= i``.
        scale: factor on ``query @ key^T``; None is ``1 / sqrt(E)``.
        enable_gqa: let ``H_kv`` divide ``H_q`` (grouped-query / multi-query attention).
        sinks: attention sinks (gpt-oss): a real ``[H_q]`` (or ``[1, H_q, 1, 1]``) tensor of one
            logit per query head, in every softmax denominator, weighing no value; learnable.
        softcap: logit soft-capping (Gemma-2): scores become ``softcap * tanh(s / softcap)``
            before the masks.
        window_size: FlashAttention's ``(left, right)`` band: query ``i`` keeps keys
            ``i - left .. i + right`` (-1: no bound; ``(w, 0)`` is a causal sliding window),
            measured from the top-left diagonal as ``is_causal``.

    Returns:
        The attention output, ``[B, H_q, L, E_v]``, in query's dtype and on its device; other
        ranks as torch takes them: ``[H_q, L, E_v]`` unbatched, ``[L, E_v]`` for ``[L, E]`` inputs,
        ``[N, ..., H_q, L, E_v]`` for more batch dims.

    Raises:
        ValidationError: the call is malformed, one line per problem in torch's argument names:
            dtypes or devices that differ, fewer than 2 dimensions, head counts without
            ``enable_gqa``, batch dims that differ, a mask that does not broadcast, ``dropout_p``
            outside ``[0, 1)``, a tensor subclass whose storage is not its values.
        UnsupportedError: well formed, but this GPU or cuDNN version cannot run it (for example
            a head dim over 256, or a feature that needs a newer cuDNN); the reasons, and what
            would work, are listed.

    Example:
        ```python
        import torch
        import torch.nn.functional as F

        import cudnn_attn

        q = torch.randn(2, 8, 128, 64)  # [B, H, L, E]; CPU: torch's kernel runs it
        k, v = torch.randn(2, 2, 128, 64), torch.randn(2, 2, 128, 64)  # 2 K/V heads: GQA
        out = cudnn_attn.sdpa(q, k, v, is_causal=True, enable_gqa=True)
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert out.shape == (2, 8, 128, 64) and torch.allclose(out, expected, atol=1e-5)
        ```
    """
    dropout_p = probability(dropout_p)
    try:  # nested tensors take the varlen door (functional/nested.py)
        nested = query.is_nested or key.is_nested or value.is_nested or attn_mask is not None and attn_mask.is_nested
    except AttributeError:
        nested = False  # not tensors: refused below, naming them
    if nested:  # each sequence gets the dense call's sinks, softcap and window
        return nested_sdpa(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, sinks, softcap, window_size
        )
    attn_mask, is_causal = causal_from_mask(attn_mask, is_causal, query, key)
    query, key, value, attn_mask = autocast_inputs(query, key, value, attn_mask)
    if sinks is not None or softcap is not None or _windowed(window_size):
        shapes = broadcast_shapes(query, key, value, enable_gqa)  # size-1 dims torch broadcasts
        if shapes is not None:
            query, key, value = broadcast((query, key, value), shapes)
        return sdpa_with_score_terms(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, sinks, softcap, window_size
        )
    compiling = torch.compiler.is_compiling()
    if not compiling:
        out = sdpa_eager.run(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if out is not None:
            return out
    shapes = broadcast_shapes(query, key, value, enable_gqa)  # size-1 dims torch broadcasts
    if shapes is not None:
        query, key, value = broadcast((query, key, value), shapes)
    if not compiling:
        check_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        # Another rank ([L, E], [H, L, E], [N, ..., H, L, E]) or scalars of other types: the same
        # door on the call's 4-D views, not the compile op (whose dispatch costs host time).
        out = _eager_on_4d(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if out is not None:
            return out
    check_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    causal = causal_kind(is_causal)
    train = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, attn_mask))
    call = Call(query, key, value, attn_mask, float(dropout_p), causal, scale, enable_gqa, train)
    requested = "auto" if compiling else backend_choice.chosen()
    choice = select_call(call, requested, torch_op=False)  # the compile op has its own autograd
    if choice.as_graph and not compiling:
        # Not while tracing: Dynamo cannot trace the problem's layout checks over dynamic shapes
        # (fullgraph=True failed), and torch's kernel runs what it is given.
        check_as_graph(query, key, value, attn_mask, dropout_p, causal, scale, train)
    if choice.run is not None:
        return choice.run(query, key, value, attn_mask)
    query, key, value, bias, scale, restore = batched(query, key, value, attn_mask, scale)
    seed = offset = None
    if dropout_p > 0:
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        offset = torch.zeros(1, dtype=torch.int64)
    try:
        out, _ = sdpa_forward(query, key, value, bias, scale, causal.value, float(dropout_p), seed, offset, train)
    except (ValidationError, UnsupportedError, ShapeMismatchError) as error:
        raise error.renamed(ARGUMENT_NAMES, context="sdpa") from None
    return restore(out)


def _eager_on_4d(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> torch.Tensor | None:
    """A checked call through the eager door on ``[B, H, L, E]`` views, in the caller's rank;
    None where that door does not take it (tensor subclasses). A mask keeps its own form (bool
    or float) unless the caller's batch dims had to be flattened into it."""
    views = batched(query, key, value, attn_mask, scale)
    q, k, v, bias, resolved, restore = views
    mask = bias if attn_mask is not None and query.dim() > 4 and attn_mask.dim() > 3 else attn_mask
    out = sdpa_eager.run(q, k, v, mask, float(dropout_p), causal_kind(is_causal), resolved, bool(enable_gqa))
    return None if out is None else restore(out)


def _windowed(window_size: object) -> bool:
    """Whether ``window_size`` asks for a band: anything but None or two negative bounds
    (``(-1, -1)``; a malformed value is refused by name on the score-terms path)."""
    return window_size is not None and not unbounded_window(window_size)


def _clear_graphs() -> None:
    """Drop the functional form's prepared runs (their plans stay in the plan cache)."""
    sdpa_eager.clear()
    score_terms.clear()
    prepared.clear()


__all__ = ["sdpa"]
