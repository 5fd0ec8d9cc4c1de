"""Launching our Triton and Gluon kernels for a few microseconds of host time instead of tens.

``kernel[grid](*args, **constexprs)`` binds and specialises every argument in Python on each
call, and a Gluon kernel's TMA descriptors are validated objects built per call. On an H100 host
that cost 35 us for the split-KV decode kernel, 78 us for the merge and 340 us for an MLA decode
step with its four descriptors and merge: an eager decode step pays it per layer. ``Launcher``
pays it once per kind of call. The first call of a kind goes through Triton (compiling if need
be) and keeps the compiled kernel; later calls of the same kind (each tensor's dtype and 16-byte
alignment, each integer's value, each descriptor's dtype and block) call its launcher directly,
on the current stream of the first tensor argument's device. Integers key by value, finer than
Triton specialises them (``== 1``, ``% 16 == 0``, width) and cheaper to read: a kernel's
integers are its geometry's strides and sizes, which repeat call after call.

The direct call relies on Triton's compiled-kernel launcher (``CompiledKernel.run``, Triton 3.x);
where a compiled kernel lacks it, or a launch hook is set (a profiler), every call goes through
Triton as before.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

_I32 = range(-(2**31), 2**31)
MAX_KINDS = 1024  # kinds of call one kernel keeps its compiled launcher for


class Tma(NamedTuple):
    """A TMA descriptor argument of a Gluon kernel: the ``block_shape`` tile of ``base`` viewed as
    ``shape`` with ``strides`` (elements), zero-padded past the ends. The launcher reads these
    fields directly; the first launch of a kind also builds Triton's own descriptor from them."""

    base: torch.Tensor
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    block_shape: tuple[int, ...]
    padding: str = "zero"

    @classmethod
    def of(cls, t: torch.Tensor, block_shape: tuple[int, ...]) -> Tma:
        return cls(t, tuple(t.shape), tuple(t.stride()), block_shape)


def _kind(value: Any) -> Any:
    """What Triton specialises a kernel on for one argument."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, float):
        return float
    if isinstance(value, int) and not isinstance(value, bool):
        return value == 1, value % 16 == 0, value in _I32, value >= 2**63
    if isinstance(value, Tma):
        return Tma, value.base.dtype, value.block_shape, value.padding
    return type(value), value  # None, a bool, anything else: the value itself


def _gluon_descriptor(arg: Tma) -> Any:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[arg.base.dtype]
    layout = gl.NVMMASharedLayout.get_default_for(list(arg.block_shape), element)
    return TensorDescriptor(arg.base, list(arg.shape), list(arg.strides), list(arg.block_shape), layout, arg.padding)


class Launcher:
    """One kernel's launches: ``launcher(grid, *args, **constexprs)`` as ``kernel[grid](...)``,
    with ``args`` every runtime argument in the kernel's order (the first a tensor or ``Tma`` on
    the device to run on) and ``constexprs`` the rest (and Triton's options, ``num_warps`` and the
    like), by keyword. ``Tma`` arguments stand for a Gluon kernel's TMA descriptors."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._compiled: dict[tuple, Any] = {}  # specialisation -> (compiled kernel, constexpr values)

    def __call__(self, grid: tuple[int, ...], *args: Any, **constexprs: Any) -> None:
        first = args[0]
        device = (first.base if isinstance(first, Tma) else first).device.index
        if device != torch.cuda.current_device():  # Triton launches on the current device
            with torch.cuda.device(device):
                return self(grid, *args, **constexprs)
        # _kind of each tensor inline; an int as its value, which specialises at least as finely as
        # Triton does (== 1, % 16, width) and costs half as much to key on: this runs on every launch.
        key = (
            device,
            *[
                a if type(a) is int else (a.dtype, a.data_ptr() % 16 == 0) if type(a) is torch.Tensor else _kind(a)
                for a in args
            ],
            *constexprs.items(),
        )
        found = self._compiled.get(key)
        if found is not None and not _launch_hooked():
            compiled, tail = found
            grid_y = grid[1] if len(grid) > 1 else 1
            grid_z = grid[2] if len(grid) > 2 else 1
            compiled.run(
                grid[0],
                grid_y,
                grid_z,
                torch._C._cuda_getCurrentRawStream(device),
                compiled.function,
                compiled.packed_metadata,
                None,
                None,
                None,
                *args,
                *tail,
            )
            return None
        given = [_gluon_descriptor(a) if isinstance(a, Tma) else a for a in args]
        compiled = self.kernel[grid](*given, **constexprs)
        if all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata")):
            if len(self._compiled) >= MAX_KINDS:  # ints that change call after call: start afresh
                self._compiled.clear()
            names = self.kernel.arg_names[len(args) :]  # the constexprs, in the kernel's order
            self._compiled[key] = (compiled, tuple(constexprs[name] for name in names))
        return None


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The CUDA device's SM count (read once per device): what a grid is sized against."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def is_hopper(device: torch.device) -> bool:
    """Whether the CUDA device is sm_90 (read once per device): what our Gluon kernels target."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) == (9, 0)


def _launch_hooked() -> bool:
    """Whether a launch hook is set (a profiler's): Triton 3.6 keeps an always-present chain of
    hooks, earlier versions None or a function."""
    import triton

    hooks = triton.knobs.runtime.launch_enter_hook
    return hooks is not None and bool(getattr(hooks, "calls", True))


__all__ = ["Launcher", "Tma", "sm_count"]
