"""The cuDNN backend: problems lowered to cuDNN execution plans through the frontend.

Build: lower, validate, build the operation graph, create plans from the heuristics, check
support, build. cuDNN's own failures are re-raised as ``UnsupportedError`` naming the
problem, the GPU and the versions. Run: bind tensors by fixed uid and execute on the
caller's current torch stream (or ``stream=``), through a handle made once per device and
thread.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch

from .. import synthetic
from ..errors import UnsupportedError
from ..plan_store import PlanStore, entry_key, signature
from ..problem import AttentionProblem
from . import autotune as autotune_
from . import capabilities, lowering
from .base import RunInputs
from .lowering import UID, Lowered

log = logging.getLogger("cudnn_attn.cudnn")


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


def _current_stream(device_index: int) -> int:
    """The raw pointer of torch's current stream on the device (the cheap way to ask)."""
    return torch._C._cuda_getCurrentRawStream(device_index)


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

    def build(
        self,
        problem: AttentionProblem,
        *,
        autotune: bool = False,
        store: PlanStore | None = None,
        rng_dump: bool = False,
    ) -> CudnnPlan:
        """Load the plan from ``store`` when it holds one for this problem and platform;
        otherwise build it (timing every candidate when ``autotune``) and save it there."""
        device_index = _device_index(problem.device)
        here = platform(device_index)
        record = {"gpu": here.gpu, "arch": list(here.arch), "cudnn": here.cudnn, "frontend": here.frontend}
        variant = "autotuned" if autotune else "heuristic"
        key = entry_key(problem, record, variant) if store is not None and not rng_dump else None
        try:
            lowered = lowering.lower(problem, rng_dump=rng_dump)
            if key is not None and store is not None:
                plan = self._load(problem, lowered, store, key, record, device_index)
                if plan is not None:
                    return plan
            plan = self._build(problem, lowered, autotune, device_index)
        except UnsupportedError:
            raise
        except Exception as error:  # cuDNN's own failures: re-raised with the problem and the machine
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise UnsupportedError(
                [f"cuDNN could not build a plan: {first}"],
                context=f"{problem.describe()} on {here.describe()}",
                alternatives=['backend="reference" runs every valid problem'],
            ) from error
        if key is not None and store is not None:
            self._save(plan, store, key, record, variant)
        return plan

    def _build(self, problem: AttentionProblem, lowered: Lowered, autotune: bool, device_index: int) -> CudnnPlan:
        graph = _planned(lowered.graph)
        with torch.cuda.device(device_index):
            if autotune:
                probe = CudnnPlan(problem, lowered, 0, device_index)
                inputs, outputs = synthetic.run_tensors(problem)
                handle = cudnn_handle(device_index)
                self._cudnn_module().set_stream(handle, _stream_pointer(None, device_index))
                choice = autotune_.tune(
                    graph, probe.variant_pack(inputs, outputs), handle, probe.device, problem.describe()
                )
                # The tuned graph holds every candidate it built: run the winner from a fresh
                # graph that builds it alone, as the heuristic path would.
                lowered = lowering.lower(problem, rng_dump=lowered.rng_dump)
                graph = _planned(lowered.graph)
                graph.select_plan(choice.index)
                graph.build_plans()
            else:
                graph.build_plans()
                choice = autotune_.Choice(index=-1, name=_selected_name(graph))
        plan = CudnnPlan(problem, lowered, int(graph.get_workspace_size()), device_index)
        plan.choice, plan.source = choice, "built"
        return plan

    @staticmethod
    def _cudnn_module() -> Any:
        import cudnn

        return cudnn

    def _load(self, problem, lowered, store, key, record, device_index) -> CudnnPlan | None:
        entry = store.load(key, record)
        if entry is None:
            return None
        import cudnn

        try:
            graph = cudnn.pygraph()
            graph.deserialize(cudnn_handle(device_index), entry.blob)
            workspace_size = int(graph.get_workspace_size())
        except Exception as error:  # a plan this cuDNN cannot load: rebuild and overwrite it
            log.warning(
                "plan store: cannot load %s (%s); rebuilding",
                key[:12],
                str(error).splitlines()[0] if str(error) else error,
            )
            return None
        plan = CudnnPlan(problem, dataclasses.replace(lowered, graph=graph), workspace_size, device_index)
        choice = entry.header.get("choice") or {}
        plan.choice = autotune_.Choice(
            **{k: v for k, v in choice.items() if k in autotune_.Choice.__dataclass_fields__}
        )
        plan.source = "disk"
        return plan

    def _save(self, plan: CudnnPlan, store: PlanStore, key: str, record: dict, variant: str) -> None:
        try:
            blob = bytes(plan.graph.serialize(as_bytes=True))
        except Exception as error:  # some plans cannot be serialized: they are simply not stored
            log.info(
                "plan store: %s not serializable (%s)",
                plan.problem.describe(),
                str(error).splitlines()[0] if str(error) else error,
            )
            return
        header = {"problem": signature(plan.problem), "platform": record, "variant": variant, "choice": plan.choice.as_record(),
                  "describe": plan.problem.describe()}  # fmt: skip
        store.save(key, header, blob)


