"""Casting to and from FP8 around ``sdpa_fp8``: one pass each way, few launches, on CUDA.

Quantising with torch ops takes three passes over a tensor (scale, clamp, cast) with 16-bit
intermediates, and the scale arithmetic around them a dozen tiny launches; at S = 4096 that
host time is more than the FP8 attention saves. On CUDA, with Triton present (it ships with
torch's CUDA builds):

- ``quantise_qkv``: one launch reads Q, K and V, scales each in float32 (its scale read from
  a device buffer, or computed in the kernel from its amax), saturates and writes E4M3 (round
  to nearest even, as cuDNN's own casts), optionally raising each tensor's amax, and writes
  the scales and descales the attention consumes;
- ``amax_qkv``: one launch for the three amaxes current scaling needs first;
- ``advance_history``: one launch folds a call's amaxes into an amax history and leaves the
  next call's scales (delayed scaling, ``fp8_scaling.py``), all on the device, so a call is
  safe to capture in a CUDA graph;
- ``from_fp8``: one launch reads FP8 and writes the descaled 16-bit result.

Elsewhere (CPU, no Triton) the same arithmetic runs as torch ops in float32, so both paths
give the same values. Tensors whose elements are dense in memory (contiguous, or a
permutation of contiguous such as a BSHD view) are cast in their own memory order and keep
their strides; others are made contiguous first.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import types
from typing import Any

import torch

from .launch import Launcher

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 4096
SCALE_STRIDE = 4  # scales live 16 bytes apart: each [1, 1, 1, 1] view cuDNN binds is aligned
TENSORS = 3  # Q, K, V


def scale_buffer(device: torch.device | str, fill: float = 1.0) -> torch.Tensor:
    """Float32 ``[3, SCALE_STRIDE]``: one scale (or descale) per tensor in column 0."""
    return torch.full((TENSORS, SCALE_STRIDE), fill, dtype=torch.float32, device=device)


def scale_view(buffer: torch.Tensor, i: int) -> torch.Tensor:
    """Row ``i``'s scale as the float32 ``[1, 1, 1, 1]`` tensor the FP8 ops take."""
    return buffer[i, :1].view(1, 1, 1, 1)


FLOAT32_MAX = torch.finfo(torch.float32).max


def scales_for(amaxes: torch.Tensor) -> torch.Tensor:
    """448 / amax per element, as TransformerEngine computes it: 1 where the amax is 0 or not
    finite, and at most float32's largest where the amax is tiny."""
    # An all-zero tensor keeps scale 1 (any scale would do; 0 would divide by zero); an inf or
    # NaN amax too, so one overflowing element saturates rather than zeroing (scale 0) the whole
    # tensor into NaN. A tiny amax (below ~1e-36) would overflow the scale to inf, then 0 * inf
    # = NaN: it is clamped. A true division (``448 / tensor`` is a reciprocal times 448 in
    # torch), as the CUDA kernels do.
    usable = (amaxes > 0) & (amaxes <= FLOAT32_MAX)
    divided = torch.full_like(amaxes, E4M3_MAX) / torch.where(usable, amaxes, torch.ones_like(amaxes))
    return torch.where(usable, divided.clamp(max=FLOAT32_MAX), torch.ones_like(amaxes))


def finite_amaxes(amaxes: torch.Tensor) -> torch.Tensor:
    """``amaxes`` with inf and NaN as 0: what a delayed-scaling history records, so one
    overflowing call does not set the scale of the calls after it."""
    return torch.where(amaxes <= FLOAT32_MAX, amaxes, torch.zeros_like(amaxes))


