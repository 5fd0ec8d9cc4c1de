"""Hugging Face transformers: ``attn_implementation="cudnn_attn"``.

    import cudnn_attn.integrations.transformers as cudnn_hf
    cudnn_hf.register()  # once per process
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, attn_implementation="cudnn_attn")
    model.set_attn_implementation("cudnn_attn")  # or switch a model already loaded

``register`` puts two functions into transformers' registries under one name:
``attention_forward`` (``AttentionInterface``) runs each attention layer; ``token_mask``
(``AttentionMaskInterface``) prepares the mask once per forward for all layers. As in
transformers' FlashAttention path, padding stays a mask over tokens, never a dense bias:

- padding (left or right): the layers gather the real tokens into packed ``[T, H, D]`` rows,
  run ``cudnn_attn.varlen.varlen_attention`` and scatter its rows back (zeros at padding).
- decoding with a KV cache: the queries are the last of the real keys and causal masks are
  aligned bottom-right, so each sequence's last query sees its last key. Keys after the last
  query (a static cache's empty slots) are left out.
- padding-free packed batches: position ids restarting inside a row (found by transformers'
  mask code when there is no cache, or, as its FlashAttention path does, in the ``position_ids``
  of a one-row batch), or the ``cu_seq_lens_q/k`` and ``max_length_q/k`` keywords that
  ``DataCollatorWithFlattening`` passes: varlen, one sequence per packed run, causal per sequence.
- no padding: ``cudnn_attn.sdpa`` (``is_causal``; ``window_size`` for a sliding window) when
  queries and keys have one length (or one query), varlen with uniform lengths otherwise
  (bottom-right causal, windows while decoding).
- sliding windows: the layer's ``sliding_window`` (a window of that many tokens, the query's
  own included) becomes ``window_left = sliding_window - 1``, as transformers' FlashAttention
  path passes ``window_size=(sliding_window - 1, ...)``. Windows count real tokens, which is
  transformers' positional window whenever the real tokens are contiguous (left or right padding).
- anything else (custom mask functions, chunked attention, a 4-D mask passed in): ``token_mask``
  builds transformers' dense boolean mask and the layers run ``cudnn_attn.sdpa`` with it.
- what varlen does not take (soft-capping while decoding or over a static cache, dropout beside
  sinks or soft-capping, float64): one ``cudnn_attn.sdpa`` call, the token mask or the packed
  runs becoming a dense boolean mask in the layer (causal over the real keys, per sequence).

``token_mask`` returns ``None`` (nothing beyond ``is_causal``), a ``[B, M]`` tensor of
per-token sequence ids (bool for padding; integers for packed runs; 0 = padding, consecutive
tokens of a row with one id form one sequence) or a dense ``[B, 1, Q, K]`` mask.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import UnsupportedError, ValidationError
from ..functional import sdpa
from ..functional.arguments import TORCH_FLOATING, autocast_inputs
from ..varlen import varlen_attention
from .transformers_packing import CONTEXT, Packing, find_packing, packed_mask

try:
    from transformers import AttentionInterface, masking_utils
    from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask
except ImportError as error:  # the optional dependency
    raise ImportError(
        "cudnn_attn.integrations.transformers needs Hugging Face transformers>=4.56: "
        "pip install 'cudnn-attn[transformers]'"
    ) from error

NAME = "cudnn_attn"
_log = logging.getLogger("cudnn_attn.transformers")
_BIDIRECTIONAL = getattr(masking_utils, "bidirectional_mask_function", None)  # absent from transformers 4.56
_ALTERNATIVES = ["attn_implementation='sdpa' (or 'eager') for this model"]


def register(name: str = NAME) -> str:
    """Make ``attn_implementation=name`` run cudnn_attn in every transformers model.

    Registers ``attention_forward`` with transformers' ``AttentionInterface`` and ``token_mask``
    with its ``AttentionMaskInterface``, under one name; idempotent. Call it once per process,
    before ``from_pretrained(..., attn_implementation=name)`` or
    ``model.set_attn_implementation(name)``; an unregistered name is refused by transformers.

    Args:
        name: the implementation's name.

    Returns:
        ``name``.

    Example:
        ```python
        import cudnn_attn.integrations.transformers as cudnn_hf

        name = cudnn_hf.register()  # "cudnn_attn"
        # model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation=name)
        ```
    """
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, token_mask)
    return name


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One attention layer as transformers calls it (registered by ``register``).

    Padding becomes packed varlen rows, decoding aligns causal masks bottom-right, padding-free
    packed batches run one sequence per packed run, and anything else runs ``cudnn_attn.sdpa``
    with transformers' dense mask (see the module's description).

    Args:
        module: the attention layer (its ``is_causal`` is read).
        query: ``[B, H, Q, D]``.
        key: ``[B, H_kv, K, D]``, the cache already updated.
        value: ``[B, H_kv, K, D_v]``.
        attention_mask: what ``token_mask`` returned (None, ``[B, M]`` token ids) or a dense
            ``[B, 1, Q, K]`` mask.
        dropout: attention dropout probability.
        scaling: softmax scale; ``1 / sqrt(D)`` when None.
        sliding_window: a window of this many tokens, the query's own included.
        softcap: logit soft-capping.
        is_causal: overrides ``module.is_causal``.
        **kwargs: transformers' other keywords (``position_ids``, ``cu_seq_lens_q``, ``s_aux``
            sinks, ...).

    Returns:
        ``(output [B, Q, H, D_v], None)``: no attention weights.

    Raises:
        UnsupportedError: what this path cannot run (e.g. a sliding window without a causal
            mask), with ``attn_implementation='sdpa'`` as the alternative.

    Example:
        ```python
        import torch

        from cudnn_attn.integrations.transformers import attention_forward

        layer = torch.nn.Module()
        layer.is_causal = True
        q, k, v = (torch.randn(1, 4, 16, 64, dtype=torch.bfloat16) for _ in range(3))
        out, weights = attention_forward(layer, q, k, v, attention_mask=None)
        assert out.shape == (1, 16, 4, 64) and weights is None
        ```
    """
    query, key, value, _ = autocast_inputs(query, key, value, None)  # as torch's SDPA does
    _refuse_unsupported(query, attention_mask, softcap, kwargs)
    if kwargs.get("output_attentions"):
        warnings.warn("cudnn_attn returns no attention weights (output_attentions=True)", stacklevel=2)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    options: dict[str, Any] = dict(scale=scaling, dropout_p=float(dropout), enable_gqa=key.shape[1] != query.shape[1])
    if kwargs.get("s_aux") is not None:  # gpt-oss's learned sinks, one logit per head
        options["sinks"] = kwargs["s_aux"]
    if softcap is not None:  # Gemma-2's logit soft-capping
        options["softcap"] = softcap
    if attention_mask is not None and attention_mask.dim() == 4:  # dense: transformers' own, or the caller's
        out = sdpa(query, key, value, attn_mask=attention_mask, **options)
        return out.transpose(1, 2).contiguous(), None
    window = _window(sliding_window, key.shape[2])
    if window is not None and not causal:
        raise UnsupportedError(
            [f"sliding_window: {sliding_window} without a causal mask; cuDNN's band takes a left bound only"],
            context=CONTEXT,
            alternatives=_ALTERNATIVES,
        )
    packing = None
    if softcap is None or query.shape[2] == key.shape[2]:
        packing = find_packing(attention_mask, kwargs, query.shape[0], query.shape[2], key.shape[2], causal)
    elif attention_mask is None and kwargs.get("cu_seq_lens_q") is not None:
        # Caller-packed sequences decoding from a cache (continuous batching): soft-capping runs
        # densely (the packed path takes it top-left only), one mask over the packed row.
        packing = find_packing(None, kwargs, query.shape[0], query.shape[2], key.shape[2], causal)
        assert packing is not None
        return _packed_dense(query, key, value, packing, causal, window, options), None
    dense = not _varlen_runs(query, options)
    if packing is not None and dense and attention_mask is None:  # cu_seq_lens or restarting position ids
        return _packed_dense(query, key, value, packing, causal, window, options), None
    if dense or (softcap is not None and packing is None):
        return _dense_terms(query, key, value, attention_mask, causal, window, options), None
    if packing is None:
        return _unpadded(query, key, value, causal, window, options), None
    return _packed(query, key, value, packing, causal, window, options), None


