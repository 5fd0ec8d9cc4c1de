"""Casting to and from FP8 around ``sdpa_fp8``: one pass each way on CUDA.

Quantising with torch ops takes three passes over the tensor (scale, clamp, cast) with
16-bit intermediates; at attention sizes that cost more than the FP8 attention itself. On
CUDA, with Triton present (it ships with torch's CUDA builds), one fused kernel reads the
16-bit tensor, scales in float32, saturates and writes E4M3 (round to nearest even, as
cuDNN's own casts), and one reads FP8 and writes the descaled 16-bit result. Elsewhere
(CPU, no Triton) the same arithmetic runs as torch ops in float32, so both paths give the
same values.
"""

from __future__ import annotations

import functools
import importlib.util
import types
from typing import Any

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 4096


def to_fp8(x: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    """``x * scale`` (float32 arithmetic) saturated to E4M3, in ``x``'s layout made contiguous.

    ``amax`` (float32, one element): raised to ``max |x|`` in the same pass, for delayed scaling.
    """
    kernels = _kernels() if x.is_cuda else None
    if kernels is None:
        if amax is not None:
            torch.maximum(amax, x.detach().abs().amax().float().reshape(amax.shape), out=amax)
        return (x.float() * scale.reshape(())).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=E4M3, device=x.device)
    n = x.numel()
    record = amax if amax is not None else scale  # a pointer the kernel never writes when not recording
    kernels.quantise[(_blocks(n),)](x, out, scale, record, n, E4M3_MAX, amax is not None, BLOCK=BLOCK)
    return out


def from_fp8(x8: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x8 * descale`` (float32 arithmetic) in ``dtype``."""
    kernels = _kernels() if x8.is_cuda and x8.is_contiguous() else None
    if kernels is None:
        return (x8.float() * descale.reshape(())).to(dtype)
    out = torch.empty(x8.shape, dtype=dtype, device=x8.device)
    n = x8.numel()
    kernels.dequantise[(_blocks(n),)](x8, out, descale, n, BLOCK=BLOCK)
    return out


def _blocks(n: int) -> int:
    """Kernel programs for ``n`` elements: one per ``BLOCK``."""
    return -(-n // BLOCK)


@functools.cache
def _kernels() -> Any:
    """The Triton kernels, compiled on first use; None without Triton."""
    if importlib.util.find_spec("triton") is None:
        return None
    import triton
    import triton.language as tl

    @triton.jit
    def quantise(x_ptr, out_ptr, scale_ptr, amax_ptr, n, limit, RECORD: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N803
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(x * tl.load(scale_ptr), -limit), limit)
        tl.store(out_ptr + offsets, y.to(tl.float8e4nv), mask=inside)
        if RECORD:  # amaxes are >= 0: float atomic max is exact
            tl.atomic_max(amax_ptr, tl.max(tl.abs(x), axis=0))

    @triton.jit
    def dequantise(x_ptr, out_ptr, descale_ptr, n, BLOCK: tl.constexpr):  # noqa: N803
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        x = tl.load(x_ptr + offsets, mask=inside).to(tl.float32)
        tl.store(out_ptr + offsets, (x * tl.load(descale_ptr)).to(out_ptr.dtype.element_ty), mask=inside)

    return types.SimpleNamespace(quantise=quantise, dequantise=dequantise)