def _planned(graph: Any) -> Any:
    """Validate a lowered graph and rank its candidate plans (nothing built yet)."""
    import cudnn

    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    return graph


def _selected_name(graph: Any) -> str:
    try:
        return str(graph.get_plan_name_at_index(graph._plan_index))
    except Exception:
        return "heuristic"


def _native_executor(graph: Any) -> tuple | None:
    """What the frontend's ``execute(buffers, tensor_uids=...)`` resolves on every call for a
    backend plan, resolved once: its native ordered reader and the plan's index.

    These are the frontend's internals (this frontend version is part of every plan's key);
    when anything is not as expected, None sends calls through the public ``execute``.
    """
    try:
        if graph.selected_engine is not None:  # a python-engine plan: the public path handles it
            return None
        lowered = graph._lowered_graph
        schema = graph._prepare_ordered_binding_schema()
        if lowered is None or schema is None:
            return None
        config = graph._materialize_backend_plan(graph._plan_index) if graph._plans else None
        plan_index = -1 if config is None or config.cpp_index is None else config.cpp_index

        def finish(schema: Any, result: Any, workspace: Any, handle: int, index: int) -> None:
            pack = graph._finish_ordered(schema, result, workspace, None)
            lowered._execute_ordered_pack(pack.native, pack.workspace, handle, index)

        return (lowered._execute_ordered, finish, schema, graph._data_bindings, plan_index)
    except (AttributeError, TypeError, IndexError) as error:
        log.debug("native executor unavailable (%s); using the public execute", error)
        return None