def token_mask(
    batch_size: int,
    kv_length: int,
    kv_offset: int = 0,
    mask_function: Callable = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """transformers' mask hook for this implementation, called once per forward and mask kind.

    Args:
        batch_size: the batch size.
        kv_length: the key length (cache included).
        kv_offset: the first key's position.
        mask_function: transformers' mask function (causal, sliding, packed, custom).
        attention_mask: the ``[B, K]`` padding mask, or None.
        **kwargs: transformers' other keywords (``cache_position``, ...).

    Returns:
        None (nothing beyond ``is_causal``), per-token sequence ids ``[B, M]`` (bool for
        padding; integers for packed runs, 0 = padding) or a dense ``[B, 1, Q, K]`` mask.

    Example:
        ```python
        import torch

        from cudnn_attn.integrations.transformers import token_mask

        padding = torch.tensor([[1, 1, 1, 0]])
        ids = token_mask(1, 4, attention_mask=padding, cache_position=torch.arange(4))
        ```
    """
    q_length, q_offset = _queries(kwargs)
    pattern = _pattern(mask_function)
    live = kv_length  # keys a causal query may see: none after the last query
    if pattern is not None and pattern.causal:
        live = min(kv_length, int(q_offset) + q_length - kv_offset)
    if pattern is None or (pattern.causal and live < q_length):
        return _dense_mask(batch_size, kv_length, kv_offset, mask_function, attention_mask, kwargs)
    if pattern.packed is not None:
        if attention_mask is not None or tuple(pattern.packed.shape) != (batch_size, kv_length):
            return _dense_mask(batch_size, kv_length, kv_offset, mask_function, attention_mask, kwargs)
        return pattern.packed + 1  # transformers numbers packed runs from 0; 0 means padding here
    if attention_mask is None:
        return None if live == kv_length else torch.ones(batch_size, live, dtype=torch.bool, device=_device(kwargs))
    end = kv_offset + live
    if attention_mask.shape[-1] < end:  # a short mask: the tokens after it are padding
        attention_mask = F.pad(attention_mask, (0, end - attention_mask.shape[-1]))
    tokens = attention_mask[:, kv_offset:end].to(torch.bool)
    return None if live == kv_length and bool(tokens.all()) else tokens


# --- the layer's side -------------------------------------------------------------------------


def _window(sliding_window: int | None, key_length: int) -> int | None:
    """transformers' FlashAttention convention: a window of ``sliding_window`` tokens, the
    query's own included, applied when the keys are longer than that."""
    if sliding_window is None or key_length <= sliding_window:
        return None
    return int(sliding_window) - 1


def _varlen_runs(query: torch.Tensor, options: dict) -> bool:
    """Whether the packed (varlen) door runs this layer: it takes no dropout beside sinks or
    soft-capping, and no float64 on a GPU (cuDNN has no double-precision path), where ``sdpa``
    runs float64 on torch's kernel. The others take one dense call with a boolean mask; float64
    does on every device, so the CPU runs the path a GPU runs."""
    if options["dropout_p"] and (options.get("sinks") is not None or options.get("softcap") is not None):
        return False
    return query.dtype != torch.float64


def _dense_window(causal: bool, window: int | None, q_len: int, k_len: int) -> bool:
    """Whether a windowed layer can run as one dense call with ``window_size``: a whole causal
    sequence (its windows measure from the top-left diagonal)."""
    return window is not None and causal and q_len == k_len


def _unpadded(query, key, value, causal: bool, window: int | None, options: dict) -> torch.Tensor:
    q_len, k_len = query.shape[2], key.shape[2]
    if window is None and (not causal or q_len in (1, k_len)):
        out = sdpa(query, key, value, is_causal=causal and q_len > 1, **options)
        return out.transpose(1, 2).contiguous()
    # With dropout a window stays on the packed path, where the transformers GPU tests measured it.
    if window is not None and _dense_window(causal, window, q_len, k_len) and not options["dropout_p"]:
        out = sdpa(query, key, value, is_causal=True, window_size=(window, 0), **options)
        return out.transpose(1, 2).contiguous()
    batch, device = query.shape[0], query.device
    steps = torch.arange(batch + 1, dtype=torch.int32, device=device)
    uniform = Packing(steps * q_len, steps * k_len, q_len, k_len, k_len, aligned=q_len == k_len)
    return _packed(query, key, value, uniform, causal, window, options)


def _dense_terms(
    query, key, value, tokens: torch.Tensor | None, causal: bool, window: int | None, options: dict
) -> torch.Tensor:
    """Layers the packed path cannot take, as one ``cudnn_attn.sdpa`` call: soft-capping (Gemma-2;
    the packed path takes it only top-left, not while decoding with a cache, where each
    sequence's diagonal sits elsewhere), dropout beside sinks or soft-capping, float64. Padding,
    packed runs and windows become a dense boolean ``[B, 1, Q, K]`` mask. ``tokens`` (what
    ``token_mask`` returned, or None) covers the keys up to the last query; keys after them (a
    static cache's empty slots) are left out, so the queries are the last of the remaining keys."""
    batch, _, q_len, _ = query.shape
    if tokens is not None:  # as find_packing checks a token mask
        if tokens.shape[1] > key.shape[2] or (causal and tokens.shape[1] < q_len):
            reason = f"covers {tokens.shape[1]} keys; the layer has {key.shape[2]} keys and {q_len} queries"
            raise ValidationError([f"attention_mask: {reason}"], context=CONTEXT)
        key, value = key[:, :, : tokens.shape[1]], value[:, :, : tokens.shape[1]]
    k_len = key.shape[2]
    if tokens is None and window is None and (not causal or q_len in (1, k_len)):
        return sdpa(query, key, value, is_causal=causal and q_len > 1, **options).transpose(1, 2).contiguous()
    if tokens is None and window is not None and _dense_window(causal, window, q_len, k_len):
        out = sdpa(query, key, value, is_causal=True, window_size=(window, 0), **options)
        return out.transpose(1, 2).contiguous()
    _log.debug(
        "padding, packed runs or a window beside what varlen lacks: a dense [B, 1, Q, K] mask (%d x %d)", q_len, k_len
    )
    device = query.device
    col = torch.arange(k_len, device=device)
    row = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        allowed &= col <= row
    if window is not None:  # window = sliding_window - 1: keys within sliding_window of the query, its own included
        allowed &= col > row - (window + 1)
    allowed = allowed.expand(batch, 1, q_len, k_len)
    if tokens is not None:
        ids = tokens.to(torch.int64)
        allowed = allowed & (ids != 0)[:, None, None, :]
        if causal:  # the queries are the last keys: each sees its own sequence's (cross-attention's see every real key)
            allowed = allowed & (ids[:, k_len - q_len :, None] == ids[:, None, :])[:, None]
    allowed = allowed | ~allowed.any(-1, keepdim=True)  # padding queries: any finite row (their output is unused)
    return sdpa(query, key, value, attn_mask=allowed, **options).transpose(1, 2).contiguous()


def _packed_dense(query, key, value, packing: Packing, causal: bool, window: int | None, options: dict) -> torch.Tensor:
    """Caller-packed sequences (``cu_seq_lens_*`` keywords, restarting position ids) the packed
    path cannot take: one dense boolean mask over the packed row, each sequence by itself, causal
    aligned bottom-right. A batch of several rows is read as one, as ``_packed`` reads it (the
    keywords count tokens over the flattened batch)."""
    batch, heads, q_len, _ = query.shape
    k_len = key.shape[2]
    if batch > 1:
        query, key, value = (x.transpose(0, 1).reshape(1, x.shape[1], -1, x.shape[3]) for x in (query, key, value))
    mask = packed_mask(packing, batch * q_len, batch * k_len, causal, window)
    out = sdpa(query, key, value, attn_mask=mask, **options)  # [1, H, B * Q, D_v]
    return out.transpose(1, 2).reshape(batch, q_len, heads, out.shape[-1])


def _packed(query, key, value, packing: Packing, causal: bool, window: int | None, options: dict) -> torch.Tensor:
    """Gather the real tokens, attend per sequence, scatter back to ``[B, Q, H, D_v]``."""
    batch, heads, q_len, _ = query.shape
    key, value = key[:, :, : packing.keys], value[:, :, : packing.keys]
    q = _gather(query, packing.rows_q)
    k, v = _gather(key, packing.rows_k), _gather(value, packing.rows_k)
    if q.shape[0] == 0 or k.shape[0] == 0:  # nothing but padding: varlen takes no empty batch
        return query.new_zeros(batch, q_len, heads, value.shape[-1])
    alignment = _alignment(packing, options) if causal else None
    # Top-left only where every sequence's lengths agree: one tensor for both then tells varlen so.
    cu_k = packing.cu_q if alignment == "top_left" else packing.cu_k
    out = varlen_attention(
        q,
        k,
        v,
        packing.cu_q,
        cu_k,
        packing.max_q,
        packing.max_k,
        causal=alignment,
        window_left=window,
        context=CONTEXT,
        **options,
    )
    if packing.rows_q is None:
        return out.view(batch, q_len, heads, out.shape[-1])
    return out.new_zeros(batch, q_len, heads, out.shape[-1]).index_put(packing.rows_q, out)


def _alignment(packing: Packing, options: dict) -> str:
    """Bottom-right: each sequence's last query sees its last key (decoding with a cache). cuDNN's
    dropout, and a soft-capping modifier in a packed batch, take top-left causal only, the same mask
    where every sequence's lengths agree (training)."""
    if options["dropout_p"] > 0 or options.get("softcap") is not None:
        aligned = packing.aligned
        if aligned is None:
            aligned = packing.cu_q.shape == packing.cu_k.shape and bool(torch.equal(packing.cu_q, packing.cu_k))
        if aligned:
            return "top_left"
    return "bottom_right"


def _gather(x: torch.Tensor, rows: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
    """``[B, H, S, D]`` to packed ``[T, H, D]``: the tokens at ``rows`` (all, in order, when None)."""
    if rows is None:
        return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])
    return x[rows[0], :, rows[1]]


