"""The frontend's pythonic ``cudnn.Graph(inputs=[...], outputs=[...])``: a graph whose call order
is declared by name.

Entries name tensors as the frontend does: ``"<node>::<argument>"`` (``"SDPA::q"``,
``"d_sdpa::dO"``, ``"SDPA::O"``), a name given with ``set_name``, a uid, the graph tensor itself,
or the torch tensor the op was given (the frontend's DLPack map). Positional
calls take the inputs in the declared order and return the declared outputs (one tensor, or a
tuple); a dict call fills the rest by name and returns the dict with the outputs added.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..core.roles import ROLES
from ..errors import ShapeMismatchError, ValidationError, shown
from ..recording.handles import InputHandle, OutputHandle, TensorHandle
from ..recording.state import Recording


def resolve(recording: Recording, entry: Any) -> TensorHandle | None:
    """The graph tensor ``entry`` names (None when it names none); a caller-made output
    (``dBias=``, ``rng_dump=``) resolves to the op output it receives."""
    handle = _named(recording, entry)
    if isinstance(handle, InputHandle) and handle.alias_of is not None:
        return handle.alias_of
    return handle


def _named(recording: Recording, entry: Any) -> TensorHandle | None:
    if isinstance(entry, TensorHandle):
        return entry if entry.recording is recording else None
    if isinstance(entry, int) and not isinstance(entry, bool):
        return recording.uids.get(entry)
    if not isinstance(entry, str):  # a tensor given to an op is that op's input (until the build forgets it)
        return recording.by_identity.get(id(entry)) if hasattr(entry, "__dlpack__") else None
    node_name, _, argument = entry.partition("::")
    for node in recording.nodes:
        if argument and node.name == node_name:
            for role, handle in [*node.inputs.items(), *node.outputs.items()]:
                # An output is also known by its frontend name: "SDPA::O", "SDPA::Stats", "bwd::dQ".
                if argument in (role, node.argument(role), getattr(ROLES.get(role), "output", None)):
                    return handle
    handles = [*recording.inputs, *(h for node in recording.nodes for h in node.outputs.values())]
    return next((h for h in handles if h.name == entry), None)


def mark_outputs(recording: Recording, outputs: Sequence[Any]) -> None:
    """The declared outputs are marked (``set_output(True)``): the others become virtual at build."""
    for entry in outputs:
        handle = resolve(recording, entry)
        if isinstance(handle, OutputHandle):
            handle.marked = handle.is_output = True


class DeclaredIO:
    """The declared inputs and outputs of a built graph, resolved to its tensors."""

    def __init__(self, recording: Recording, inputs: Sequence[Any], outputs: Sequence[Any], context: str):
        problems = []
        self.inputs: list[InputHandle] = []
        self.outputs: list[OutputHandle] = []
        for argument, entries, kind, into in (
            ("inputs", inputs, InputHandle, self.inputs),
            ("outputs", outputs, OutputHandle, self.outputs),
        ):
            for entry in entries:
                handle = resolve(recording, entry)
                if not isinstance(handle, kind):
                    problems.append(f"{argument}: {shown(entry)} names no {argument[:-1]} of this graph")
                elif isinstance(handle, OutputHandle) and not handle.is_output:
                    problems.append(f"{argument}: {shown(entry)} is virtual (set_output(False)); it is not produced")
                elif handle in into:
                    problems.append(f"{argument}: {shown(entry)} is declared twice")
                else:
                    into.append(handle)  # type: ignore[arg-type]
        if problems:
            raise ValidationError(problems, context=context)
        self.names = {h: _key(h, e) for h, e in zip([*self.inputs, *self.outputs], [*inputs, *outputs])}
        self.recording = recording
        # What a run returns, in order (the receivers' outputs it writes instead): known once built.
        self.returned = [
            h for node in recording.nodes for h in node.outputs.values() if h.is_output and h.receiver is None
        ]

    def call(self, run: Any, args: tuple, out: Any) -> Any:
        """``run(mapping, out)`` runs the graph on inputs by handle and returns its outputs in node order."""
        if len(args) == 1 and isinstance(args[0], Mapping):
            return self._call_with_dict(run, args[0])
        if len(args) != len(self.inputs):
            names = ", ".join(self.names[h] for h in self.inputs)
            raise ShapeMismatchError([f"inputs: {len(args)} given; this graph declares {len(self.inputs)}: {names}"])
        produced = run(dict(zip(self.inputs, args)), out)
        results = self._by_output(produced)
        return results[0] if len(results) == 1 else tuple(results)

    def _by_output(self, produced: Any, redirected: Mapping[Any, Any] | None = None) -> list[Any]:
        """The declared outputs from a run's returned ones (a caller's receiving tensor, which a
        run writes and does not return, stands for its output; ``redirected``: the run's ``out``
        by handle, which took its place)."""
        produced = produced if isinstance(produced, tuple) else (produced,)
        by_handle = dict(zip(self.returned, produced))
        redirected = redirected or {}
        return [by_handle[h] if h.receiver is None else redirected.get(h, h.receiver) for h in self.outputs]

    def _call_with_dict(self, run: Any, given: Mapping[Any, Any]) -> dict[Any, Any]:
        inputs: dict[Any, Any] = {}
        outputs: dict[Any, Any] = {}
        for key, value in given.items():
            handle = resolve(self.recording, key)
            if handle is None:
                raise ShapeMismatchError([f"{key!r}: names no tensor of this graph"])
            (outputs if isinstance(handle, OutputHandle) else inputs)[handle] = value
        produced = run(inputs, outputs or None)
        result = dict(given)
        for handle, tensor in zip(self.outputs, self._by_output(produced, outputs)):
            result.setdefault(self.names[handle], tensor)
        return result


def _key(handle: TensorHandle, entry: Any) -> str:
    """The key a dict call's result names a declared tensor by: the entry as given, or, for a
    tensor handle or a torch tensor, the graph tensor's name."""
    return entry if isinstance(entry, str) else str(entry) if isinstance(entry, int) else handle.name
