"""FlashAttention's ``flash_attn_varlen_func`` keywords beside torch's: one call's options, resolved.

``varlen_sdpa`` takes both spellings, so code written for either runs unchanged:

====================  ==================  ==================================================
FlashAttention        torch / this library  meaning here
====================  ==================  ==================================================
``causal``            ``is_causal``       causal mask; FlashAttention's is aligned bottom-right
                                          per sequence, torch's top-left (the same mask
                                          wherever a sequence has as many queries as keys)
``window_size``       ``window_size``     FlashAttention's band, measured from the bottom-right
                                          diagonal whether or not the call is causal (from
                                          the top-left one beside torch's ``is_causal``)
``softmax_scale``     ``scale``           the scores' scale; None: ``1 / sqrt(D)``
``softcap=0.0``       ``softcap=None``    no soft-capping (FlashAttention's 0.0 means off)
``return_attn_probs``  ``return_lse``     also return the log-sum-exp ``[H, T_q]`` float32
====================  ==================  ==================================================

A name and its alias given with different values is a ``ValidationError`` naming both. What
cuDNN's attention cannot take (arbitrary ALiBi slopes, a paged ``block_table``) is an
``UnsupportedError`` that says why and what would work.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Real
from typing import Any

import torch

from ..errors import UnsupportedError, ValidationError, shown
from .finite import finite_real
from .mask import window_bounds

CONTEXT = "varlen_sdpa"


@dataclass(frozen=True)
class VarlenCall:
    """A ``varlen_sdpa`` call's options with every alias resolved.

    ``causal``: None, ``"top_left"`` or ``"bottom_right"``; ``window_left``: the left bound of a
    sliding window (None: none); ``window_right``: a right bound >= 1 without a causal mask
    (None: none); ``window_bottom_right``: without a causal mask, the bounds measure from each
    sequence's bottom-right diagonal; ``returns``: 1 (the output), 2 (``(out, lse)``) or 3
    (``(out, lse, None)``, FlashAttention's ``return_attn_probs`` form)."""

    causal: str | None
    window_left: int | None
    window_right: int | None
    window_bottom_right: bool
    scale: float | None
    softcap: float | None
    deterministic: bool
    returns: int


def resolve(
    *,
    causal: Any,
    is_causal: Any,
    softmax_scale: Any,
    scale: Any,
    window_size: Any,
    softcap: Any,
    alibi_slopes: Any,
    deterministic: Any,
    return_attn_probs: Any,
    return_lse: Any,
    block_table: Any,
    same_lengths: bool,
) -> VarlenCall:
    """Both spellings' keywords as one ``VarlenCall``. ``same_lengths``: every sequence is known
    to have as many queries as keys (then a bottom-right mask is the top-left one, which every
    feature takes). Raises ``ValidationError`` (every problem, one line each) or ``UnsupportedError``."""
    problems: list[str] = []
    flags = {
        name: _flag(value, name, problems)
        for name, value in (
            ("causal", causal),
            ("is_causal", is_causal),
            ("deterministic", deterministic),
            ("return_attn_probs", return_attn_probs),
            ("return_lse", return_lse),
        )
    }
    if causal is not None and is_causal is not None and (flags["causal"] or flags["is_causal"]):
        problems.append(
            f"causal: {causal!r} with is_causal: {is_causal!r}; give one: causal (FlashAttention's) aligns the "
            "mask bottom-right per sequence, is_causal (torch's) top-left"
        )
    bad_scales = [
        f"{name}: {shown(value)}; expected a finite float or None"
        for name, value in (("softmax_scale", softmax_scale), ("scale", scale))
        if value is not None and not finite_real(value)
    ]
    problems += bad_scales
    if not bad_scales and softmax_scale is not None and scale is not None and softmax_scale != scale:
        problems.append(f"softmax_scale: {softmax_scale!r} with scale: {scale!r}; give one (they are one argument)")
    left, right = _window(window_size, problems)
    if problems:
        raise ValidationError(problems, context=CONTEXT)
    reasons = []
    if alibi_slopes is not None:
        reasons.append(
            "alibi_slopes: cuDNN's ALiBi takes no slopes tensor (it uses the standard slopes 2^(-8(h+1)/H), with a "
            "top-left causal mask only); Graph.sdpa(use_alibi_mask=True) runs that form"
        )
    if block_table is not None:
        reasons.append("block_table: paged K/V caches are PagedAttention's (plan once per step, run per layer)")
    if reasons:
        raise UnsupportedError(reasons, context=CONTEXT)
    masked = flags["causal"] or flags["is_causal"] or right == 0
    if masked:  # as FlashAttention: causal is a right bound of 0, whatever the window's right bound
        right = 0
    # FlashAttention measures the window (and its causal mask) from each sequence's bottom-right
    # diagonal, causal or not; torch's is_causal is top-left. Where every sequence has as many
    # queries as keys the two are one mask, and top-left is the one every feature takes.
    aligned = "top_left" if same_lengths or flags["is_causal"] else "bottom_right"
    returns = 3 if flags["return_attn_probs"] else 2 if flags["return_lse"] else 1
    return VarlenCall(
        causal=aligned if masked else None,
        window_left=None if left < 0 else left,
        window_right=right if right > 0 else None,
        window_bottom_right=aligned == "bottom_right" and not masked and (left >= 0 or right > 0),
        scale=softmax_scale if softmax_scale is not None else scale,
        # FlashAttention's 0.0 is "off", whatever number type holds it (NumPy's included).
        softcap=None
        if softcap is None or (isinstance(softcap, Real) and not isinstance(softcap, bool) and softcap == 0)
        else softcap,
        deterministic=flags["deterministic"],
        returns=returns,
    )


def same_lengths(cu_seqlens_q: Any, cu_seqlens_k: Any) -> bool:
    """Whether every sequence has as many queries as keys, known without a host sync: the same
    tensor for both, or equal CPU tensors."""
    if cu_seqlens_q is cu_seqlens_k:
        return True
    if not (isinstance(cu_seqlens_q, torch.Tensor) and isinstance(cu_seqlens_k, torch.Tensor)):
        return False
    on_cpu = cu_seqlens_q.device.type == cu_seqlens_k.device.type == "cpu"
    if not on_cpu or cu_seqlens_q.shape != cu_seqlens_k.shape:
        return False
    return bool(torch.equal(cu_seqlens_q.long(), cu_seqlens_k.long()))  # int32 and int64 alike


def _flag(value: Any, name: str, problems: list[str]) -> bool:
    if value is None or isinstance(value, bool):
        return bool(value)
    if type(value) is int and value in (0, 1):
        return bool(value)
    problems.append(f"{name}: {value!r}; expected True or False")
    return False


def _window(window_size: Any, problems: list[str]) -> tuple[int, int]:
    try:
        return window_bounds(window_size)
    except ValueError as error:
        problems.append(str(error))
        return -1, -1