def _refuse_unsupported(query: torch.Tensor, mask: Any, softcap: float | None, kwargs: dict) -> None:
    reasons = []
    if query.dtype not in TORCH_FLOATING:
        reasons.append(
            f"query: dtype {str(query.dtype).removeprefix('torch.')}; cudnn_attn attends in float16, "
            "bfloat16, float32 or float64 (load the model with dtype=torch.bfloat16)"
        )
    if kwargs.get("position_bias") is not None:
        reasons.append("position_bias: a per-layer position bias is not supported")
    if kwargs.get("cache") is not None:
        reasons.append("cache: paged KV caches (continuous batching) are not supported")
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() in (2, 4)):
        shape = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        reasons.append(f"attention_mask: {shape}; expected None, a [B, keys] token mask or a [B, 1, Q, K] dense mask")
    if query.device.type == "cpu" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        # transformers' continuous batching captures CUDA graphs for a FlashAttention name whenever
        # the host has a GPU, the model's device aside; a replay would run none of this CPU work
        reasons.append(
            "query: on the CPU while a CUDA graph is being captured (its replays would skip the CPU's work); "
            "pass ContinuousBatchingConfig(use_cuda_graph=False) for a model on the CPU, or move it to the GPU"
        )
    if reasons:
        raise UnsupportedError(reasons, context=CONTEXT, alternatives=_ALTERNATIVES)


