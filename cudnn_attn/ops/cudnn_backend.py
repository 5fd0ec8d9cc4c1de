"""The cuDNN backend: problems lowered to cuDNN execution plans through the frontend.

Build: lower, validate, build the operation graph, create plans from the heuristics, check
support, build. cuDNN's own failures are re-raised as ``UnsupportedError`` naming the
problem, the GPU and the versions. Run: bind tensors by fixed uid and execute on the
caller's current torch stream (or ``stream=``), through a handle made once per device and
thread.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import UnsupportedError
from ..problem import AttentionProblem
from . import capabilities, lowering
from .base import RunInputs
from .lowering import UID, Lowered


@functools.cache
def platform(device_index: int) -> capabilities.Platform:
    """The GPU and versions of ``cuda:device_index`` (read once per device)."""
    import cudnn

    props = torch.cuda.get_device_properties(device_index)
    return capabilities.Platform(
        gpu=props.name, arch=(props.major, props.minor), cudnn=int(cudnn.backend_version()), frontend=cudnn.__version__
    )


def _device_index(device: str) -> int:
    d = torch.device(device)
    return d.index if d.index is not None else torch.cuda.current_device()


class _Handles(threading.local):
    """One cuDNN handle per device and thread, made on first use."""

    def __init__(self) -> None:
        self.by_device: dict[int, Any] = {}


_handles = _Handles()


def cudnn_handle(device_index: int, user_handle: Any = None) -> Any:
    """The handle to run on: the caller's (ours or the frontend's), else this thread's own."""
    import cudnn

    if user_handle is not None:
        if isinstance(user_handle, cudnn.Handle):
            return user_handle
        native = getattr(user_handle, "native", None)
        if native is None:
            with torch.cuda.device(device_index):
                native = user_handle.native = cudnn.create_handle()
        return native
    handle = _handles.by_device.get(device_index)
    if handle is None:
        with torch.cuda.device(device_index):
            handle = _handles.by_device[device_index] = cudnn.create_handle()
    return handle


def _stream_pointer(stream: Any, device_index: int) -> int:
    if stream is None:
        return torch.cuda.current_stream(device_index).cuda_stream
    return int(getattr(stream, "cuda_stream", stream))


class CudnnBackend:
    name = "cudnn"

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        if not problem.device.startswith("cuda"):
            return [f"device={problem.device}: cuDNN runs on CUDA tensors"]
        if not torch.cuda.is_available():
            return ["no CUDA device is available"]
        try:
            here = platform(_device_index(problem.device))
        except Exception as error:  # the frontend or libcudnn is missing or unloadable
            return [f"the cuDNN library cannot be loaded: {str(error).splitlines()[0]}"]
        return capabilities.unsupported_reasons(problem, here)

    def plan_key(self, problem: AttentionProblem) -> tuple:
        here = platform(_device_index(problem.device))
        return (here.arch, here.cudnn, here.frontend)

    def build(self, problem: AttentionProblem, *, rng_dump: bool = False) -> CudnnPlan:
        device_index = _device_index(problem.device)
        here = platform(device_index)
        try:
            lowered = lowering.lower(problem, rng_dump=rng_dump)
            graph = lowered.graph
            graph.validate()
            graph.build_operation_graph()
            import cudnn

            graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            graph.check_support()
            with torch.cuda.device(device_index):
                graph.build_plans()
            workspace_size = int(graph.get_workspace_size())
        except UnsupportedError:
            raise
        except Exception as error:  # cuDNN's own failures: re-raised with the problem and the machine
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise UnsupportedError(
                [f"cuDNN could not build a plan: {first}"],
                context=f"{problem.describe()} on {here.describe()}",
                alternatives=['backend="reference" runs every valid problem'],
            ) from error
        return CudnnPlan(problem, lowered, workspace_size, device_index)


class CudnnPlan:
    """A built cuDNN plan and the little it needs per call."""

    def __init__(self, problem: AttentionProblem, lowered: Lowered, workspace_size: int, device_index: int):
        self.problem = problem
        self.lowered = lowered
        self.graph = lowered.graph
        self.workspace_size = workspace_size
        self.device_index = device_index
        self.device = torch.device("cuda", device_index)
        self._full_seq_len_q = (
            torch.full((problem.batch, 1, 1, 1), problem.s_q, dtype=torch.int32, device=self.device)
            if lowered.full_seq_len_q
            else None
        )

    def __call__(
        self,
        inputs: RunInputs,
        outputs: Mapping[str, torch.Tensor],
        *,
        stream: Any = None,
        workspace: torch.Tensor | None = None,
        handle: Any = None,
        rng_dump: torch.Tensor | None = None,
    ) -> None:
        pack: dict[int, Any] = {}
        for role, value in inputs.items():
            if isinstance(value, int):  # a dropout seed/offset given as an int: passed by value
                value = torch.full((1, 1, 1, 1), value, dtype=torch.int64)
            pack[UID[role]] = value
        for role, tensor in outputs.items():
            pack[UID[role]] = tensor
        if self._full_seq_len_q is not None:
            pack[UID["seq_len_q"]] = self._full_seq_len_q
        if self.lowered.ragged:
            self._bind_ragged_offsets(inputs, pack)
        if rng_dump is not None:
            pack[UID["rng_dump"]] = rng_dump
        if self.workspace_size and workspace is None:
            workspace = torch.empty(self.workspace_size, dtype=torch.uint8, device=self.device)
        native = cudnn_handle(self.device_index, handle)
        import cudnn

        cudnn.set_stream(native, _stream_pointer(stream, self.device_index))
        self.graph.execute(pack, workspace, handle=native)

    def _bind_ragged_offsets(self, inputs: RunInputs, pack: dict[int, Any]) -> None:
        """THD: each tensor's element offset of every sequence, from the sequence lengths."""
        starts: dict[str, torch.Tensor] = {}
        for uid, (lengths_role, token_stride) in self.lowered.ragged.items():
            start = starts.get(lengths_role)
            if start is None:
                lengths = inputs[lengths_role]
                assert isinstance(lengths, torch.Tensor)
                start = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
                torch.cumsum(lengths.reshape(-1), 0, out=start[1:])
                starts[lengths_role] = start
            pack[uid] = (start * token_stride).view(-1, 1, 1, 1)
