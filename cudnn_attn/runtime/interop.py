"""Tensors from elsewhere: DLPack arrays (CuPy, NumPy, JAX) in, the same kind out."""

from __future__ import annotations

import importlib
import math
from typing import Any

import torch

from ..core.problem import TensorSpec


def as_torch(value: Any) -> torch.Tensor | None:
    """A torch view of ``value`` (zero-copy through DLPack), or None if it is no tensor."""
    if isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "__dlpack__"):
        try:
            return torch.from_dlpack(value)
        except (TypeError, RuntimeError, BufferError):
            return None
    return None


def writable(value: Any) -> bool:
    """False for an array its library marks read-only (NumPy's ``flags.writeable``: a read-only
    memory map, which a write would crash the process on)."""
    flags = getattr(value, "flags", None)
    return bool(getattr(flags, "writeable", True))


def to_kind(tensor: torch.Tensor, like: Any) -> Any:
    """``tensor`` as the kind of array ``like`` is (torch stays torch)."""
    if like is None or isinstance(like, torch.Tensor):
        return tensor
    module = importlib.import_module(type(like).__module__.split(".")[0])
    from_dlpack = getattr(module, "from_dlpack", None)
    return tensor if from_dlpack is None else from_dlpack(tensor)


def geometry_mismatch(tensor: torch.Tensor, spec: TensorSpec) -> str | None:
    """Why ``tensor`` cannot stand where the graph expects ``spec``; None if it can.

    Strides of size-1 dimensions are ignored: they never address memory.
    """
    shape, stride = tuple(tensor.shape), tensor.stride()
    if (
        shape == spec.shape
        and stride == spec.stride
        and tensor.dtype == spec.dtype
        and str(tensor.device) == spec.device
    ):
        return None  # the fast path of every steady-state call
    problems = []
    if shape != spec.shape:
        problems.append(f"shape {list(shape)} (graph built for {list(spec.shape)})")
    elif any(n != 1 and a != b for n, a, b in zip(shape, stride, spec.stride)):
        problems.append(f"strides {list(stride)} (graph built for {list(spec.stride)})")
    if tensor.dtype != spec.dtype:
        problems.append(f"dtype {tensor.dtype} (graph built for {spec.dtype})")
    if str(tensor.device) != spec.device:
        problems.append(f"device {tensor.device} (graph built for {spec.device})")
    return "; ".join(problems) or None


def same_memory_view(value: Any, spec: TensorSpec | None) -> Any:
    """``value``'s memory viewed with ``spec``'s dims and strides where it holds every element they
    address (the frontend binds a tensor by its pointer: a [B + 1] offsets tensor stands for
    [B + 1, 1, 1, 1], a contiguous [B, S, H, D] tensor for [B, H, S, D] dims with BSHD strides);
    otherwise ``value`` itself, for the usual checks to judge."""
    if type(value) is not torch.Tensor or spec is None or tuple(value.shape) == spec.shape:
        return value
    if value.dtype != spec.dtype or not value.is_contiguous() or min(spec.stride, default=0) < 0:
        return value
    extent = sum((n - 1) * s for n, s in zip(spec.shape, spec.stride)) + 1 if math.prod(spec.shape) else 0
    if extent > value.numel():
        return value
    return value.as_strided(spec.shape, spec.stride)


def ragged_mismatch(tensor: torch.Tensor, spec: TensorSpec) -> str | None:
    """Why ``tensor`` cannot be bound where sequences are placed by ragged offsets; None if it can.
    Only its memory is addressed (the frontend binds a packed [T, H, D] tensor to a 4-D graph
    tensor): dtype and device must match and its last dimension be contiguous."""
    problems = []
    if tensor.dtype != spec.dtype:
        problems.append(f"dtype {tensor.dtype} (graph built for {spec.dtype})")
    if str(tensor.device) != spec.device:
        problems.append(f"device {tensor.device} (graph built for {spec.device})")
    if tensor.dim() == 0 or (tensor.shape[-1] != 1 and tensor.stride(-1) != 1):
        problems.append(f"strides {list(tensor.stride())}: the last dimension must be contiguous")
    return "; ".join(problems) or None


def in_layout_of(t: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """``t``'s values in ``template``'s layout (backward plans read dO in O's layout)."""
    if t.stride() == template.stride():
        return t
    out = torch.empty_strided(template.shape, template.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(t)
