"""Tensors from elsewhere: DLPack arrays (CuPy, NumPy, JAX) in, the same kind out."""

from __future__ import annotations

import importlib
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
