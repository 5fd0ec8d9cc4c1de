"""torch's SDPA kernel running a call of ``cudnn_attn.sdpa`` with the caller's own arguments.

The choice is logged once per reason (``CUDNN_ATTN_LOG_LEVEL=info``). torch picks its kernel
itself, except where one of its kernels is known wrong: then its math kernel runs (exact).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ... import log
from ...core.mask import Causal
from ...errors import UnsupportedError, ValidationError

WHERE = "cudnn_attn.sdpa"
_said: set[str] = set()  # each reason is logged once, not per call


class TorchKernel:
    """One call signature that runs on torch's own SDPA kernel. ``why``: the reason the graphs
    passed it over (logged once); ``math``: run torch's math kernel, not torch's own choice."""

    def __init__(self, why: str, dropout_p: Any, causal: Causal, scale: Any, enable_gqa: bool, math: bool):
        self.why, self.dropout_p, self.causal, self.scale, self.enable_gqa = why, dropout_p, causal, scale, enable_gqa
        self.math = math

    def __call__(self, query, key, value, attn_mask) -> torch.Tensor:
        if self.why not in _said and not torch.compiler.is_compiling():
            _said.add(self.why)
            log.backend_passed_over(WHERE, "cudnn_attn's graphs", self.why + "; runs on torch's SDPA kernel")
        problems = shape_problems(query, key, value, self.enable_gqa)
        if problems:  # what torch's kernel would raise a RuntimeError for, said as the graphs say it
            raise ValidationError(problems, context="sdpa")
        if (
            isinstance(attn_mask, torch.Tensor)
            and attn_mask.is_floating_point()
            and attn_mask.dtype != query.dtype
            and (attn_mask.dtype != torch.float32 or query.is_cuda)
        ):
            # torch's kernel takes a float mask of the query's dtype or float32 only (a RuntimeError);
            # every other path of sdpa adds any float mask to the scores, so this one does too. A
            # float32 mask on the CPU goes as it is: torch adds it to float32 scores (cast, one
            # 16-bit step off); on a GPU it is cast, as cuDNN's path casts it (torch 2.11's cuDNN
            # kernel gave NaN for a float32 mask beside bf16 queries on an H200).
            attn_mask = attn_mask.to(query.dtype)
        if isinstance(attn_mask, torch.Tensor) and attn_mask.dim() < 2:
            # torch 2.13's CPU flash kernel raises IndexError for a 0-D or 1-D mask beside 4-D inputs
            # (its math kernel broadcasts it, as documented): [S] and [1, S] are the same mask.
            attn_mask = attn_mask.reshape((1,) * (2 - attn_mask.dim()) + tuple(attn_mask.shape))
        if self.causal is Causal.BOTTOM_RIGHT and torch.compiler.is_compiling():
            # Dynamo cannot build a CausalBias inside a traced function: the same band as a mask.
            s_q, s_kv = query.shape[-2], key.shape[-2]
            attn_mask = torch.ones(s_q, s_kv, dtype=torch.bool, device=query.device).tril(s_kv - s_q)
        elif self.causal is Causal.BOTTOM_RIGHT:
            from torch.nn.attention.bias import causal_lower_right  # loads torch._dynamo: not at import

            attn_mask = causal_lower_right(query.shape[-2], key.shape[-2])
        if not self.math:
            return self._sdpa(query, key, value, attn_mask)
        # torch 2.13's CPU flash kernel returns NaN everywhere for a negative scale with a causal
        # mask (float32 and float64); its math kernel is exact there.
        with sdpa_kernel(SDPBackend.MATH):
            return self._sdpa(query, key, value, attn_mask)

    def _sdpa(self, query, key, value, attn_mask) -> torch.Tensor:
        call = {
            "attn_mask": attn_mask,
            "dropout_p": self.dropout_p,
            "is_causal": self.causal is Causal.TOP_LEFT,
            "scale": self.scale,
            "enable_gqa": self.enable_gqa,
        }
        if torch.compiler.is_compiling():  # traced as torch's own call
            return torch.nn.functional.scaled_dot_product_attention(query, key, value, **call)
        try:
            return torch.nn.functional.scaled_dot_product_attention(query, key, value, **call)
        except RuntimeError as error:
            if "No viable backend" not in str(error) and "No available kernel" not in str(error):
                raise
            # A caller's sdpa_kernel(...) context left torch none of its kernels for this call.
            reason = (
                f"torch's SDPA kernels allowed by the enclosing torch.nn.attention.sdpa_kernel context "
                f"cannot run this call on {query.device.type} ({str(error).splitlines()[0]})"
            )
            raise UnsupportedError([reason], context="sdpa") from None


def shape_problems(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool) -> list[str]:
    """The geometry torch's kernel needs and the graphs check themselves (head dims, lengths, heads);
    a head dim of 0 it takes (the mean of the values)."""
    problems = []
    if key.shape[-1] != query.shape[-1]:
        problems.append(f"key: head dim {key.shape[-1]} differs from query's {query.shape[-1]}")
    if value.shape[-2] != key.shape[-2]:
        problems.append(f"value: {value.shape[-2]} keys but key has {key.shape[-2]}; they must match")
    if query.dim() >= 3 and (key.shape[-3] != value.shape[-3] or query.shape[-3] % max(key.shape[-3], 1)):
        problems.append(
            f"key: {key.shape[-3]} heads (value {value.shape[-3]}) for query's {query.shape[-3]}; key and value "
            "share one head count that divides query's" + ("" if enable_gqa else " (and enable_gqa=True for fewer)")
        )
    if query.dim() == 4 and not (query.shape[0] == key.shape[0] == value.shape[0]):
        problems.append(f"key: batch {key.shape[0]} (value {value.shape[0]}) differs from query's {query.shape[0]}")
    return problems
