"""``cudnn_attn.Fp8Tensor``: an E4M3 tensor and the descale that gives its real values.

What ``sdpa_fp8`` takes from a producer that already writes FP8 (an FP8 projection, an FP8
KV cache) and returns to a consumer that reads FP8 (an FP8 matmul such as
``torch._scaled_mm``, which takes the descale as ``scale_a``): the casts a 16-bit caller pays
around the FP8 kernel (reading Q, K, V in 16 bits, writing them in 8; reading O in 8, writing
it in 16) are then not paid at all. The real value of element ``i`` is
``data[i].float() * descale``, TransformerEngine's and ``torch._scaled_mm``'s convention.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .fp8_scaling import current_scale
from .kernels.fp8_cast import from_fp8, to_fp8


class Fp8Tensor(NamedTuple):
    """``data`` (``torch.float8_e4m3fn``) and ``descale`` (float32, one element): the real
    values are ``data.float() * descale``. A tuple, so ``data, descale = t`` unpacks it."""

    data: torch.Tensor
    descale: torch.Tensor

    @classmethod
    def quantise(cls, x: torch.Tensor, scale: torch.Tensor | None = None) -> Fp8Tensor:
        """``x`` (fp16/bf16/float32) in E4M3: ``x * scale`` saturated to +-448. ``scale``
        (float32, one element) defaults to the current scale, ``448 / max|x|`` (1 if ``x`` is
        all zeros), which takes one more pass over ``x``."""
        used = current_scale(x) if scale is None else scale.detach().float().reshape(1, 1, 1, 1)
        return cls(to_fp8(x.detach(), used), (1.0 / used).reshape(()))

    def dequantise(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The real values in ``dtype`` (``data * descale``, float32 arithmetic)."""
        return from_fp8(self.data, self.descale.reshape(1, 1, 1, 1), dtype)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def __repr__(self) -> str:
        return f"Fp8Tensor(shape={list(self.data.shape)}, dtype={self.data.dtype}, descale={self.descale!r})"
