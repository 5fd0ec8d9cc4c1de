"""The frontend's graph tensors made before any op: ``graph.tensor`` (an input described by dims,
strides and data type, for code that runs with ``execute``) and ``graph.tensor_like`` (an input
with a template's geometry). Both are made handles of the recording: numbered, so a repeated
recording names them alike (``recording/key.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..core.dtypes import to_torch_dtype
from ..core.problem import TensorSpec, contiguous_strides, device_name
from ..errors import UnsupportedError, ValidationError
from ..recording.handles import InputHandle, TensorHandle, handle_spec, ints_or_problem
from ..recording.state import Recording
from ..runtime import interop
from .options import frontend_tensor_options


def refuse_unsupported(
    is_virtual: Any, reordering_type: Any, ragged_offset_multiplier: Any, context: str = "Graph.tensor"
) -> None:
    """``UnsupportedError`` for the descriptor flags of ``graph.tensor`` not taken here."""
    unsupported = frontend_tensor_options(is_virtual, reordering_type, ragged_offset_multiplier)
    if unsupported:
        raise UnsupportedError(unsupported, context=context)


def described_spec(
    dim: Sequence[int] | None,
    stride: Sequence[int] | None,
    data_type: Any,
    io_dtype: torch.dtype | None,
    is_pass_by_value: bool,
    name: Any,
    device: Any,
) -> TensorSpec:
    """The geometry ``graph.tensor`` describes (``io_dtype``: the graph's, for a tensor given no
    data type); every problem with the description raised together as one ``ValidationError``."""
    problems: list[str] = []
    if dim is None:
        problems.append("dim: missing; give the tensor's dims")
    shape = ints_or_problem(dim, "dim", problems) if dim is not None else None
    strides = ints_or_problem(stride, "stride", problems) if stride is not None else None
    if shape is not None and strides is None:
        strides = contiguous_strides(shape)
    if shape is not None and strides is not None and len(shape) != len(strides):
        problems.append(f"stride: {len(strides)} strides for {len(shape)} dims; give one stride per dim")
    try:
        dtype = to_torch_dtype(data_type, "data_type") or io_dtype
        if dtype is None:
            problems.append("data_type: NOT_SET; give the tensor's data type (or the graph's io_data_type)")
    except TypeError as error:
        problems.append(str(error))
    on_host = is_pass_by_value or not torch.cuda.is_available()  # pass-by-value scalars live on the host
    where = device if device is not None else ("cpu" if on_host else "cuda")
    try:
        device_str = device_name(where)
    except (RuntimeError, ValueError, TypeError):
        problems.append(f"device: {device!r} is not a device; give e.g. 'cuda:0' or 'cpu'")
    if not isinstance(name, str):
        problems.append(f"name: {name!r}; expected a string")
    if problems:
        raise ValidationError(problems, context="Graph.tensor")
    assert shape is not None and strides is not None and dtype is not None
    return TensorSpec(shape, strides, dtype, device_str)


def described(
    recording: Recording, spec: TensorSpec, name: str, is_pass_by_value: bool, uid: int | None, ragged_offset: Any
) -> InputHandle:
    """``graph.tensor``'s input of geometry ``spec``, its uid and ragged offsets set where given."""
    handle = recording.made_input(spec, name or "tensor", None)
    handle.is_pass_by_value = bool(is_pass_by_value)
    if uid is not None:
        handle.set_uid(uid)
    if ragged_offset is not None:
        handle.set_ragged_offset(ragged_offset)
    return handle


def like(recording: Recording, template: Any, name: str) -> InputHandle:
    """``Graph.tensor_like``'s input: ``template``'s geometry (a tensor, a DLPack array or a graph tensor)."""
    recording.check_open("tensor_like")
    if isinstance(template, TensorHandle):
        handle = recording.made_input(handle_spec(template), name or template.name, None)
        handle.is_pass_by_value = template.is_pass_by_value  # as the frontend copies it
        handle.strides_given = getattr(template, "strides_given", True)  # a default stays one
        return handle
    tensor = interop.as_torch(template)
    if tensor is None:
        raise ValidationError(
            [f"template: {type(template).__name__}; expected a torch tensor, a DLPack array or a graph tensor"]
        )
    handle = recording.made_input(TensorSpec.of(tensor), name or "tensor", tensor)
    recording.by_identity[id(template)] = handle  # a template given to an op later is this input
    return handle
