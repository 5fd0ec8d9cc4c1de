"""``cudnn_attn.Fp8Tensor``: an E4M3 tensor and the descale that gives its real values.

What ``sdpa_fp8`` takes from a producer that already writes FP8 (an FP8 projection, an FP8
KV cache) and returns to a consumer that reads FP8 (an FP8 matmul such as
``torch._scaled_mm``, which takes the descale as ``scale_a``): the casts a 16-bit caller pays
around the FP8 kernel (reading Q, K, V in 16 bits, writing them in 8; reading O in 8, writing
it in 16) are then not paid at all. The real value of element ``i`` is
``data[i].float() * descale``, TransformerEngine's and ``torch._scaled_mm``'s convention.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .core.dtypes import dtype_name
from .errors import ValidationError, shown
from .fp8_scaling import current_scale
from .kernels.fp8_cast import E4M3, from_fp8, reciprocal_scale, to_fp8


class Fp8Tensor(NamedTuple):
    """An E4M3 tensor and the descale that gives its real values: ``data.float() * descale``.

    What ``sdpa_fp8`` takes from a producer that already writes FP8 (an FP8 projection, an FP8
    KV cache) and returns to a consumer that reads FP8 (``torch._scaled_mm`` takes the descale
    as ``scale_a``), so the 16-bit casts around the FP8 kernel are not paid. A ``NamedTuple``:
    ``data, descale = t`` unpacks it.

    Attributes:
        data: the values, ``torch.float8_e4m3fn``, any shape.
        descale: float32, one element, on data's device.

    Example:
        ```python
        import torch

        import cudnn_attn

        x = torch.randn(2, 4, 16, 64, dtype=torch.bfloat16)
        x8 = cudnn_attn.Fp8Tensor.quantise(x)  # scale 448 / max|x|
        data, descale = x8
        assert data.dtype == torch.float8_e4m3fn and descale.numel() == 1
        assert (x8.dequantise(torch.float32) - x.float()).abs().max() < 0.1 * x.abs().max()
        ```
    """

    data: torch.Tensor
    descale: torch.Tensor

    @classmethod
    def quantise(cls, x: torch.Tensor, scale: torch.Tensor | None = None) -> Fp8Tensor:
        """``x`` in E4M3: ``x * scale`` saturated to +-448, with the descale ``1 / scale``.

        Args:
            x: float16, bfloat16 or float32, any shape.
            scale: float32, one element; by default the current scale ``448 / max|x|`` (1 if
                ``x`` is all zeros), which takes one more pass over ``x``.

        Returns:
            The ``Fp8Tensor``.

        Raises:
            ValidationError: ``x`` not such a tensor (or empty, without a scale), ``scale`` not
                one float element on x's device.
        """
        _check_quantise(x, scale)
        used = current_scale(x) if scale is None else scale.detach().float().reshape(1, 1, 1, 1)
        return cls(to_fp8(x.detach(), used), reciprocal_scale(used).reshape(()))

    def dequantise(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The real values, ``data * descale`` in float32 arithmetic.

        Args:
            dtype: the result's dtype.

        Returns:
            A tensor of data's shape in ``dtype``.
        """
        return from_fp8(self.data, self.descale.reshape(1, 1, 1, 1), dtype)

    @property
    def shape(self) -> torch.Size:
        """data's shape."""
        return self.data.shape

    @property
    def device(self) -> torch.device:
        """data's device."""
        return self.data.device

    def __repr__(self) -> str:
        return f"Fp8Tensor(shape={list(self.data.shape)}, dtype={self.data.dtype}, descale={self.descale!r})"


QUANTISED_FROM = (torch.float16, torch.bfloat16, torch.float32)


def _check_quantise(x: Any, scale: Any) -> None:
    problems = []
    if not isinstance(x, torch.Tensor):
        problems.append(f"x: {type(x).__name__}; expected a torch tensor")
    elif x.dtype not in QUANTISED_FROM:
        problems.append(f"x: dtype {dtype_name(x.dtype)}; expected float16, bfloat16 or float32")
    elif scale is None and x.numel() == 0:
        problems.append(f"x: shape {list(x.shape)} is empty; its current scale needs an amax (give scale=)")
    if scale is not None:
        if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or not scale.is_floating_point():
            problems.append(f"scale: {shown(scale)}; expected a float tensor of one element")
        elif isinstance(x, torch.Tensor) and scale.device != x.device:
            problems.append(f"scale: on {scale.device}; x is on {x.device}")
    if problems:
        raise ValidationError(problems, context="Fp8Tensor.quantise")


def check_fp8_inputs(tensors: dict[str, Any]) -> None:
    """``sdpa_fp8``'s query, key and value given as ``Fp8Tensor``: all three, E4M3 data, one
    float32 descale each on its data's device, one device for all."""
    problems = []
    for name, t in tensors.items():
        if not isinstance(t, Fp8Tensor):
            kind = f"a {dtype_name(t.dtype)} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
            problems.append(
                f"{name}: {kind} beside an Fp8Tensor; pass query, key and value all as Fp8Tensor "
                "(Fp8Tensor.quantise) or all as float16/bfloat16 tensors"
            )
            continue
        data, descale = t
        if not isinstance(data, torch.Tensor) or data.dtype != E4M3:
            what = dtype_name(data.dtype) if isinstance(data, torch.Tensor) else type(data).__name__
            problems.append(f"{name}.data: {what}; expected a float8_e4m3fn tensor")
        elif not isinstance(descale, torch.Tensor) or descale.dtype != torch.float32 or descale.numel() != 1:
            what = (
                f"{dtype_name(descale.dtype)} of shape {list(descale.shape)}"
                if isinstance(descale, torch.Tensor)
                else type(descale).__name__
            )
            problems.append(f"{name}.descale: {what}; expected a float32 tensor of one element")
        elif descale.device != data.device:
            problems.append(
                f"{name}.descale: on {descale.device} but its data is on {data.device}; put them on one device"
            )
    if problems:
        raise ValidationError(problems, context="sdpa_fp8")
    devices = {name: t.data.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        where = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValidationError(
            [f"device: tensors are on several devices ({where}); put them on one device"], context="sdpa_fp8"
        )
