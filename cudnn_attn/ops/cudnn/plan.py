"""A built cuDNN plan and the little it needs per call: binding by uid, its workspace (taken
per run, ``workspace.py``), the device-side clamps that keep run-time lengths and page indices
inside the tensors."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...core.bounds import clamped, upper_bounds
from ...core.derived import derived
from ...core.problem import AttentionProblem
from ...core.roles import UID
from ...core.sink_fold import add_sink, add_sink_fp8, packed_sink_gradient, sink_gradient
from ...errors import UnsupportedError
from ..base import RunInputs
from . import autotune as autotune_
from . import folded_sink
from . import workspace as workspaces
from .bound_run import BoundRun
from .frontend_internals import native_executor
from .lowering import Lowered
from .platform import cudnn_handle, current_stream, stream_pointer


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
        self._bounds = upper_bounds(problem)  # integer inputs clamped on the device (core/bounds.py)
        self._ordered = True  # the frontend's ordered execute: no per-call dict walk
        self._native: Any = None  # the frontend's native ordered executor, prepared on first run
        self._empty_fix = empty_sequence_fix(problem)
        self._index: int | None = None  # a candidate other than the chosen one (at_index)
        self._prefill = problem.options.padding and problem.is_forward
        self._sink_after = folded_sink.applies(problem)  # a sink cuDNN does not take, added after the run
        self._stats_scratch: dict[int, torch.Tensor] = {}  # by stream, as workspaces
        import cudnn

        self._cudnn = cudnn
        self._constants = {
            UID[role]: torch.full((problem.batch, 1, 1, 1), length, dtype=torch.int32, device=self.device)
            for role, length in lowered.constant_lengths.items()
        }

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
        # The work around the run (clamped inputs, filled outputs, a folded sink) goes on the stream
        # cuDNN runs on: a caller's stream, or a handle's (set_stream), may not be torch's current one.
        run_stream = None if stream is None and handle is None else self._run_stream(stream, handle)
        if run_stream is None:
            self._run(inputs, outputs, stream, workspace, handle, rng_dump)
        else:
            with torch.cuda.stream(run_stream):
                self._run(inputs, outputs, stream, workspace, handle, rng_dump)

    def _run_stream(self, stream: Any, handle: Any) -> torch.cuda.Stream | None:
        """The stream the plan runs on, where it is not torch's current stream; else None."""
        if stream is None and handle is not None:
            stream = getattr(handle, "stream", None)
        if stream is None:
            return None
        pointer = stream_pointer(stream, self.device_index)
        if pointer == current_stream(self.device_index):
            return None
        return (
            stream if isinstance(stream, torch.cuda.Stream) else torch.cuda.ExternalStream(pointer, device=self.device)
        )

    def _run(
        self,
        inputs: RunInputs,
        outputs: Mapping[str, torch.Tensor],
        stream: Any,
        workspace: Any,
        handle: Any,
        rng_dump: torch.Tensor | None,
    ) -> None:
        sink = d_sink = None
        if self._sink_after:
            inputs = dict(inputs)
            sink = inputs.pop("sink_token")
            if not self.problem.is_forward:
                outputs = dict(outputs)
                d_sink = outputs.pop("grad_sink", None)
            elif "stats" not in outputs:
                outputs = {**outputs, "stats": self._scratch(stream, handle)}
        if self._prefill:
            # cuDNN leaves the rows of a sequence with no keys unwritten (O and stats), and packed
            # rows past the last sequence: 0 and -inf first, as the reference backend gives (a
            # merge by log-sum-exp then weighs such a part 0). Not where the caller's ragged
            # offsets place the rows: memory between them is the caller's, never written.
            if "o" not in self.problem.offset_tensors:
                outputs["o"].zero_()
            if "stats" in outputs and "stats" not in self.problem.offset_tensors:
                outputs["stats"].fill_(float("-inf"))
        sink_gradient_beside = None if d_sink is None else self._sink_gradient_beside(inputs, sink, d_sink)
        pack = self.variant_pack(inputs, outputs, rng_dump)
        self.execute_ordered(tuple(pack.values()), tuple(pack), stream, workspace, handle)
        if sink_gradient_beside is not None:
            sink_gradient_beside()
        elif sink is not None and self.problem.is_forward:
            if self.problem.is_fp8:
                add_sink_fp8(outputs, inputs["scale_o"], sink)  # type: ignore[arg-type]
            else:
                add_sink(outputs["o"], outputs["stats"], sink)  # type: ignore[arg-type]
        if self._empty_fix is not None:
            self._empty_fix(inputs, outputs)

    def _sink_gradient_beside(self, inputs: RunInputs, sink: Any, d_sink: torch.Tensor) -> Callable[[], None]:
        """dSink (``folded_sink``) beside the sink-less backward: call the result once cuDNN's
        backward is launched. It reads only O, dO and the stats, which the backward only reads
        too, and may overlap whatever of the backward leaves SMs free; the run's stream waits for
        it. Measured at gpt-oss's window of 128 keys, little is hidden (1.11x the sink-less step
        against 1.14x run after it): cuDNN's backward kernel holds every SM. What it reads
        besides (the FP8 descale, a packed problem's sequence starts) is made here, on the run's
        stream, before the event the side stream waits for."""
        descale = inputs["descale_o"] * inputs["descale_grad_o"] if self.problem.is_fp8 else 1.0  # type: ignore[operator]
        o, d_o, stats = inputs["o"], inputs["grad_o"], inputs["stats"]
        starts = derived(inputs["seq_len_q"], sequence_starts) if self.problem.is_thd else None  # type: ignore[arg-type]
        run_stream = torch.cuda.current_stream(self.device)
        ready = run_stream.record_event()

        def launch() -> None:
            side = sink_stream(self.device_index, run_stream)
            side.wait_event(ready)
            try:
                with torch.cuda.stream(side):
                    if starts is not None:  # packed rows; the stats [B, H, max_q, 1] by sequence and position
                        d_sink.copy_(packed_sink_gradient(o, d_o, stats, sink, starts, descale))  # type: ignore[arg-type]
                    else:
                        d_sink.copy_(sink_gradient(o, d_o, stats, sink, descale))  # type: ignore[arg-type]
            finally:  # joined even on an error: a capture never ends with a stream left forked
                run_stream.wait_stream(side)

        return launch

    # ---- bound runs: fixed tensors bound once (a serving step's tables), the rest per call ---------

    @property
    def bounds(self) -> Mapping[str, int]:
        """The largest valid value of each integer input that addresses memory, by role."""
        return self._bounds

    @property
    def constants(self) -> Mapping[int, torch.Tensor]:
        """Inputs the plan binds itself (constant lengths), by uid."""
        return self._constants

    @property
    def fills_outputs(self) -> bool:
        """Whether a run fills O and the stats first (rows cuDNN leaves unwritten)."""
        return self._prefill and not {"o", "stats"} & set(self.problem.offset_tensors)

    @property
    def empty_fix(self) -> Callable[[RunInputs, Mapping[str, torch.Tensor]], None] | None:
        """What a run sets right after cuDNN for empty sequences (``empty_sequence_fix``)."""
        return self._empty_fix

    def bind(
        self,
        fixed: Mapping[str, torch.Tensor],
        varying: tuple[str, ...],
        output_roles: tuple[str, ...],
        *,
        whole_sequences: bool = False,
        no_empty_sequences: bool = False,
    ) -> BoundRun | None:
        """This plan bound to ``fixed`` tensors by role (``bound_run.py``), or None where a run
        has per-call work a binding cannot hold: packed (THD) or ragged tensors, dropout, a sink
        added after cuDNN, a bounded input among the ``varying`` ones."""
        p = self.problem
        if self.lowered.ragged or p.is_thd or p.offset_tensors or p.has_dropout or self._sink_after:
            return None
        if any(role not in fixed for role in self._bounds):
            return None
        return BoundRun(
            self,
            fixed,
            varying,
            output_roles,
            whole_sequences=whole_sequences,
            no_empty_sequences=no_empty_sequences,
        )

    def direct_uids(self, input_roles: tuple[str, ...], output_roles: tuple[str, ...]) -> tuple[int, ...] | None:
        """The uids of these roles when the caller's tensors are all the plan binds (no ragged
        offsets or constant lengths to add): then a runner can hand over buffers directly."""
        if self.lowered.ragged or self._constants or self.problem.has_dropout or self._bounds or self._sink_after:
            return None
        return tuple(UID[role] for role in (*input_roles, *output_roles))

    @property
    def engine(self) -> str:
        """The engine this plan runs, as cuDNN names it (its id and knobs where the frontend names them)."""
        choice = self.choice
        if choice.name and choice.name != "heuristic":
            return choice.name
        return f"eng{choice.engine_id}" if choice.engine_id is not None else "heuristic (engine not reported)"

    def execute_ordered(self, buffers: tuple, uids: tuple[int, ...], stream: Any, workspace: Any, handle: Any) -> None:
        """Run on ``buffers`` bound to ``uids``: the hot path under every call."""
        try:  # costs nothing unless raised (zero-cost exceptions); inline: no extra call per run
            index = self.device_index
            if stream is None and handle is not None:  # a handle's stream (set_stream), as the frontend runs
                stream = getattr(handle, "stream", None)
            current = current_stream(index)
            stream_ptr = current if stream is None else stream_pointer(stream, index)
            if workspace is None and self.workspace_size:
                workspace = workspaces.workspace(self.workspace_size, index, stream_ptr, current)
            native = cudnn_handle(index, handle)
            if native.stream != stream_ptr:  # cudnnSetStream is not free: only when it changes
                self._cudnn.set_stream(native, stream_ptr)
            if self._index is not None:  # the frontend's execute_plan_at_index: a candidate plan, run as it runs it
                self.graph.execute_plan_at_index(dict(zip(uids, buffers)), workspace, self._index, handle=native)
                return
            if self._native is None:
                self._native = native_executor(self.graph) or False
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
        except torch.OutOfMemoryError:
            raise  # a workspace torch could not allocate: torch's own error, unchanged
        except Exception as error:
            if autotune_.is_out_of_memory(error):  # cuDNN's own failed allocation, as torch would say it
                raise torch.OutOfMemoryError(
                    f"{self.problem.describe()}: cuDNN ran out of GPU memory running its plan ({error}); "
                    "the plan stays cached and runs once memory is free"
                ) from error
            raise

    # ---- the candidate plans (the frontend's plan helpers) --------------------------------------

    def plan_count(self) -> int:
        """Candidate plans cuDNN ranked for this problem (a plan loaded from the store: that one)."""
        return max(self._candidates(), 1)

    def _candidates(self) -> int:
        """cuDNN's ranked candidates, 0 for a plan loaded from the store: a deserialised graph
        counts its one plan but addresses none by index ("Plan index 0 is invalid")."""
        return 0 if self.source == "disk" else int(self.graph.get_execution_plan_count())

    def plan_name_at(self, index: int) -> str:
        if not self._candidates():
            return self.engine  # loaded from the store: its one plan
        try:
            return str(self.graph.get_plan_name_at_index(index))
        except RuntimeError:  # the frontend names built candidates only: build this one first
            pass
        self._build_candidate(index)
        return str(self.graph.get_plan_name_at_index(index))

    def _build_candidate(self, index: int) -> None:
        """Build candidate ``index``; one cuDNN cannot build here is an ``UnsupportedError`` (the
        frontend's ``cudnnGraphNotSupportedError`` kind), never a bare ``RuntimeError``."""
        with torch.cuda.device(self.device_index):
            try:
                self.graph.build_plan_at_index(index)
            except Exception as error:
                raise UnsupportedError(
                    [f"plan index {index}: cuDNN could not build this candidate on this GPU ({error})"],
                    context=self.problem.describe(),
                ) from error

    def at_index(self, index: int) -> CudnnPlan:
        """This plan running candidate ``index`` (built here on first use) instead of the chosen one."""
        if not self._candidates():
            return self  # loaded from the store: its one plan
        plan = copy.copy(self)
        plan._index, plan._native = index, None
        self._build_candidate(index)
        plan.workspace_size = int(self.graph.get_workspace_size_plan_at_index(index))
        return plan

    @property
    def nbytes(self) -> int:
        """Device memory this plan holds (its constant inputs and sink scratch), for cache bounds;
        workspaces are taken per run (``workspace.py``), never held by a plan."""
        held = [*self._constants.values(), *self._stats_scratch.values()]
        return sum(t.numel() * t.element_size() for t in held)

    def _scratch(self, stream: Any, handle: Any) -> torch.Tensor:
        """The folded sink's log-sum-exp buffer when the caller wants none: one per stream."""
        if stream is None and handle is not None:
            stream = getattr(handle, "stream", None)
        key = current_stream(self.device_index) if stream is None else stream_pointer(stream, self.device_index)
        buffer = self._stats_scratch.get(key)
        if buffer is None:
            buffer = self._stats_scratch[key] = folded_sink.stats_scratch(self.problem, self.device)
        return buffer

    def variant_pack(
        self, inputs: RunInputs, outputs: Mapping[str, torch.Tensor], rng_dump: torch.Tensor | None = None
    ) -> dict[int, Any]:
        """Every tensor the plan reads or writes, by uid."""
        if self._bounds:
            inputs = clamped(self.problem, inputs, self._bounds, outputs)
        pack: dict[int, Any] = {}
        for role, value in inputs.items():
            if isinstance(value, int):  # a dropout seed/offset given as an int: passed by value
                value = torch.full((1, 1, 1, 1), value, dtype=torch.int64)
            pack[UID[role]] = value
        for role, tensor in outputs.items():
            pack[UID[role]] = tensor
        pack.update(self._constants)
        if self.lowered.ragged:
            self._bind_ragged_offsets(inputs, pack)
        if rng_dump is not None:
            pack[UID["rng_dump"]] = rng_dump
        return pack

    def _bind_ragged_offsets(self, inputs: RunInputs, pack: dict[int, Any]) -> None:
        """THD: each tensor's element offset of every sequence, from the sequence lengths;
        derived once per content of the lengths (``core.derived``), not once per layer."""
        starts: dict[str, torch.Tensor] = {}  # one prefix sum per lengths tensor, even uncached
        for uid, (lengths_role, token_stride) in self.lowered.ragged.items():
            start = starts.get(lengths_role)
            if start is None:
                lengths = inputs[lengths_role]
                assert isinstance(lengths, torch.Tensor)
                start = starts[lengths_role] = derived(lengths, sequence_starts)
            pack[uid] = derived(start, element_offsets, token_stride)


