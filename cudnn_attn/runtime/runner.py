"""The run-time half of a built graph: bind the run's tensors, check them, run the plans.

Everything that can be resolved once is resolved when the graph is built: each input's
expected geometry as plain tuples, each node's inputs and outputs as slots in one list.
A steady-state call then does a few tuple comparisons per tensor and calls the plans.

The runner knows the graph's handles only as keys with a ``name`` and a ``spec`` (outputs
also ``is_output`` and ``receiver``), and its nodes only as their plans and input/output handles by role:
what a handle or a node is belongs to the recording layer above.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..core.finite import integer
from ..core.problem import TensorSpec
from ..core.shared_memory import share_elements
from ..errors import ShapeMismatchError, ValidationError, shown
from . import interop


def _device_index(device: str) -> int:
    """What ``Tensor.get_device()`` returns for tensors on ``device`` (-2: never matches, so
    such tensors always take the exact, slower check). CPU graphs take the exact check too:
    ``get_device()`` is -1 for meta and other non-CUDA devices alike."""
    d = torch.device(device)
    return d.index if d.type == "cuda" and d.index is not None else -2


def _expected(spec: TensorSpec) -> tuple:
    return (spec.shape, spec.stride, spec.dtype, _device_index(spec.device))


def _mismatch(tensor: torch.Tensor, expected: tuple, spec: Any) -> str | None:
    """None when ``tensor`` fits; the fast comparison first, the exact one only on a difference."""
    shape, stride, dtype, device = expected
    if tensor.shape == shape and tensor.stride() == stride and tensor.dtype is dtype and tensor.get_device() == device:
        return None
    return interop.geometry_mismatch(tensor, spec)


class Runner:
    def __init__(self, name: str, inputs: list[Any], nodes: list[Any], default_handle: Any):
        """``inputs``: the input handles in positional order; ``nodes``: each with ``plan``,
        ``runtime`` (inputs passed by value), and ``inputs``/``outputs`` handles by role."""
        self.name = name
        self.inputs = inputs
        self.default_handle = default_handle
        slot: dict[Any, int] = {h: i for i, h in enumerate(inputs)}
        self._expect = [_expected(h.spec) for h in inputs]
        self._specs: list[TensorSpec | None] = [h.spec for h in inputs]
        self._out_expect: dict[int, tuple] = {}
        self._steps: list[tuple[Any, dict, list, list, Any, Any]] = []
        for node in nodes:
            ins = [(role, slot[h]) for role, h in node.inputs.items()]
            outs = []
            for role, h in node.outputs.items():
                slot[h] = len(self._specs)
                self._specs.append(h.spec)
                spec: Any = h.spec
                if spec is None:  # an output the problem does not compute (an FP8 amax not asked for)
                    continue
                self._out_expect[slot[h]] = _expected(spec)
                outs.append((role, slot[h], (spec.shape, spec.stride, spec.dtype, spec.device)))
            # Plans that take the caller's buffers as they are get them in one tuple.
            direct = getattr(node.plan, "direct_uids", None)
            uids = (
                direct(tuple(r for r, _ in ins), tuple(r for r, _, _ in outs)) if direct and not node.runtime else None
            )
            slots = tuple(i for _, i in ins) + tuple(i for _, i, _ in outs) if uids else None
            self._steps.append((node.plan, dict(node.runtime), ins, outs, uids, slots))
        self._slot = slot
        self._take_outputs([h for node in nodes for h in node.outputs.values()], len(inputs))
        # Tensors whose sequences are placed by ragged offsets: bound by their memory (interop.ragged_mismatch).
        self._loose = frozenset(i for h, i in slot.items() if getattr(h, "ragged_offset", None) is not None)
        self._single = self._single_direct_step(len(inputs))

    def rebound(self, name: str, inputs: list[Any], node_outputs: list[Any], handle: Any) -> Runner:
        """This runner for another graph that recorded the same: its handles (inputs in positional
        order, every node's outputs in node order), its name and default handle."""
        runner = object.__new__(Runner)
        runner.__dict__.update(self.__dict__)
        runner.name, runner.inputs, runner.default_handle = name, inputs, handle
        slot: dict[Any, int] = {h: i for i, h in enumerate(inputs)}
        for i, h in enumerate(node_outputs, len(inputs)):
            slot[h] = i
        runner._slot = slot
        runner._take_outputs(node_outputs, len(inputs))
        return runner

    def _take_outputs(self, node_outputs: list[Any], first: int) -> None:
        """The outputs a run returns, and each run's output slots before binding: empty, but for
        those the caller's tensors receive (``dSink_token=t``), which are written and not returned."""
        self._produced = [h for h in node_outputs if h.is_output]  # what an ``out`` mapping may name
        self.outputs = [h for h in self._produced if h.receiver is None]
        self._returned = [self._slot[h] for h in self.outputs]
        self._no_outputs = [None] * (len(self._specs) - first)
        for h in node_outputs:
            if h.receiver is not None:
                self._no_outputs[self._slot[h] - first] = h.receiver

    # ---- binding ---------------------------------------------------------------------------

    def bind(self, args: Sequence[Any]) -> tuple[list[Any], Any]:
        """The run's inputs as a slot list (outputs still empty), and the kind of array given."""
        if len(args) == 1 and type(args[0]) is not torch.Tensor and isinstance(args[0], Mapping):
            args = self._ordered_from_mapping(args[0])
        elif len(args) != len(self._expect):
            names = ", ".join(h.name for h in self.inputs)
            raise ShapeMismatchError([f"inputs: {len(args)} given; this graph takes {len(self._expect)}: {names}"])
        values: list[Any] = [*args, *self._no_outputs]
        # Outputs come back as the kind of array the first input (q) is.
        kind = None if type(values[0]) is torch.Tensor else values[0]
        problems = None
        for i, (shape, stride, dtype, device) in enumerate(self._expect):
            tensor = values[i]
            if type(tensor) is not torch.Tensor:
                tensor = values[i] = interop.as_torch(tensor)
                if tensor is None:
                    problems = (problems or []) + [
                        f"{self.inputs[i].name}: {type(args[i]).__name__}; expected a tensor"
                    ]
                    continue
            # Inlined fast check: the steady state of every call.
            if (
                tensor.shape != shape
                or tensor.stride() != stride
                or tensor.dtype is not dtype
                or tensor.get_device() != device
            ):
                check = interop.ragged_mismatch if i in self._loose else interop.geometry_mismatch
                mismatch = check(tensor, self.inputs[i].spec)
                if mismatch:
                    problems = (problems or []) + [f"{self.inputs[i].name}: {mismatch}"]
        if problems:
            raise ShapeMismatchError(problems, context=self.name)
        return values, kind

    def _ordered_from_mapping(self, mapping: Mapping[Any, Any]) -> list[Any]:
        by_name = {h.name: h for h in self.inputs}
        ordered: dict[Any, Any] = {}
        problems = []
        for key, value in mapping.items():
            handle = by_name.get(key) if isinstance(key, str) else key
            if handle is None or handle not in self._slot or self._slot[handle] >= len(self.inputs):
                problems.append(f"{key}: not an input of this graph (inputs: {', '.join(by_name)})")
            else:
                ordered[handle] = value
        problems += [f"{h.name}: missing" for h in self.inputs if h not in ordered]
        if problems:
            raise ShapeMismatchError(problems, context=self.name)
        return [ordered[h] for h in self.inputs]

    def bind_out(self, values: list[Any], out: Any) -> None:
        """Place caller-given output tensors (a tensor, a sequence in output order, or a mapping)."""
        if type(out) is torch.Tensor and len(self.outputs) == 1:  # the common case, checked inline
            slot = self._returned[0]
            spec = self.outputs[0].spec
            mismatch = (
                interop.ragged_mismatch(out, spec)
                if slot in self._loose
                else _mismatch(out, self._out_expect[slot], spec)
            )
            if out.requires_grad and out.is_leaf and torch.is_grad_enabled():  # as torch's out= refuses it
                mismatch = "a leaf tensor that requires grad; an output is written in place (pass out.detach())"
            if mismatch:
                raise ShapeMismatchError([f"out[{self.outputs[0].name}]: {mismatch}"], context=self.name)
            values[slot] = out
            self._check_aliasing(values, [(self.outputs[0], out)])
            return
        if isinstance(out, Mapping):
            by_name = {h.name: h for h in self._produced}
            outputs = set(self._produced)
            pairs: list[tuple[Any, Any]] = [(by_name.get(k) if isinstance(k, str) else k, v) for k, v in out.items()]
            if any(h is None or h not in outputs for h, _ in pairs):
                raise ShapeMismatchError([f"out: keys must be output names ({', '.join(by_name)}) or handles"])
        else:
            if isinstance(out, torch.Tensor) or hasattr(out, "__dlpack__"):
                given = [out]
            elif isinstance(out, (list, tuple)):
                given = list(out)
            else:
                raise ShapeMismatchError(
                    [f"out: {type(out).__name__}; expected a tensor, a sequence of tensors or a dict name -> tensor"]
                )
            if len(given) != len(self.outputs):
                names = ", ".join(h.name for h in self.outputs)
                raise ShapeMismatchError([f"out: {len(given)} tensors for {len(self.outputs)} outputs ({names})"])
            pairs = list(zip(self.outputs, given))
        problems = []
        for handle, value in pairs:
            tensor = value if type(value) is torch.Tensor else interop.as_torch(value)
            slot = self._slot[handle]
            if tensor is None:
                mismatch = "not a tensor"
            elif not interop.writable(value):
                mismatch = "a read-only array; an output is written"
            elif tensor.requires_grad and tensor.is_leaf and torch.is_grad_enabled():
                mismatch = "a leaf tensor that requires grad; an output is written in place (pass out.detach())"
            elif slot in self._loose:
                mismatch = interop.ragged_mismatch(tensor, handle.spec)
            else:
                mismatch = _mismatch(tensor, self._out_expect[slot], handle.spec)
            if mismatch:
                problems.append(f"out[{handle.name}]: {mismatch}")
            values[slot] = tensor
        if problems:
            raise ShapeMismatchError(problems, context=self.name)
        self._check_aliasing(values, [(handle, values[self._slot[handle]]) for handle, _ in pairs])

    def _check_aliasing(self, values: list[Any], given: list[tuple[Any, torch.Tensor]]) -> None:
        """An output written in place shares no element with an input (a later node, or a kernel
        still reading it, would read the output instead) nor with another output (one of the
        two would be lost). Only tensors of one storage are compared element by element; names
        are read only for a problem found (this runs on every call with ``out=``)."""
        storages: dict[int, list[int]] = {}
        for i, t in enumerate(values[: len(self.inputs)]):
            if type(t) is torch.Tensor:
                storages.setdefault(t.untyped_storage().data_ptr(), []).append(i)
        problems = []
        for n, (handle, tensor) in enumerate(given):
            storage = tensor.untyped_storage().data_ptr()
            if storage == 0:  # no memory (meta, empty)
                continue
            for other in storages.get(storage, ()):
                peer = values[other] if other >= 0 else given[-other - 1][1]
                if share_elements(tensor, peer):
                    name = self.inputs[other].name if other >= 0 else f"out[{given[-other - 1][0].name}]"
                    problems.append(f"out[{handle.name}]: shares memory with {name}; an output needs memory of its own")
            storages.setdefault(storage, []).append(-n - 1)  # outputs as negative indices into given
        if problems:
            raise ValidationError(problems, context=self.name)

    # ---- running -----------------------------------------------------------------------------

    def run(self, values: list[Any], handle: Any, stream: Any, workspace: Any) -> list[Any]:
        if stream is not None and not _stream_like(stream):  # checked on every backend, as it is used on cuDNN's
            raise ValidationError(
                [
                    f"stream: {shown(stream)}; expected None, a CUDA stream (torch.cuda.Stream, or any object "
                    "with .cuda_stream or .ptr) or a raw stream pointer (an int >= 0)"
                ],
                context=self.name,
            )
        handle = handle if handle is not None else self.default_handle
        single = self._single
        if single is not None:  # one plan binding every slot in order: no per-step bookkeeping
            plan, uids, allocations = single
            first = len(self._expect)
            for i, (shape, stride, dtype, device) in enumerate(allocations, first):
                if values[i] is None:
                    values[i] = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            plan.execute_ordered(tuple(values), uids, stream, workspace, handle)
            return values[first:]
        for plan, runtime, ins, outs, uids, slots in self._steps:
            if uids is not None:
                for _, i, (shape, stride, dtype, device) in outs:
                    if values[i] is None:
                        values[i] = torch.empty_strided(shape, stride, dtype=dtype, device=device)
                plan.execute_ordered(tuple([values[i] for i in slots]), uids, stream, workspace, handle)
                continue
            inputs = {role: values[i] for role, i in ins}
            if runtime:
                inputs.update(runtime)
            outputs = {}
            for role, i, (shape, stride, dtype, device) in outs:
                tensor = values[i]
                if tensor is None:
                    tensor = values[i] = torch.empty_strided(shape, stride, dtype=dtype, device=device)
                outputs[role] = tensor
            plan(inputs, outputs, stream=stream, workspace=workspace, handle=handle)
        return [values[i] for i in self._returned]

    def run_trusted(self, args: Sequence[Any]) -> list[Any]:
        """Run on inputs whose geometry the caller has already proven (a key that matched):
        no checks, outputs allocated here, results as a list in output order."""
        single = self._single
        if single is None:
            return self.run([*args, *self._no_outputs], self.default_handle, None, None)
        plan, uids, allocations = single  # one plan reading the inputs in order, every output returned
        outputs = [
            torch.empty_strided(shape, stride, dtype=dtype, device=device)
            for shape, stride, dtype, device in allocations
        ]
        plan.execute_ordered((*args, *outputs), uids, None, None, self.default_handle)
        return outputs

    def run_roles(self, inputs: dict[str, Any], outputs: dict[str, Any]) -> None:
        """Run the graph's one plan on tensors named by role, unchecked: for a caller that has
        proven their geometry itself. Packed (THD) graphs use it to serve every token count
        with one graph: the plan reads the count from its inputs (``problem.for_plan``)."""
        ((plan, runtime, *_),) = self._steps
        plan({**inputs, **runtime}, outputs, stream=None, workspace=None, handle=self.default_handle)

    def _single_direct_step(self, inputs: int) -> tuple | None:
        """For ``run_trusted``: the graph's one plan, when it binds the inputs in their order and
        returns every output it writes, in order (the functional form's graphs)."""
        if len(self._steps) != 1:
            return None
        plan, _, ins, outs, uids, slots = self._steps[0]
        written = [i for _, i, _ in outs]
        every_slot = len(written) == len(self._specs) - inputs  # no output left uncomputed (an FP8 amax)
        if uids is None or not every_slot or [i for _, i in ins] != list(range(inputs)) or written != self._returned:
            return None
        return plan, uids, tuple(allocation for _, _, allocation in outs)

    def __call__(self, args: Sequence[Any], handle: Any, stream: Any, out: Any, workspace: Any) -> Any:
        values, kind = self.bind(args)
        if out is not None:
            self.bind_out(values, out)
        results = self.run(values, handle, stream, workspace)
        if kind is not None:
            results = [interop.to_kind(r, kind) for r in results]
        return results[0] if len(results) == 1 else tuple(results)


def _stream_like(stream: Any) -> bool:
    """A stream as the cuDNN path reads one: a raw pointer or an object holding one."""
    if integer(stream):
        return stream >= 0
    return any(integer(getattr(stream, name, None)) for name in ("cuda_stream", "ptr"))
