"""One call of torch's SDPA signature, as the engines' reasons read it (xformers' ``Inputs``).

``cudnn_attn.sdpa`` makes one per call signature (the eager path keeps the choice under its flat
key), so reading it costs nothing on a steady-state call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ...core.mask import Causal


@dataclass(frozen=True, eq=False)
class Call:
    """``query``/``key``/``value``: ``[B, H, L, E]`` (or the caller's other ranks); ``attn_mask`` as
    given (None, a tensor); ``causal``: the resolved variant; ``scale``: as given (None: default);
    ``train``: whether a gradient is wanted."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: Any
    dropout_p: float
    causal: Causal
    scale: Any
    enable_gqa: bool
    train: bool

    @property
    def on_gpu(self) -> bool:
        return self.query.is_cuda

    @property
    def scale_positive(self) -> bool:
        """A scale the kernels compute with: None, or finite and > 0 (torch takes inf and NaN too)."""
        return self.scale is None or 0 < self._scale_value() < math.inf

    @property
    def scale_finite(self) -> bool:
        return self.scale is None or -math.inf < self._scale_value() < math.inf  # NaN compares False

    def _scale_value(self) -> Any:
        # Compared, not passed to math.isfinite: a traced scale may be symbolic (torch.compile's
        # dynamic=True), and Dynamo traces comparisons of it but not float() or math calls.
        return float(self.scale) if isinstance(self.scale, torch.Tensor) else self.scale

    def describe(self) -> str:
        """The call's geometry and flags, for the dispatch's log and errors."""
        q, k = self.query, self.key
        return (
            f"sdpa {str(q.dtype).removeprefix('torch.')} {q.device.type} q{list(q.shape)} k{list(k.shape)} "
            f"causal={self.causal.value} dropout={self.dropout_p:g} train={self.train}"
        )
