"""torch's own cuDNN attention op, for the training calls of ``cudnn_attn.sdpa`` it serves.

The forward and backward kernels are cuDNN's either way. What differs is the host time of a
step: the graphs' training path is a Python ``torch.autograd.Function`` (its ``apply``, the
saved tensors, and a backward node the autograd engine runs in Python), which measured
1.37-1.41x torch's forward + backward host time on an H100 host. torch's
``aten::_scaled_dot_product_cudnn_attention`` has a C++ autograd node, so where it serves the
call exactly as the graphs would, it runs it: CUDA fp16/bf16 ``[B, H, L, E]`` with one head
count and one head dim, no mask, no dropout, a scale > 0, causal only where L == S (so top-left
and bottom-right agree), none of the shapes whose backward cuDNN gets wrong
(``ops/cudnn/workarounds.py``: the graphs mask around them, torch's op does not), with torch's
own test, ``torch.backends.cuda.can_use_cudnn_attention`` (strides included), saying yes for
the call's geometry. With autotuning on (``set_autotune``) calls keep the graphs: torch's op
takes cuDNN's heuristic plan. The log says so once per signature.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import log
from ...core.mask import Causal
from ..cudnn.autotune import enabled_by_default as autotune_default
from ..cudnn.workarounds import nan_backward_reason
from .call import Call
from .reasons import ZERO_HEAD_DIM

WHERE = "cudnn_attn.sdpa"


def reasons(call: Call) -> list[str]:
    """Why torch's cuDNN op does not serve ``call`` (judged once per signature: the eager path's
    key holds shapes, strides, dtypes and devices); the first failing condition."""
    query, key, value = call.query, call.key, call.value
    length, keys = query.shape[-2], key.shape[-2]
    if not call.train:
        return ["no gradients: the op is taken for its C++ autograd node, and the graphs run inference"]
    checks = (
        (not query.is_cuda, f"device={query.device}: the op runs CUDA tensors"),
        (call.attn_mask is not None, "attn_mask: the op is taken without a mask"),
        (bool(call.dropout_p), f"dropout_p={call.dropout_p:g}: the op is taken without dropout"),
        (not call.scale_positive, "scale <= 0 or not finite: cuDNN's kernels give NaN there"),
        (query.shape[-1] == 0 or value.shape[-1] == 0, ZERO_HEAD_DIM),  # dropout_p=1: refused above
        (autotune_default(), "autotuning on: the op takes cuDNN's heuristic plan"),
        (
            query.dtype not in (torch.float16, torch.bfloat16) or not query.dtype == key.dtype == value.dtype,
            f"dtype={query.dtype}: the op runs float16/bfloat16 alike",
        ),
        (call.causal is not Causal.NONE and length != keys, f"causal with L={length} != S={keys}"),
    )
    for failed, reason in checks:
        if failed:
            return [reason]
    nan = nan_backward_reason(length, keys, call.causal)
    if nan is not None:
        return [f"{nan} (the graphs mask around it, torch's op does not)"]
    if query.shape[1] != key.shape[1] or query.shape[-1] != value.shape[-1]:
        return ["heads or head dims differ between query, key and value"]
    try:
        params = torch.backends.cuda.SDPAParams(
            query, key, value, None, 0.0, call.causal is not Causal.NONE, call.enable_gqa
        )
        if torch.backends.cuda.can_use_cudnn_attention(params, False):
            return []
    except (AttributeError, TypeError, RuntimeError):  # a torch without the op or its test
        return ["this torch has no cuDNN attention op or no test for it"]
    return ["torch.backends.cuda.can_use_cudnn_attention says no for this geometry"]


class TorchCudnnOp:
    """One training signature run by ``aten::_scaled_dot_product_cudnn_attention``."""

    def __init__(self, scale: float, causal: Causal):
        self.scale, self.is_causal = scale, causal is not Causal.NONE
        # The op's C++ binding: its ``torch.ops`` overload adds a Python frame per call.
        binding = getattr(torch._C._VariableFunctions, "_scaled_dot_product_cudnn_attention", None)
        self.op: Any = binding if binding is not None else torch.ops.aten._scaled_dot_product_cudnn_attention.default
        log.backend_chosen(WHERE, "torch's cuDNN attention op", "a training call it serves; its autograd node is C++")

    def __call__(self, query, key, value, attn_mask) -> torch.Tensor:
        # (query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask)
        return self.op(query, key, value, None, True, 0.0, self.is_causal, False, scale=self.scale)[0]