# --- the mask's side --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Pattern:
    """A mask function transformers built that lengths can express: causal or bidirectional,
    perhaps windowed, perhaps over packed runs (``packed``: each token's run, ``[B, S]``)."""

    causal: bool
    packed: torch.Tensor | None = None


def _pattern(mask_function: Callable) -> _Pattern | None:
    """What ``mask_function`` is, read from the functions transformers composes it of; None for
    anything else (it then becomes a dense mask, so an unknown pattern is slow, never wrong)."""
    kinds, windows, packed = [], 0, []
    for term in _and_terms(mask_function):
        if term is causal_mask_function or (_BIDIRECTIONAL is not None and term is _BIDIRECTIONAL):
            kinds.append(term is causal_mask_function)
        elif _made_by(term, "sliding_window_overlay"):  # the layer passes the same window to attention_forward
            windows += 1
        elif _made_by(term, "packed_sequence_mask_function"):
            packed.append(_closure(term).get("packed_sequence_mask"))
        else:
            return None
    if len(kinds) != 1 or windows > 1 or (windows and not kinds[0]) or len(packed) > 1:
        return None
    if packed and not isinstance(packed[0], torch.Tensor):
        return None
    return _Pattern(causal=kinds[0], packed=packed[0] if packed else None)


def _and_terms(fn: Callable) -> list[Callable]:
    """The masks ``fn`` intersects: transformers nests ``and_masks``, and wraps a packed batch's
    pattern in a position remap (the same pattern within each run)."""
    if _made_by(fn, "and_masks"):
        parts = _closure(fn).get("mask_functions")
        if isinstance(parts, tuple) and all(callable(part) for part in parts):
            return [term for part in parts for term in _and_terms(part)]
    elif _made_by(fn, "remap_positions_for_packed_sequence"):
        inner = _closure(fn).get("mask_function")
        if callable(inner):
            return _and_terms(inner)
    return [fn]