def reciprocal_scale(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale``, and 1 where ``scale`` is 0 or not finite (a descale of 0: every real value
    is 0, and any scale writes them as 0; dividing would give inf, then 0 * inf = NaN)."""
    usable = (scale.abs() > 0) & (scale.abs() <= FLOAT32_MAX)
    return torch.where(usable, torch.ones_like(scale) / torch.where(usable, scale, torch.ones_like(scale)), 1.0)


def to_fp8(x: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    """``x * scale`` (float32 arithmetic) saturated to E4M3, in ``x``'s memory order.

    ``amax`` (float32, one element): raised to ``max |x|`` in the same pass, for delayed scaling.
    """
    kernels = _launchable(x)
    if kernels is None:
        if amax is not None:
            torch.maximum(amax, _amax(x).reshape(amax.shape), out=amax)
        return _cast(x, scale.reshape(()))
    x = _dense(x)
    out = torch.empty_like(x, dtype=E4M3)
    n = x.numel()
    record = amax if amax is not None else scale  # a pointer the kernel never writes when not recording
    kernels.quantise((_blocks(n),), x, out, scale, record, n, E4M3_MAX, RECORD=amax is not None, BLOCK=BLOCK)
    return out


def quantise_qkv(
    tensors: tuple[torch.Tensor, ...],
    scales: torch.Tensor | None = None,
    amaxes: torch.Tensor | None = None,
    record: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Q, K and V in E4M3, with the scales used and their descales (``[3, SCALE_STRIDE]`` each).

    The scale of tensor ``i`` is ``scales[i, 0]`` if given, else ``448 / amaxes[i]`` (1 for an
    all-zero tensor). ``record`` (float32 ``[3]``): raised to each tensor's amax in the pass.
    """
    assert (scales is None) != (amaxes is None), "one source of scales"
    device = tensors[0].device
    used, descales = torch.empty((2, TENSORS, SCALE_STRIDE), dtype=torch.float32, device=device).unbind(0)
    kernels = _launchable(*tensors)
    if kernels is None:
        used[:, 0] = scales[:, 0] if scales is not None else scales_for(amaxes)  # type: ignore[arg-type]
        descales[:, 0] = reciprocal_scale(used[:, 0])
        if record is not None:
            torch.maximum(record, torch.stack([_amax(x) for x in tensors]), out=record)
        return [_cast(x, used[i, 0]) for i, x in enumerate(tensors)], used, descales
    xs = [_dense(x) for x in tensors]
    outs = [torch.empty_like(x, dtype=E4M3) for x in xs]
    sizes = [x.numel() for x in xs]
    blocks = [_blocks(n) for n in sizes]
    source = scales if scales is not None else amaxes
    kernels.quantise_qkv(
        (sum(blocks),),
        *xs,
        *outs,
        *sizes,
        blocks[0],
        blocks[0] + blocks[1],
        source,
        used,
        descales,
        record if record is not None else used,
        E4M3_MAX,
        SCALE_STRIDE,
        FROM_AMAX=amaxes is not None,
        RECORD=record is not None,
        BLOCK=BLOCK,
    )
    return outs, used, descales


def amax_qkv(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``max |x|`` of each of Q, K, V (float32 ``[3]``)."""
    kernels = _launchable(*tensors)
    if kernels is None:
        return torch.stack([_amax(x) for x in tensors])
    xs = [_dense(x) for x in tensors]
    out = torch.zeros(TENSORS, dtype=torch.float32, device=xs[0].device)
    sizes = [x.numel() for x in xs]
    blocks = [_blocks(n) for n in sizes]
    kernels.amax_qkv((sum(blocks),), *xs, *sizes, blocks[0], blocks[0] + blocks[1], out, BLOCK=BLOCK)
    return out


def advance_history(history: torch.Tensor, current: torch.Tensor, slot: torch.Tensor, scales: torch.Tensor) -> None:
    """Delayed scaling, one step on the device: ``current`` (float32 ``[3]``, this call's amaxes;
    inf and NaN recorded as 0) goes into ``history`` (``[3, H]``) at column ``slot`` (int32 ``[1]``,
    then advanced), ``current`` is zeroed, and ``scales[i, 0]`` becomes ``scales_for(max(history[i]))``."""
    kernels = _launchable(history)
    if kernels is None:
        column = int(slot.item())
        history[:, column] = finite_amaxes(current)
        current.zero_()
        scales[:, 0] = scales_for(history.amax(dim=1))
        slot.fill_((column + 1) % history.shape[1])
        return
    length = history.shape[1]
    kernels.advance_history(
        (1,),
        history,
        current,
        slot,
        scales,
        length,
        E4M3_MAX,
        SCALE_STRIDE,
        SPAN=max(16, 1 << (length - 1).bit_length()),
    )


def from_fp8(x8: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x8 * descale`` (float32 arithmetic) in ``dtype``."""
    kernels = _launchable(x8) if _is_dense(x8) else None
    if kernels is None:
        return (x8.float() * descale.reshape(())).to(dtype)
    out = torch.empty_like(x8, dtype=dtype)
    n = x8.numel()
    kernels.dequantise((_blocks(n),), x8, out, descale, n, BLOCK=BLOCK)
    return out


def _cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() * scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)


def _amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` ignoring NaN, as the CUDA kernels' max reduction does (inf is kept)."""
    return x.detach().abs().nan_to_num(nan=0.0, posinf=math.inf).amax().float()


def _is_dense(x: torch.Tensor) -> bool:
    """Whether ``x``'s elements fill its memory span exactly once (any order of dimensions)."""
    if x.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted(zip(x.shape, x.stride()), key=lambda p: p[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its memory can be walked flat (``empty_like`` keeps the same strides)."""
    return x.detach() if _is_dense(x) else x.detach().contiguous()


def _launchable(*tensors: torch.Tensor) -> Any:
    """The kernels, when every tensor is on CUDA and small enough for 32-bit offsets; else None."""
    if not all(x.is_cuda and x.numel() < 2**31 - BLOCK for x in tensors):
        return None
    return _kernels()


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
    def _nan_as_zero(a):
        return tl.where(a == a, a, 0.0)  # NaN skipped by every amax, as _amax skips it (a block all NaN too)

    @triton.jit
    def quantise(x_ptr, out_ptr, scale_ptr, amax_ptr, n, limit, RECORD: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        y = tl.clamp(x * tl.load(scale_ptr), -limit, limit, propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN
        tl.store(out_ptr + offsets, y.to(tl.float8e4nv), mask=inside)
        if RECORD:  # amaxes are >= 0: float atomic max is exact
            tl.atomic_max(amax_ptr, tl.max(_nan_as_zero(tl.abs(x)), axis=0))

    @triton.jit
    def quantise_qkv(
        q_ptr,
        k_ptr,
        v_ptr,
        q8_ptr,
        k8_ptr,
        v8_ptr,
        n_q,
        n_k,
        n_v,
        end_q,
        end_k,
        source_ptr,
        used_ptr,
        descale_ptr,
        record_ptr,
        limit,
        stride,
        FROM_AMAX: tl.constexpr,
        RECORD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        if pid < end_q:
            which, block, x_ptr, out_ptr, n = 0, pid, q_ptr, q8_ptr, n_q
        elif pid < end_k:
            which, block, x_ptr, out_ptr, n = 1, pid - end_q, k_ptr, k8_ptr, n_k
        else:
            which, block, x_ptr, out_ptr, n = 2, pid - end_k, v_ptr, v8_ptr, n_v
        if FROM_AMAX:  # scales_for's rules: 1 for 0, inf or NaN; at most float32's largest
            amax = tl.load(source_ptr + which)
            usable = (amax > 0) & (amax <= 3.4028234663852886e38)
            scale = tl.where(
                usable, tl.minimum(tl.math.div_rn(limit, tl.where(usable, amax, 1.0)), 3.4028234663852886e38), 1.0
            )
        else:
            scale = tl.load(source_ptr + which * stride)
        if block == 0:  # one program per tensor reports the scale it used and its descale
            tl.store(used_ptr + which * stride, scale)
            usable = (tl.abs(scale) > 0) & (tl.abs(scale) <= 3.4028234663852886e38)  # reciprocal_scale's rule
            tl.store(
                descale_ptr + which * stride, tl.where(usable, tl.math.div_rn(1.0, tl.where(usable, scale, 1.0)), 1.0)
            )
        offsets = block * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        y = tl.clamp(x * scale, -limit, limit, propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN, as _cast
        tl.store(out_ptr + offsets, y.to(tl.float8e4nv), mask=inside)
        if RECORD:
            tl.atomic_max(record_ptr + which, tl.max(_nan_as_zero(tl.abs(x)), axis=0))

    @triton.jit
    def amax_qkv(q_ptr, k_ptr, v_ptr, n_q, n_k, n_v, end_q, end_k, out_ptr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        if pid < end_q:
            which, block, x_ptr, n = 0, pid, q_ptr, n_q
        elif pid < end_k:
            which, block, x_ptr, n = 1, pid - end_q, k_ptr, n_k
        else:
            which, block, x_ptr, n = 2, pid - end_k, v_ptr, n_v
        offsets = block * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0).to(tl.float32)
        tl.atomic_max(out_ptr + which, tl.max(_nan_as_zero(tl.abs(x)), axis=0))

    @triton.jit
    def advance_history(history_ptr, current_ptr, slot_ptr, scale_ptr, length, limit, stride, SPAN: tl.constexpr):
        slot = tl.load(slot_ptr)
        columns = tl.arange(0, SPAN)
        for which in tl.static_range(3):
            amax = tl.load(current_ptr + which)
            amax = tl.where(amax <= 3.4028234663852886e38, amax, 0.0)  # inf and NaN are not recorded
            # The rest of the row, read before this call's amax is written into it.
            rest = tl.load(
                history_ptr + which * length + columns, mask=(columns < length) & (columns != slot), other=0.0
            )
            top = tl.maximum(tl.max(rest, axis=0), amax)
            tl.store(history_ptr + which * length + slot, amax)
            tl.store(current_ptr + which, 0.0)
            scale = tl.math.div_rn(limit, tl.where(top > 0, top, 1.0))
            tl.store(scale_ptr + which * stride, tl.where(top > 0, tl.minimum(scale, 3.4028234663852886e38), 1.0))
        tl.store(slot_ptr, (slot + 1) % length)

    @triton.jit
    def dequantise(x_ptr, out_ptr, descale_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        x = tl.load(x_ptr + offsets, mask=inside).to(tl.float32)
        tl.store(out_ptr + offsets, (x * tl.load(descale_ptr)).to(out_ptr.dtype.element_ty), mask=inside)

    return types.SimpleNamespace(
        quantise=Launcher(quantise),
        quantise_qkv=Launcher(quantise_qkv),
        amax_qkv=Launcher(amax_qkv),
        advance_history=Launcher(advance_history),
        dequantise=Launcher(dequantise),
    )
