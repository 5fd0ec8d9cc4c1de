"""``cudnn_attn.core.dtypes``: the frontend's data-type names, mapped to torch dtypes.

The enum is public as ``cudnn_attn.data_type``. Every place that takes a data type accepts a
member of this enum, a torch dtype, the real frontend's ``cudnn.data_type`` member, or its name
as a string.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
from torch import dtype as TorchDtype


class data_type(enum.Enum):  # noqa: N801 - the frontend's spelling
    """The cuDNN frontend's data types, by the frontend's member names, mapped to torch dtypes.

    A member's value is the torch dtype's name (``HALF`` is ``"float16"``); ``.torch`` gives the
    dtype. Every place that takes a data type accepts a member, a torch dtype, the frontend's
    own ``cudnn.data_type`` member or its name. Attention takes ``HALF``, ``BFLOAT16``,
    ``FLOAT``, ``FP8_E4M3`` and ``FP8_E5M2`` data, ``INT32``/``INT64`` lengths and offsets; the
    members with no torch dtype (``INT8x4``, ``FP4_E2M1``, ...) are refused where one is needed.

    Example:
        ```python
        import torch

        import cudnn_attn

        assert cudnn_attn.data_type.BFLOAT16.torch is torch.bfloat16
        assert cudnn_attn.data_type.from_torch(torch.float16) is cudnn_attn.data_type.HALF
        ```
    """

    HALF = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT = "float32"
    DOUBLE = "float64"
    FP8_E4M3 = "float8_e4m3fn"
    FP8_E5M2 = "float8_e5m2"
    FP8_E8M0 = "float8_e8m0fnu"
    INT8 = "int8"
    INT32 = "int32"
    INT64 = "int64"
    BOOLEAN = "bool"
    UINT8 = "uint8"
    INT8x4 = "int8x4"
    UINT8x4 = "uint8x4"
    INT8x32 = "int8x32"
    FAST_FLOAT_FOR_FP8 = "fast_float_for_fp8"
    FP8_E5M3 = "float8_e5m3"
    FP4_E2M1 = "float4_e2m1"
    INT4 = "int4"
    NOT_SET = "not_set"

    @property
    def torch(self) -> TorchDtype | None:
        """The torch dtype (None for NOT_SET); ``TypeError`` for a member torch has no dtype for."""
        if self is data_type.NOT_SET:
            return None
        if self in _NO_TORCH_DTYPE:
            raise TypeError(f"data_type.{self.name} has no torch dtype: {_NO_TORCH_DTYPE[self]}")
        return getattr(torch, self.value)

    @classmethod
    def from_torch(cls, dtype: TorchDtype) -> data_type:
        """The member standing for ``dtype``; ``ValueError`` for a dtype no member stands for."""
        member = cls(str(dtype).removeprefix("torch."))
        if member in _NO_TORCH_DTYPE:
            raise ValueError(f"{dtype} is not a data_type member's torch dtype")
        return member


# What torch lacks for each member it cannot hold (the frontend's own torch mapping leaves these
# out too, except FP4_E2M1, which it pairs with float4_e2m1fn_x2: two values a byte, so a tensor's
# dims would not be the graph's).
_NO_TORCH_DTYPE = {
    data_type.INT8x4: "a cuDNN vectorised layout (4 int8 values an element)",
    data_type.UINT8x4: "a cuDNN vectorised layout (4 uint8 values an element)",
    data_type.INT8x32: "a cuDNN vectorised layout (32 int8 values an element)",
    data_type.FAST_FLOAT_FOR_FP8: "a cuDNN compute mode for FP8 matmuls, not a storage type",
    data_type.FP8_E5M3: "torch has no float8_e5m3",
    data_type.FP4_E2M1: "torch holds FP4 only packed two values a byte (float4_e2m1fn_x2)",
    data_type.INT4: "the frontend pairs no torch dtype with it",
}
# The frontend spells some names in mixed case (INT8x4): names are matched without regard to case.
_BY_NAME = {name.upper(): member for name, member in data_type.__members__.items()}


_ALIASES = {
    "half": "float16",
    "fp16": "float16",
    "bf16": "bfloat16",
    "float": "float32",
    "fp32": "float32",
    "double": "float64",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "int": "int32",
    "boolean": "bool",
}

HALF_IO = (torch.float16, torch.bfloat16)  # the flash kernels' inputs
# float32 runs on cuDNN's composite implementation (where this GPU and cuDNN serve it).
FLOATING_IO = (*HALF_IO, torch.float32)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def to_torch_dtype(value: Any, argument: str = "data_type") -> torch.dtype | None:
    """Normalise any accepted spelling of a data type to a torch dtype (None for NOT_SET/None).

    Takes a ``cudnn_attn.data_type`` member, the real frontend's ``cudnn.data_type`` member (by its
    name), a torch dtype, or a name as a string. Raises ``TypeError`` naming ``argument`` for
    anything else and for a member with no torch dtype (``data_type.INT8x4``, ...); callers turn
    that into a ``ValidationError`` line.
    """
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        return value
    name = value.name if isinstance(value, data_type) else getattr(value, "name", value)
    if isinstance(name, str):
        key = name.lower().removeprefix("torch.")
        member = _BY_NAME.get(key.upper())
        if member is not None and member in _NO_TORCH_DTYPE:
            raise TypeError(
                f"{argument}: data_type.{member.name} has no torch dtype ({_NO_TORCH_DTYPE[member]}); "
                f"use one of {_torch_member_names()} or a torch dtype"
            )
        if member is not None:
            return member.torch
        key = _ALIASES.get(key, key)
        dtype = getattr(torch, key, None)
        if isinstance(dtype, torch.dtype):
            return dtype
    raise TypeError(
        f"{argument}: {value!r} is not a data type; use a cudnn_attn.data_type member "
        f"({_torch_member_names()}) or a torch dtype"
    )


def to_torch_dtype_or_problem(value: Any, argument: str, problems: list[str]) -> torch.dtype | None:
    """``to_torch_dtype``, its problem appended to ``problems`` (None then) instead of raised."""
    try:
        return to_torch_dtype(value, argument)
    except TypeError as error:
        problems.append(str(error))
        return None


def _torch_member_names() -> str:
    return ", ".join(m.name for m in data_type if m not in _NO_TORCH_DTYPE)


def dtype_name(dtype: torch.dtype | None) -> str:
    return "unset" if dtype is None else str(dtype).removeprefix("torch.")
