"""torch dtypes as the frontend's ``cudnn.data_type`` members."""

from __future__ import annotations

from typing import Any

import torch

_NAMES = {
    torch.float16: "HALF",
    torch.bfloat16: "BFLOAT16",
    torch.float32: "FLOAT",
    torch.int32: "INT32",
    torch.int64: "INT64",
    torch.float8_e4m3fn: "FP8_E4M3",
    torch.float8_e5m2: "FP8_E5M2",
    torch.bool: "BOOLEAN",
}


def cudnn_dtype(dtype: torch.dtype) -> Any:
    import cudnn

    return getattr(cudnn.data_type, _NAMES[dtype])
