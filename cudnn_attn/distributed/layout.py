"""How a sequence is split over the ranks of a group, and the ``shard``/``unshard`` pair.

The full sequence is cut into equal chunks (``chunks.py``). ``"contiguous"``: W chunks, rank r
holds chunk r. ``"zigzag"``: 2W chunks, rank r holds chunks r and 2W-1-r, so under a causal
mask every rank has the same work (an early chunk sees few keys, its partner many). With
``cu_seqlens``, packed documents: each document cut so (``documents.py``). Equivalent plain torch::

    chunks = x.chunk(2 * W, dim=seq_dim)
    shard = torch.cat([chunks[r], chunks[2 * W - 1 - r]], dim=seq_dim)    # zigzag
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ValidationError, shown
from . import documents
from .agreement import Field, agree, dtype_field, shape_fields
from .chunks import LAYOUTS, chunk_ids, chunks_per_rank, layout_problems
from .process_group import members

__all__ = ["LAYOUTS", "join_shards", "layout_problems", "shard", "shard_of", "unshard"]


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


def shard(
    x: torch.Tensor,
    group: Any = None,
    seq_dim: int | None = None,
    layout: str = "zigzag",
    *,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's shard of the full sequence ``x`` along ``seq_dim``: a local op, no communication.

    Args:
        x: the full tensor, the same on every rank: ``[B, H, S, D]`` (or any layout with the
            sequence along ``seq_dim``), or packed documents ``[T, H, D]`` with ``cu_seqlens``.
        group: a ``torch.distributed`` group, None for the default (its rank and size decide
            the shard).
        seq_dim: the sequence dimension; None: 2, or 0 with ``cu_seqlens``.
        layout: ``"zigzag"`` (chunks r and 2W-1-r of 2W: equal causal work) or ``"contiguous"``
            (chunk r of W).
        cu_seqlens: packed documents' offsets ``[N + 1]``: each document is cut into the
            layout's chunks, so its length must be a multiple of 2W (zigzag) or W.

    Returns:
        A contiguous copy of this rank's positions (differentiable: gradients flow back into
        ``x``'s positions).

    Raises:
        ValidationError: a length the layout cannot cut evenly, a bad ``seq_dim`` or ``layout``,
            or a process group that is not initialised.

    Example:
        ```python
        # a [B, H, S, D] tensor over 2 ranks: rank 0 gets positions [0:S/4] and [3S/4:S]
        q_local = cudnn_attn.distributed.shard(q, seq_dim=2, layout="zigzag")
        q_local = cudnn_attn.distributed.shard(q_packed, cu_seqlens=cu)  # [T / W, H, D]
        ```
    """
    m = members(group, "shard")
    seq_dim = _checked(x, _default_dim(seq_dim, cu_seqlens), layout, "shard")
    if cu_seqlens is not None:
        docs = _documents(cu_seqlens, x, seq_dim, m.world, layout, "shard")
        return documents.shard_of(x, docs, m.rank, seq_dim)
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


def unshard(
    x: torch.Tensor,
    group: Any = None,
    seq_dim: int | None = None,
    layout: str = "zigzag",
    *,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The full sequence from every rank's shard ``x``: a collective (all-gather) every rank calls.

    Args:
        x: this rank's shard, as ``shard`` or ``context_parallel_sdpa`` returned it; shards
            agree in shape and dtype on every rank (checked once per signature; every rank
            raises alike).
        group: a ``torch.distributed`` group, None for the default.
        seq_dim: the sequence dimension; None: 2, or 0 with ``cu_seqlens``.
        layout: the layout the shards were cut with.
        cu_seqlens: the packed documents' offsets, as ``shard`` took them.

    Returns:
        The full tensor on every rank. Not differentiable: gathered values, for checks and outputs.

    Raises:
        ValidationError: shards that differ across ranks, bad arguments, or a process group that
            is not initialised.

    Example:
        ```python
        full = cudnn_attn.distributed.unshard(out_local, seq_dim=2)  # [B, H, S, D] on every rank
        ```
    """
    m = members(group, "unshard")
    try:
        seq_dim = _checked(x, _default_dim(seq_dim, cu_seqlens), layout, "unshard")
    except ValidationError as error:  # raised on every rank alike: the others would wait in the gather
        placeholder = [*shape_fields("x", ()), dtype_field("x", torch.uint8), Field("seq_dim", -1), Field("layout", -1)]
        agree(m, None, error.problems, [*placeholder, Field("cu_seqlens: checksum of the lengths", -1)], "unshard")
        raise
    local = []
    docs = None
    if cu_seqlens is not None:
        local = documents.cu_problems(cu_seqlens, m.world, layout, x.shape[seq_dim], None)
        if not local:
            docs = documents.Documents(documents.host_lengths(cu_seqlens), m.world, layout)
    elif x.shape[seq_dim] % chunks_per_rank(layout):
        local.append(
            f"x: shard length {x.shape[seq_dim]} (dim {seq_dim}) is odd; a zigzag shard holds two equal chunks"
        )
    fields = [*shape_fields("x", x.shape), dtype_field("x", x.dtype), Field("seq_dim", seq_dim)]
    # Shards joined in another layout on one rank: each rank would return another "full" tensor.
    fields.append(Field("layout", LAYOUTS.index(layout), lambda c: repr(LAYOUTS[c])))
    lengths = None if docs is None else docs.lengths
    fields.append(Field("cu_seqlens: checksum of the lengths", zlib.crc32(repr(lengths).encode())))
    key = ("unshard", m.group, m.world, x.shape, x.dtype, x.device, seq_dim, layout, lengths)
    agree(m, key, local, fields, "unshard")
    local_shard = x.detach().contiguous()
    gathered = [torch.empty_like(local_shard) for _ in range(m.world)]
    dist.all_gather(gathered, local_shard, group=m.group)
    if docs is not None:
        return documents.join_shards(gathered, docs, seq_dim)
    return join_shards(gathered, layout, seq_dim)


def _default_dim(seq_dim: Any, cu_seqlens: Any) -> Any:
    return seq_dim if seq_dim is not None else 0 if cu_seqlens is not None else 2


def _documents(cu: Any, x: torch.Tensor, seq_dim: int, world: int, layout: str, context: str) -> documents.Documents:
    """The documents of a whole packed ``x``, or a ``ValidationError`` naming ``cu_seqlens``."""
    problems = documents.cu_problems(cu, world, layout, None, None)
    if not problems and sum(documents.host_lengths(cu)) != x.shape[seq_dim]:
        problems.append(
            f"cu_seqlens: ends at {sum(documents.host_lengths(cu))}; x holds {x.shape[seq_dim]} tokens (dim {seq_dim})"
        )
    if problems:
        raise ValidationError(problems, context=context)
    return documents.Documents(documents.host_lengths(cu), world, layout)


def _checked(x: Any, seq_dim: Any, layout: Any, context: str) -> int:
    """``seq_dim`` made non-negative, or every problem with the arguments raised at once."""
    problems = layout_problems(layout)
    if not isinstance(x, torch.Tensor):
        problems.append(f"x: {type(x).__name__}; expected a torch tensor")
    elif x.is_nested:
        problems.append("x: a nested (ragged) tensor; give dense shards, or packed [T, H, D] ones with cu_seqlens")
    elif isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or not -x.dim() <= seq_dim < x.dim():
        problems.append(f"seq_dim: {shown(seq_dim)}; expected a dimension of x's {x.dim()}")
    if problems:
        raise ValidationError(problems, context=context)
    return seq_dim % x.dim()
