"""An ``AttentionProblem`` back from its canonical JSON form (``plan_store.signature``'s inverse),
for graphs serialized with ``serialize()`` and read back with ``deserialize()``.

Every field is rebuilt by its declared type: nested frozen dataclasses, enums by value, torch
dtypes by name, tuples from lists; a field the data lacks takes its default.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from typing import Any

import torch

from .problem import AttentionProblem, TensorSpec
from .score_mod import Expr, ScoreModifier

# Names the fields' annotations use that their modules import for type checking only.
_NAMES = {"TensorSpec": TensorSpec, "ScoreModifier": ScoreModifier, "Expr": Expr}


def problem_from_signature(data: dict[str, Any]) -> AttentionProblem:
    """The problem ``signature(problem)`` described; ``ValueError`` for data that is not one."""
    try:
        return _dataclass(AttentionProblem, data)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"not a serialized attention problem ({error})") from None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, localns=_NAMES)


def _dataclass(cls: type, data: dict[str, Any]) -> Any:
    hints = _hints(cls)
    values = {f.name: _value(hints[f.name], data[f.name]) for f in dataclasses.fields(cls) if f.name in data}
    return cls(**values)


def _value(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):  # Optional[X]: the one non-None member
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(members) > 1:  # a number that may be an int or a float: as JSON gave it
            return value
        return _value(members[0], value)
    if origin is tuple:
        args = typing.get_args(hint)
        item = args[0] if args else Any
        return tuple(_value(item, v) for v in value)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _dataclass(hint, value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if hint is torch.dtype:
        dtype = getattr(torch, str(value).removeprefix("torch."))
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{value!r} is not a torch dtype")
        return dtype
    return value
