"""The varlen door's own checks: what the graph cannot see of a packed call (the tensors' form,
``cu_seqlens``' form and, on the CPU, values, the scalars), one line each, naming the argument."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ValidationError
from .finite import finite_real, integer

CAUSAL = (None, "top_left", "bottom_right")


def check_call(
    q, k, v, cu_q, cu_k, max_q, max_k, causal, window_left, window_right, dropout_p, enable_gqa, context: str
) -> None:
    """What the graph cannot see (cu_seqlens' form and, on the CPU, values), one line each."""
    problems: list[str] = []
    tensors = {"q": q, "k": k, "v": v}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            problems.append(f"{name}: {type(t).__name__}; expected a torch tensor")
        elif t.is_nested:
            problems.append(
                f"{name}: a nested tensor; varlen takes packed [tokens, heads, head_dim] tensors with cu_seqlens "
                "(cudnn_attn.sdpa takes nested ones)"
            )
        elif t.layout != torch.strided:  # sparse: no strides to read (they read as 0)
            problems.append(
                f"{name}: a {str(t.layout).removeprefix('torch.')} tensor; expected a dense one (.to_dense())"
            )
        elif t.dim() != 3:
            problems.append(f"{name}: shape {list(t.shape)}; expected packed [tokens, heads, head_dim]")
    if problems:
        raise ValidationError(problems, context=context)
    if v.shape[0] != k.shape[0]:  # every call: a warm plan reads T_kv from k alone
        problems.append(f"v: {v.shape[0]} tokens differ from k's {k.shape[0]}; packed k and v must share T_kv")
    if v.shape[1] != k.shape[1]:
        problems.append(f"v: {v.shape[1]} heads differ from k's {k.shape[1]}; packed k and v must share H_kv")
    if q.shape[1] != k.shape[1] and not enable_gqa:
        problems.append(f"k: {k.shape[1]} heads, q has {q.shape[1]}; pass enable_gqa=True for grouped-query attention")
    if causal not in CAUSAL:
        problems.append(f"causal: {causal!r}; allowed None, 'top_left', 'bottom_right'")
    if window_left is not None and (not integer(window_left) or window_left < 0):
        problems.append(f"window_size: left bound {window_left!r}; must be an int >= 0")
    if window_right is not None and (not integer(window_right) or window_right < 1 or causal is not None):
        problems.append(
            f"window_size: right bound {window_right!r}; must be an int >= 1, without a causal mask (a right bound of 0)"
        )
    if not finite_real(dropout_p) or not 0 <= dropout_p < 1:  # NumPy scalars too, as FlashAttention takes them
        problems.append(f"dropout_p: {dropout_p!r}; must be a float in [0, 1)")
    for name, value in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        if not integer(value) or value < 0:  # 0: every sequence empty (FlashAttention's zeros)
            problems.append(f"{name}: {value!r}; must be an int >= 0")
    for name, cu, tokens, longest in (
        ("cu_seqlens_q", cu_q, q.shape[0], max_q),
        ("cu_seqlens_k", cu_k, k.shape[0], max_k),
    ):
        problems += _cu_problems(name, cu, q.device, tokens, int(longest) if integer(longest) else None)
    if not problems and cu_q.shape != cu_k.shape:
        problems.append(
            f"cu_seqlens_k: {cu_k.shape[0] - 1} sequences, cu_seqlens_q has {cu_q.shape[0] - 1}; "
            "they must describe the same batch"
        )
    if problems:
        raise ValidationError(problems, context=context)


def _cu_problems(name: str, cu: Any, device: torch.device, tokens: int, longest: int | None) -> list[str]:
    if not isinstance(cu, torch.Tensor):
        return [f"{name}: {type(cu).__name__}; expected an int32 tensor [batch + 1]"]
    if cu.dtype not in (torch.int32, torch.int64):
        return [f"{name}: dtype {str(cu.dtype).removeprefix('torch.')}; expected int32"]
    if cu.dim() != 1 or cu.shape[0] < 2:
        return [f"{name}: shape {list(cu.shape)}; expected [batch + 1] with batch >= 1"]
    if cu.device != device:
        return [f"{name}: on {cu.device}; must be on q's device ({device})"]
    if cu.is_cuda:
        return []  # values are made safe on the device (see varlen.py's docstring)
    problems = []
    lengths = cu[1:] - cu[:-1]
    if cu[0] != 0:
        problems.append(f"{name}: starts at {int(cu[0])}; must start at 0")
    if (lengths < 0).any():
        at = int(torch.nonzero(lengths < 0)[0])
        problems.append(f"{name}: decreases at index {at + 1} ({int(cu[at])} -> {int(cu[at + 1])}); must not decrease")
    if int(cu[-1]) > tokens:
        problems.append(f"{name}: ends at {int(cu[-1])}, past the {tokens} packed tokens")
    if longest is not None and lengths.numel() and int(lengths.max()) > longest:
        at = int(torch.argmax(lengths))
        problems.append(f"{name}: sequence {at} has length {int(lengths[at])}, above max_seqlen {longest}")
    return problems


__all__ = ["CAUSAL", "check_call"]
