"""What a graph recorded, as a hashable key (see ``reuse.py`` for its use).

Tensors enter the key by geometry (shape, strides, dtype, device) and by which earlier
argument they are (aliasing), never by value or identity, so the next call's fresh tensors
of the same geometry give the same key. Scalars enter with their type (``True``, ``1`` and
``1.0`` are equal in Python but not to validation). Anything else (arrays of other
libraries, tensor subclasses, handles of other graphs) makes the recording unkeyed: it is
built in full, as always.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Mapping
from typing import Any, Protocol

import torch

from ..runtime import backend_choice
from .handles import InputHandle, OutputHandle
from .node import Node


class Recorded(Protocol):
    """What a key reads of its recording (``state.Recording``, which imports this module)."""

    @property
    def by_identity(self) -> dict[int, InputHandle]: ...

    @property
    def made(self) -> list[InputHandle]: ...

    @property
    def nodes(self) -> list[Node]: ...


_SCALARS = frozenset((bool, int, float, str))


class _UnkeyedError(Exception):
    pass


def _offsets(handle: InputHandle | OutputHandle) -> int | None:
    """Which made tensor holds ``handle``'s ragged offsets (they are always made handles)."""
    offsets = handle.ragged_offset
    return None if offsets is None else offsets.made_index


def _scale_key(value: Any) -> Hashable:
    """A torch tensor ``attn_scale`` is read by value when the graph is built: keyed by its value
    (a key by geometry handed the next graph this one's scale). One on a GPU is not keyed, as
    reading it on every call would sync."""
    if (
        type(value) is torch.Tensor
        and value.device.type == "cpu"
        and value.numel() == 1
        and not (value.is_complex() or value.dtype == torch.bool)  # refused at build: never adopted
    ):
        # The dtype too: the build checks the tensor, so two scales of one value may differ in verdict.
        return ("scale", value.dtype, float(value.detach()))
    raise _UnkeyedError


class RecordingKey:
    """Grows by one part per recorded op; ``tensors`` are the distinct tensors seen, in order."""

    def __init__(self, options: tuple):
        self.parts: list[Hashable] = [options]
        self.keyed = True
        self.tensors: list[torch.Tensor] = []
        self._slots: dict[int, int] = {}  # id(tensor) -> index in tensors

    def add(self, recording: Recorded, method: str, names: tuple[str, ...], arguments: Mapping[str, Any]) -> None:
        """One op's part: its method, its arguments (``names``, in its table's order), its mask keywords."""
        if not self.keyed:
            return
        try:
            of = self._of
            # None is the commonest argument (unused keywords): kept inline, as are mask scalars.
            part = (
                method,
                tuple([a if (a := arguments[n]) is None else of(a, recording) for n in names]),
                tuple(
                    [
                        (
                            k,
                            (type(v), v)
                            if type(v) in _SCALARS
                            else _scale_key(v)
                            if k == "attn_scale"
                            else of(v, recording),
                        )
                        for k, v in arguments["mask"].items()
                    ]
                ),
            )
        except _UnkeyedError:
            self.keyed = False
            return
        self.parts.append(part)

    def slot(self, tensor: Any) -> int | None:
        """Which distinct tensor of the recording ``tensor`` is (None: not an argument)."""
        return self._slots.get(id(tensor))

    def key(self, recording: Recorded) -> tuple | None:
        """The whole recording's key, with the handles' settings as they are now, and the backend
        an enclosing ``cudnn_attn.backend(...)`` block chose (a build adopts no other's); None if unkeyed."""
        if not self.keyed:
            return None
        made = tuple(
            [
                (h.name, h.spec, self.slot(h.template) if h.template is not None else None, _offsets(h))
                for h in recording.made
            ]
        )
        outputs = tuple(
            [
                (h.name, h.is_output, h.dim, h.stride, h.dtype, _offsets(h))
                for node in recording.nodes
                for h in node.outputs.values()
            ]
        )
        return (*self.parts, made, outputs, backend_choice.chosen())

    def forget(self) -> None:
        """Drop the tensors (the graph is built: it must not keep its first call's tensors alive)."""
        self.tensors = []
        self._slots = {}

    def _of(self, value: Any, recording: Recorded) -> Hashable:
        kind = type(value)
        if kind is torch.Tensor:
            ident = id(value)
            if recording.by_identity:
                made = recording.by_identity.get(ident)
                if made is not None:
                    return ("made", made.made_index)
            slot = self._slots.get(ident)
            if slot is not None:
                return ("tensor", slot)
            slot = self._slots[ident] = len(self.tensors)
            self.tensors.append(value)
            return ("tensor", slot, value.shape, value.stride(), value.dtype, value.device)
        if value is None:
            return None
        if kind in _SCALARS:
            return (kind, value)
        if kind is tuple:
            return ("tuple", *[self._of(v, recording) for v in value])
        if isinstance(value, (InputHandle, OutputHandle)) and value.recording is recording:
            return ("made", value.made_index) if isinstance(value, InputHandle) else ("output", value.index)
        if isinstance(value, (torch.dtype, enum.Enum)):
            return (kind, value)
        raise _UnkeyedError
