"""The reference backend's dropout: its own counter-free RNG, seeded and repeatable.

The keep-mask is a pure function of (seed, offset, shape): forward and backward of the
same node draw the same mask. It does not reproduce cuDNN's Philox stream; GPU tests
compare against cuDNN by feeding cuDNN's dumped mask to the reference instead.
"""

from __future__ import annotations

import torch

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads nearby (seed, offset) pairs apart


def keep_mask(seed: int, offset: int, shape: tuple[int, ...], p: float, device) -> torch.Tensor:
    """Boolean mask of ``shape``: True (kept) with probability 1 - p."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed((int(seed) * _MIX + int(offset)) % (2**63 - 1))
    draws = torch.rand(shape, generator=generator, dtype=torch.float32)
    return (draws >= p).to(device)


def scalar(value: int | torch.Tensor | None, default: int = 0) -> int:
    """An int seed/offset given as an int or a one-element tensor."""
    if value is None:
        return default
    if isinstance(value, torch.Tensor):
        return int(value.reshape(-1)[0].item())
    return int(value)
