"""Training calls of ``cudnn_attn.sdpa`` that torch's own cuDNN attention op serves go through it.

The forward and backward kernels are cuDNN's either way. What differs is the host time of a
step: our training path is a Python ``torch.autograd.Function`` (its ``apply``, the saved
tensors, and a backward node the autograd engine runs in Python), which measured 1.37-1.41x
torch's forward + backward host time on an H100 host. torch's
``aten::_scaled_dot_product_cudnn_attention`` has a C++ autograd node, so where it serves the
call exactly as we would, it runs it: CUDA fp16/bf16 ``[B, H, L, E]`` with one head count and
one head dim, no mask, no dropout, causal only where L == S (so top-left and bottom-right
agree), none of the shapes whose backward cuDNN gets wrong (``ops/cudnn/workarounds.py``: our
path masks around them, torch's op does not), with torch's own test,
``torch.backends.cuda.can_use_cudnn_attention`` (strides included), saying yes for the call's
geometry. With autotuning on (``set_autotune``) calls keep our path: torch's op takes cuDNN's
heuristic plan. The log says so once per signature.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import log
from ..core.mask import Causal
from ..ops.cudnn.autotune import enabled_by_default as autotune_default
from ..ops.cudnn.workarounds import nan_backward_reason

WHERE = "cudnn_attn.sdpa"


def serves(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any, dropout_p: float,
           causal: Causal, enable_gqa: bool) -> bool:  # fmt: skip
    """Whether a training call of this geometry goes to torch's cuDNN op (checked once per
    signature: the eager path's key holds shapes, strides, dtypes and devices)."""
    if not query.is_cuda or attn_mask is not None or dropout_p or autotune_default():
        return False
    if query.dtype not in (torch.float16, torch.bfloat16) or not query.dtype == key.dtype == value.dtype:
        return False
    length, keys = query.shape[-2], key.shape[-2]
    if causal is not Causal.NONE and length != keys:
        return False
    if nan_backward_reason(length, keys, causal) is not None:
        return False  # cuDNN's NaN gradients: our path masks around them, torch's op does not
    if query.shape[1] != key.shape[1] or query.shape[-1] != value.shape[-1]:
        return False
    try:
        params = torch.backends.cuda.SDPAParams(query, key, value, None, 0.0, causal is not Causal.NONE, enable_gqa)
        return bool(torch.backends.cuda.can_use_cudnn_attention(params, False))
    except (AttributeError, TypeError, RuntimeError):  # a torch without the op or its test
        return False


class TorchCudnnOp:
    """One training signature run by ``aten::_scaled_dot_product_cudnn_attention``."""

    def __init__(self, scale: float, causal: Causal):
        self.scale, self.is_causal = scale, causal is not Causal.NONE
        # The op's C++ binding: its ``torch.ops`` overload adds a Python frame per call.
        self.op = getattr(torch._C._VariableFunctions, "_scaled_dot_product_cudnn_attention", None) or \
            torch.ops.aten._scaled_dot_product_cudnn_attention.default  # fmt: skip
        log.backend_chosen(WHERE, "torch's cuDNN attention op", "a training call it serves; its autograd node is C++")

    def __call__(self, query, key, value, attn_mask) -> torch.Tensor:
        # (query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask)
        return self.op(query, key, value, None, True, 0.0, self.is_causal, False, scale=self.scale)[0]