_SINK_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}


def sink_stream(device_index: int, run_stream: torch.cuda.Stream) -> torch.cuda.Stream:
    """The side stream for sink gradients beside ``run_stream``, one per run stream: runs on two
    streams (two threads, or a CUDA graph captured beside eager work) never wait on each other
    through it. High priority, so its blocks are dispatched first as SMs free up."""
    key = (device_index, run_stream.cuda_stream)
    stream = _SINK_STREAMS.get(key)
    if stream is None:
        stream = _SINK_STREAMS[key] = torch.cuda.Stream(device_index, priority=-1)
    return stream


def sequence_starts(lengths: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sum with the total appended: [0, l0, l0 + l1, ..., sum]."""
    start = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.reshape(-1), 0, out=start[1:])
    return start


def element_offsets(start: torch.Tensor, token_stride: int) -> torch.Tensor:
    """Sequence starts in tokens -> in elements of one packed tensor, shaped as cuDNN binds them."""
    return (start * token_stride).view(-1, 1, 1, 1)


def empty_sequence_fix(p: AttentionProblem) -> Any:
    """What cuDNN 9.19 writes wrong for an empty sequence, set right after the run (on the device,
    no sync); None where nothing needs it. Found by the GPU fuzz campaign on an H100:

    - a forward with S_q = 1 writes row 0 of a sequence whose seq_len_q is 0 (S_q >= 2 leaves it 0);
    - a backward leaves dQ, dK and dV of a sequence whose seq_len_kv is 0 as garbage (up to 1e37).
    Dense (4-D) tensors only: an empty sequence has no rows in a packed (THD) tensor.
    """
    if not p.options.padding or p.is_thd:
        return None
    # Rows are found by batch index below: not where the caller's ragged offsets put them.
    ragged = set(p.offset_tensors)
    if p.is_forward and p.s_q == 1 and p.seq_len_q is not None and not ragged & {"o", "stats"}:

        def forward_fix(inputs: RunInputs, outputs: Mapping[str, torch.Tensor]) -> None:
            empty = (inputs["seq_len_q"] <= 0).view(-1, 1, 1, 1)  # type: ignore[union-attr]
            outputs["o"].masked_fill_(empty, 0)
            if "stats" in outputs:
                outputs["stats"].masked_fill_(empty, float("-inf"))

        return forward_fix
    if not p.is_forward and p.seq_len_kv is not None and not ragged & {"grad_q", "grad_k", "grad_v"}:

        def backward_fix(inputs: RunInputs, outputs: Mapping[str, torch.Tensor]) -> None:
            empty = (inputs["seq_len_kv"] <= 0).view(-1, 1, 1, 1)  # type: ignore[union-attr]
            for role in ("grad_q", "grad_k", "grad_v"):
                outputs[role].masked_fill_(empty, 0)

        return backward_fix
    return None
