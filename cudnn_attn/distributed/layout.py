"""How a sequence is split over the ranks of a group, and the ``shard``/``unshard`` pair.

The full sequence is cut into equal chunks. ``"contiguous"``: W chunks, rank r holds chunk r.
``"zigzag"``: 2W chunks, rank r holds chunks r and 2W-1-r, so under a causal mask every rank
has the same work (an early chunk sees few keys, its partner many). Equivalent plain torch::

    chunks = x.chunk(2 * W, dim=seq_dim)
    shard = torch.cat([chunks[r], chunks[2 * W - 1 - r]], dim=seq_dim)    # zigzag
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..errors import ValidationError, shown
from .agreement import Field, agree, dtype_field, shape_fields
from .process_group import collective_device, members

LAYOUTS = ("zigzag", "contiguous")


def chunks_per_rank(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def chunk_ids(layout: str, rank: int, world: int) -> tuple[int, ...]:
    """The chunks of the full sequence ``rank`` holds, in the order its shard holds them."""
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


def layout_problems(layout: Any) -> list[str]:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        return [f"layout: {shown(layout)}; expected one of {', '.join(map(repr, LAYOUTS))}"]
    return []


def join_shards(shards: list[torch.Tensor], layout: str, seq_dim: int) -> torch.Tensor:
    """The full sequence from every rank's shard (rank order): the local half of ``unshard``."""
    world = len(shards)
    per_rank = chunks_per_rank(layout)
    placed: list[torch.Tensor | None] = [None] * (per_rank * world)
    for rank, piece in enumerate(shards):
        for chunk, part in zip(chunk_ids(layout, rank, world), piece.chunk(per_rank, dim=seq_dim)):
            placed[chunk] = part
    return torch.cat(placed, dim=seq_dim)  # type: ignore[arg-type]


def shard_of(x: torch.Tensor, layout: str, rank: int, world: int, seq_dim: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the full ``x`` (a fresh contiguous tensor; no checks)."""
    size = x.shape[seq_dim] // (chunks_per_rank(layout) * world)
    parts = [x.narrow(seq_dim, chunk * size, size) for chunk in chunk_ids(layout, rank, world)]
    return torch.cat(parts, dim=seq_dim).contiguous()


def shard(x: torch.Tensor, group: Any = None, seq_dim: int = 2, layout: str = "zigzag") -> torch.Tensor:
    """This rank's shard of the full sequence ``x`` along ``seq_dim``: a local op, no communication.

    Returns a contiguous copy (differentiable: gradients flow back into ``x``'s positions).

    Example, a ``[B, H, S, D]`` tensor over 2 ranks: rank 0 gets positions ``[0:S/4] + [3S/4:S]``::

        q_local = cudnn_attn.distributed.shard(q, seq_dim=2, layout="zigzag")
    """
    m = members(group, "shard")
    seq_dim = _checked(x, seq_dim, layout, "shard")
    parts = chunks_per_rank(layout) * m.world
    if x.shape[seq_dim] % parts:
        raise ValidationError(
            [
                f"x: sequence length {x.shape[seq_dim]} (dim {seq_dim}) does not split into {parts} equal chunks "
                f"({m.world} ranks, layout={layout!r}); pad the sequence to a multiple of {parts}"
            ],
            context="shard",
        )
    return shard_of(x, layout, m.rank, m.world, seq_dim)


def unshard(x: torch.Tensor, group: Any = None, seq_dim: int = 2, layout: str = "zigzag") -> torch.Tensor:
    """The full sequence from every rank's shard ``x``: a collective (all-gather) every rank calls.

    Shards must agree in shape and dtype on every rank (checked once per signature; every rank
    raises alike). Not differentiable: it returns gathered values, for checks and outputs.

    Example, the inverse of ``shard``::

        full = cudnn_attn.distributed.unshard(out_local, seq_dim=2)   # [B, H, S, D] on every rank
    """
    m = members(group, "unshard")
    seq_dim = _checked(x, seq_dim, layout, "unshard")
    local = []
    if x.shape[seq_dim] % chunks_per_rank(layout):
        local.append(
            f"x: shard length {x.shape[seq_dim]} (dim {seq_dim}) is odd; a zigzag shard holds two equal chunks"
        )
    fields = [*shape_fields("x", x.shape), dtype_field("x", x.dtype), Field("seq_dim", seq_dim)]
    key = ("unshard", m.group, m.world, x.shape, x.dtype, x.device, seq_dim, layout)
    agree(m, key, local, fields, collective_device(m, x), "unshard")
    local_shard = x.detach().contiguous()
    gathered = [torch.empty_like(local_shard) for _ in range(m.world)]
    dist.all_gather(gathered, local_shard, group=m.group)
    return join_shards(gathered, layout, seq_dim)


def _checked(x: Any, seq_dim: Any, layout: Any, context: str) -> int:
    """``seq_dim`` made non-negative, or every problem with the arguments raised at once."""
    problems = layout_problems(layout)
    if not isinstance(x, torch.Tensor):
        problems.append(f"x: {type(x).__name__}; expected a torch tensor")
    elif isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or not -x.dim() <= seq_dim < x.dim():
        problems.append(f"seq_dim: {shown(seq_dim)}; expected a dimension of x's {x.dim()}")
    if problems:
        raise ValidationError(problems, context=context)
    return seq_dim % x.dim()
