"""K and V of one shard in one flat buffer: one message per ring step instead of two.

The buffer holds K then V, each contiguous (``[B, H_kv, S, D]``, packed ``[T, H_kv, D]``), so every step's attention
sees the same geometry (one graph per block shape), whatever strides the caller's K/V had.
Their gradients travel in a buffer of the same shape in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedKV:
    """The geometry of K and V in a flat buffer.

    Example::

        packing = PackedKV.of(k, v)
        buffer = packing.pack(k, v)                  # one copy of each
        k_view, v_view = packing.views(buffer)       # views into it, shaped as k and v
    """

    k_shape: torch.Size
    v_shape: torch.Size

    @classmethod
    def of(cls, k: torch.Tensor, v: torch.Tensor) -> PackedKV:
        return cls(k.shape, v.shape)

    @property
    def k_numel(self) -> int:
        return self.k_shape.numel()

    @property
    def numel(self) -> int:
        return self.k_numel + self.v_shape.numel()

    def pack(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        buffer = torch.empty(self.numel, dtype=k.dtype, device=k.device)
        key, value = self.views(buffer)
        key.copy_(k)
        value.copy_(v)
        return buffer

    def views(self, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return buffer[: self.k_numel].view(self.k_shape), buffer[self.k_numel :].view(self.v_shape)

    def with_length(self, length: int, seq_dim: int = 2) -> PackedKV:
        """The same heads and dims over ``length`` positions along ``seq_dim`` (the gathered sequence)."""
        k, v = list(self.k_shape), list(self.v_shape)
        k[seq_dim] = v[seq_dim] = length
        return PackedKV(torch.Size(k), torch.Size(v))