class CudnnPlan:
    """A built cuDNN plan and the little it needs per call."""

    def __init__(self, problem: AttentionProblem, lowered: Lowered, workspace_size: int, device_index: int):
        self.problem = problem
        self.lowered = lowered
        self.graph = lowered.graph
        self.workspace_size = workspace_size
        self.device_index = device_index
        self.device = torch.device("cuda", device_index)
        self.choice = autotune_.Choice(index=-1, name="heuristic")
        self.source = "built"  # or "disk"
        self._workspaces: dict[int, torch.Tensor] = {}
        # Upper bounds of the integer inputs that address memory (see _within_bounds).
        self._bounds = {
            role: high
            for role, high in (
                ("seq_len_q", problem.s_q),
                ("seq_len_kv", problem.s_kv),
                ("page_table_k", problem.k.shape[0] - 1),
                ("page_table_v", problem.v.shape[0] - 1),
            )
            if getattr(problem, role) is not None
        }
        self._ordered = True  # the frontend's ordered execute: no per-call dict walk
        self._native: Any = None  # the frontend's native ordered executor, prepared on first run
        import cudnn

        self._cudnn = cudnn
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
        pack = self.variant_pack(inputs, outputs, rng_dump)
        self.execute_ordered(tuple(pack.values()), tuple(pack), stream, workspace, handle)

    def direct_uids(self, input_roles: tuple[str, ...], output_roles: tuple[str, ...]) -> tuple[int, ...] | None:
        """The uids of these roles when the caller's tensors are all the plan binds (no ragged
        offsets or constant lengths to add): then a runner can hand over buffers directly."""
        if self.lowered.ragged or self._full_seq_len_q is not None or self.problem.has_dropout or self._bounds:
            return None
        return tuple(UID[role] for role in (*input_roles, *output_roles))

    def execute_ordered(self, buffers: tuple, uids: tuple[int, ...], stream: Any, workspace: Any, handle: Any) -> None:
        """Run on ``buffers`` bound to ``uids``: the hot path under every call."""
        index = self.device_index
        stream_ptr = _current_stream(index) if stream is None else _stream_pointer(stream, index)
        if workspace is None and self.workspace_size:
            workspace = self._workspace(stream_ptr)
        native = cudnn_handle(index, handle)
        if native.stream != stream_ptr:  # cudnnSetStream is not free: only when it changes
            self._cudnn.set_stream(native, stream_ptr)
        if self._native is None:
            self._native = _native_executor(self.graph) or False
        if self._native:
            run, finish, schema, bindings, plan_index = self._native
            result = run(
                schema, buffers, uids, bindings, workspace, None, None, None, native.backend_handle, plan_index
            )
            if result is not None:  # operands the native reader could not describe: finish as the frontend does
                finish(schema, result, workspace, native.backend_handle, plan_index)
            return
        if self._ordered:
            try:
                self.graph.execute(buffers, workspace, handle=native, tensor_uids=uids)
                return
            except (TypeError, ValueError, NotImplementedError):  # a frontend without the ordered form
                self._ordered = False
        self.graph.execute(dict(zip(uids, buffers)), workspace, handle=native)

    def _workspace(self, stream_ptr: int) -> torch.Tensor:
        """One workspace per stream, reused: calls on one stream are ordered, so they can share it."""
        buffer = self._workspaces.get(stream_ptr)
        if buffer is None:
            buffer = self._workspaces[stream_ptr] = torch.empty(
                self.workspace_size, dtype=torch.uint8, device=self.device
            )
        return buffer

    def variant_pack(
        self, inputs: RunInputs, outputs: Mapping[str, torch.Tensor], rng_dump: torch.Tensor | None = None
    ) -> dict[int, Any]:
        """Every tensor the plan reads or writes, by uid."""
        if self._bounds:
            inputs = self._within_bounds(inputs)
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
        return pack

    def _within_bounds(self, inputs: RunInputs) -> dict[str, Any]:
        """Lengths and page indices clamped into range on the device (no sync, capturable):
        whatever values arrive, cuDNN never reads or writes outside the tensors. Rows with
        out-of-range values get meaningless results; the reference backend and build-time
        checks raise ValidationError for them instead."""
        safe: dict[str, Any] = dict(inputs)
        for role, high in self._bounds.items():
            value = safe.get(role)
            if isinstance(value, torch.Tensor):
                safe[role] = value.clamp(0, high)
        if self.problem.is_thd:  # packed sequences must also end inside the packed tensors
            for role, tokens in (("seq_len_q", self.problem.q.shape[0]), ("seq_len_kv", self.problem.k.shape[0])):
                lengths = safe[role].reshape(-1).to(torch.int64)
                ends = torch.cumsum(lengths, 0).clamp(max=tokens)
                starts = torch.cat([ends.new_zeros(1), ends[:-1]])
                safe[role] = (ends - starts).to(torch.int32).view(safe[role].shape)
        return safe

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