def _made_by(fn: Callable, factory: str) -> bool:
    return getattr(fn, "__module__", None) == masking_utils.__name__ and getattr(fn, "__qualname__", "").startswith(
        f"{factory}.<locals>."
    )


def _closure(fn: Callable) -> dict[str, Any]:
    try:
        return dict(inspect.getclosurevars(fn).nonlocals)
    except (TypeError, ValueError):
        return {}


def _queries(kwargs: dict) -> tuple[int, Any]:
    """The queries' count and first position: transformers 5 passes them, 4.x passes cache_position."""
    if "q_length" in kwargs:
        return int(kwargs["q_length"]), kwargs.get("q_offset", 0)
    cache_position = kwargs.get("cache_position")
    if cache_position is None:
        raise UnsupportedError(
            ["mask arguments: neither q_length nor cache_position; unknown transformers version"], context=CONTEXT
        )
    return int(cache_position.shape[0]), cache_position[0]


def _device(kwargs: dict) -> Any:
    if kwargs.get("device") is not None:
        return kwargs["device"]
    cache_position = kwargs.get("cache_position")
    return cache_position.device if cache_position is not None else "cpu"


def _dense_mask(batch_size, kv_length, kv_offset, mask_function, attention_mask, kwargs: dict) -> torch.Tensor | None:
    """transformers' own dense boolean mask (what its SDPA path gets), never skipped."""
    return sdpa_mask(
        batch_size=batch_size,
        kv_length=kv_length,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        **{**kwargs, "allow_is_causal_skip": False, "allow_is_bidirectional_skip": False},
    )
