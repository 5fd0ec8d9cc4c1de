"""FP8 K/V caches for ``PagedAttention``: their scales checked, and the paths that read them.

An FP8 cache halves the bytes a decode step reads, and decode is bound by those bytes. Decode
reads it as it is (``kernels/paged_decode.py`` widens each tile in registers); cuDNN's paged
attention reads 16-bit caches only, so chunked prefill (and decode on the CPU reference) reads
the step's pages dequantised into a compact 16-bit copy first: one gather of the pages the
page table names, ``rows * pages_per_seq`` of them, with a table that numbers them in order.
Prefill is bound by its arithmetic, so that copy is a small share of its time.

Scales follow FlashInfer's and vLLM's ``k_scale``/``v_scale``: the real value of a stored
element is ``scale * stored`` (a descale), one float per cache.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.dtypes import FP8
from ..core.finite import finite_real
from ..errors import ValidationError, shown

UNIT_SCALES = (1.0, 1.0)  # k_scale, v_scale of 16-bit caches (and FP8 ones stored unscaled)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8


def check_scales(fp8: bool, k_scale: Any, v_scale: Any) -> tuple[float, float]:
    """``k_scale`` and ``v_scale`` as floats: finite and positive, and other than 1 only for FP8 caches."""
    problems = []
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            kind = "a tensor" if isinstance(value, torch.Tensor) else type(value).__name__
            problems.append(
                f"{name}: {kind}; expected a float (FlashInfer's and vLLM's convention: a tensor "
                "would cost a host sync per layer)"
            )
        elif not finite_real(value) or value <= 0:
            problems.append(f"{name}: {shown(value)}; expected a finite float > 0")
        elif value != 1.0 and not fp8:
            problems.append(
                f"{name}: {value!r}; scales apply to FP8 caches (kv_dtype=torch.float8_e4m3fn or "
                "float8_e5m2), and these are 16-bit"
            )
    if problems:
        raise ValidationError(problems, context="PagedAttention.run")
    return float(k_scale), float(v_scale)


def dequantised_pages(cache: torch.Tensor, table: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """The pages ``table`` names, in its order (row by row), as ``dtype`` real values."""
    return dequantised(cache.index_select(0, table.reshape(-1).to(torch.long)), dtype, scale)


def compact_table(table: torch.Tensor) -> torch.Tensor:
    """The page table of ``dequantised_pages(cache, table)``: each entry numbered in order."""
    rows, width = table.shape
    return torch.arange(rows * width, dtype=torch.int32, device=table.device).view(rows, width)


def dequantised(cache: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``cache`` (all of it: the CPU reference's decode) as ``dtype`` real values."""
    return (cache.to(torch.float32) * scale).to(dtype)
