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
    HALF = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT = "float32"
    DOUBLE = "float64"
    FP8_E4M3 = "float8_e4m3fn"
    FP8_E5M2 = "float8_e5m2"
    INT32 = "int32"
    INT64 = "int64"
    BOOLEAN = "bool"
    UINT8 = "uint8"
    NOT_SET = "not_set"

    @property
    def torch(self) -> TorchDtype | None:
        if self is data_type.NOT_SET:
            return None
        return getattr(torch, self.value)

    @classmethod
    def from_torch(cls, dtype: TorchDtype) -> data_type:
        name = str(dtype).removeprefix("torch.")
        return cls(name)


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

    Raises ``TypeError`` naming ``argument`` for anything else; callers turn that into a
    ``ValidationError`` line.
    """
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, data_type):
        return value.torch
    name = getattr(value, "name", value)  # the real frontend's enum members carry .name
    if isinstance(name, str):
        key = name.lower().removeprefix("torch.")
        if key == "not_set":
            return None
        if key.upper() in data_type.__members__:
            return data_type[key.upper()].torch
        key = _ALIASES.get(key, key)
        dtype = getattr(torch, key, None)
        if isinstance(dtype, torch.dtype):
            return dtype
    raise TypeError(
        f"{argument}: {value!r} is not a data type; use a cudnn_attn.data_type member "
        f"({', '.join(m.name for m in data_type)}) or a torch dtype"
    )


def dtype_name(dtype: torch.dtype | None) -> str:
    return "unset" if dtype is None else str(dtype).removeprefix("torch.")
