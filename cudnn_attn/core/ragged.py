"""The caller's ragged offsets (the frontend's ``tensor.set_ragged_offset``): when they are well
formed, how far they may reach, and where each sequence's rows live.

A 4-D tensor ``[B, H, S, D]`` (Stats ``[B, H, S, 1]``, a page table ``[B, 1, n, 1]``) with
offsets keeps sequence ``b`` at ``offset[b]`` elements into its memory: element ``(b, h, s, d)``
is at ``offset[b] + h*stride[1] + s*stride[2] + d*stride[3]``, and the batch stride is not used.
Rows past a sequence's length (``seq_len_q``/``seq_len_kv``) are not part of the tensor, so
sequences may be packed back to back, left with gaps, or placed in any order. Offsets are
int32 or int64, ``B + 1`` of them (the last, where the last sequence ends, is never read).

This is the frontend's THD form. The library's own packed form, ``[T, H, D]`` tensors whose
offsets follow from the lengths, needs none of this (``problem.is_thd``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .problem import AttentionProblem, TensorSpec
from .roles import ROLES, offset_role, sequence_lengths, user_name

OFFSET_DTYPES = (torch.int32, torch.int64)


def offset_problems(p: AttentionProblem) -> list[str]:
    """What is wrong with the problem's ragged offsets (rules of the op, on every backend)."""
    found: list[str] = []
    for name, entry in ROLES.items():
        spec = getattr(p, name, None)
        if entry.offsets_of is None or spec is None:
            continue
        role, argument = entry.offsets_of, user_name(name)
        target: TensorSpec | None = getattr(p, role)
        if target is None:
            found.append(f"{argument}: given, but this node has no {user_name(role)}")
            continue
        if spec.dtype not in OFFSET_DTYPES:
            found.append(f"{argument}: dtype {str(spec.dtype).removeprefix('torch.')}; must be int32 or int64")
        if spec.numel != p.batch + 1 or any(size != 1 for size in spec.shape[1:]):
            found.append(
                f"{argument}: shape {list(spec.shape)}; expected [{p.batch + 1}, 1, 1, 1] (B + 1 element offsets)"
            )
        if role in ("k", "v") and p.is_paged:
            found.append(
                f"{argument}: {role} is a paged cache, addressed through its page table; put ragged offsets on "
                "the page table (packed page tables) instead"
            )
        elif target.rank != 4:
            found.append(
                f"{argument}: {user_name(role)} has rank {target.rank}; ragged offsets address a 4-D tensor "
                "(the offsets of a packed [T, H, D] tensor follow from seq_len_q/seq_len_kv)"
            )
        lengths = sequence_lengths(role)
        if not p.options.padding or getattr(p, lengths) is None:
            found.append(
                f"{argument}: needs use_padding_mask=True with {lengths}: the rows of a ragged tensor's "
                f"sequences are as many as {lengths} says"
            )
    return found


def sequence_extent(spec: TensorSpec, rows: int | None = None) -> int:
    """Elements one sequence of ``rows`` rows (all S by default) spans in a 4-D ``spec``."""
    _, h, s, d = spec.shape
    _, sh, ss, sd = spec.stride
    return ((rows if rows is not None else s) - 1) * ss + (h - 1) * sh + (d - 1) * sd + 1


def packed_roles(p: AttentionProblem) -> tuple[str, ...]:
    """Tensors with offsets whose sequences are bounded by their own rows (as many as their
    lengths say): a sequence may start anywhere its rows end inside the memory bound at each run,
    past ``B - 1`` batch strides too. Page tables are read whole per sequence (``offset_bounds``)."""
    return tuple(role for role in p.offset_tensors if not role.startswith("page_table"))


def _shaped_otherwise(p: AttentionProblem, role: str) -> bool:
    """Whether ``role``'s batch stride does not reach past one sequence (THD code gives the
    packed tensor's token stride): the memory bound at a run may be shaped otherwise."""
    spec = getattr(p, role)
    return spec.stride[0] < sequence_extent(spec)


def memory_span(tensor: torch.Tensor) -> int:
    """Elements from a tensor's first to its last, plus one (what it may address)."""
    if tensor.numel() == 0:
        return 0
    return sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())) + 1


def clamp_packed_offsets(
    offsets: torch.Tensor, lengths: torch.Tensor | None, span: int, spec: TensorSpec
) -> torch.Tensor:
    """Offsets of a packed tensor clamped so each sequence's rows (as many as its length) end
    inside the ``span`` elements bound at this run; int64 ``[B + 1, 1, 1, 1]``, on the device."""
    flat = offsets.reshape(-1).to(torch.int64)
    # an empty sequence's start kept a row inside the memory: it reads nothing, but a kernel is
    # then never handed an address past the end
    high = _packed_highs(flat, lengths, span, spec, empty_at_end=False).clamp(min=0)
    return torch.cat([torch.minimum(flat[:-1].clamp(min=0), high), flat[-1:].clamp(0, span)]).view(-1, 1, 1, 1)


def _packed_highs(
    flat: torch.Tensor, lengths: torch.Tensor | None, span: int, spec: TensorSpec, empty_at_end: bool = True
) -> torch.Tensor:
    """Each sequence's largest start that keeps its rows inside ``span`` elements (< 0: none does);
    an empty sequence reads nothing, so it may start at the end (a batch's trailing empty ones),
    unless ``empty_at_end`` is false (one row inside, as a sequence of one row)."""
    b, s = flat.numel() - 1, spec.shape[2]
    if lengths is None:
        rows = torch.full((b,), s, dtype=torch.int64, device=flat.device)
    else:
        rows = lengths.reshape(-1)[:b].to(device=flat.device, dtype=torch.int64).clamp(0, s)
    high = span - (rows - 1).clamp(min=0) * spec.stride[2] - sequence_extent(spec, 1)
    return torch.where(rows == 0, span, high) if empty_at_end else high


def packed_offset_problems(p: AttentionProblem, inputs: Mapping, outputs: Mapping) -> list[str]:
    """Offsets (on the host) that would place a packed tensor's sequence past the memory bound."""
    found = []
    for role in packed_roles(p):
        offsets, target = inputs.get(offset_role(role)), inputs.get(role, outputs.get(role))
        if not isinstance(offsets, torch.Tensor) or not isinstance(target, torch.Tensor):
            continue
        lengths = inputs.get(sequence_lengths(role))
        span, spec = memory_span(target), getattr(p, role)
        if not _shaped_otherwise(p, role) and span >= (spec.shape[0] - 1) * spec.stride[0] + sequence_extent(spec):
            continue  # memory for the graph's whole dims: offset_value_problems judges the offsets
        # (a tensor holding fewer rows than its graph tensor's dims: bounded by what it holds)
        given = offsets.reshape(-1).to(torch.int64)
        high = _packed_highs(given, lengths if isinstance(lengths, torch.Tensor) else None, span, getattr(p, role))
        bad = given[:-1][(given[:-1] < 0) | (given[:-1] > high)]
        if bad.numel():
            found.append(
                f"{user_name(offset_role(role))}: offsets {bad[:4].tolist()} place a sequence outside "
                f"{user_name(role)} ({span} elements bound)"
            )
    return found


def offset_bounds(p: AttentionProblem) -> dict[str, tuple[int, int]]:
    """Each page table's offsets' largest safe value, as (first B entries, last entry): a row that
    starts at most ``(B - 1) * batch_stride`` into the table ends inside it. Sequence tensors
    (``packed_roles``) are bounded by their lengths at each run instead."""
    bounds = {}
    packed = packed_roles(p)
    for role in p.offset_tensors:
        if role in packed:
            continue
        target = getattr(p, role)
        step = target.stride[0] if target.shape[0] > 1 else 0
        high = (p.batch - 1) * step
        bounds[offset_role(role)] = (high, high + step)
    return bounds


def clamp_offsets(offsets: torch.Tensor, high: int, last: int) -> torch.Tensor:
    """Offsets clamped into the tensor, as the int64 ``[B + 1, 1, 1, 1]`` cuDNN's plans read."""
    flat = offsets.reshape(-1).to(torch.int64)
    return torch.cat([flat[:-1].clamp(0, high), flat[-1:].clamp(0, last)]).view(-1, 1, 1, 1)


def offset_value_problems(p: AttentionProblem, data: Mapping[str, torch.Tensor]) -> list[str]:
    """Offsets that would place a sequence outside its tensor (values read to the host): a
    sequence's rows, as many as its length says, must end inside the tensor."""
    found = []
    for role in (role for role in packed_roles(p) if not _shaped_otherwise(p, role)):
        name, spec = offset_role(role), getattr(p, role)
        t, lengths = data.get(name), data.get(sequence_lengths(role))
        if t is None:
            continue
        span = (spec.shape[0] - 1) * spec.stride[0] + sequence_extent(spec)
        bound = data.get(role)  # the memory bound at a run, where given: sequences may lie past the dims
        if isinstance(bound, torch.Tensor):
            span = max(span, memory_span(bound))
        values = t.detach().reshape(-1).to("cpu", torch.int64)
        rows = None if lengths is None else lengths.detach().to("cpu")
        highs = _packed_highs(values, rows, span, spec)
        bad = values[:-1][(values[:-1] < 0) | (values[:-1] > highs)]
        if bad.numel():
            found.append(
                f"{user_name(name)}: offsets {bad[:4].tolist()} out of range; each sequence must start at 0 or more "
                f"and its rows (as many as {sequence_lengths(role)} says) end inside {user_name(role)} ({span} elements)"
            )
    for name, (high, _) in offset_bounds(p).items():
        t = data.get(name)
        if t is None:
            continue
        values = t.detach().reshape(-1)[:-1].to("cpu", torch.int64)
        bad = values[(values < 0) | (values > high)]
        if bad.numel():
            found.append(
                f"{user_name(name)}: offsets {bad[:4].tolist()} out of range; each sequence must start within "
                f"0..{high} (B - 1 batch strides) so that it ends inside {user_name(ROLES[name].offsets_of or '')}"
            )
    return found


def row_positions(
    tensor: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor | None, spec: TensorSpec | None = None
) -> tuple:
    """Where each element of the 4-D ``tensor`` (``spec``'s geometry where given: the memory bound
    may be shaped otherwise, as a packed [T, H, D] tensor) lives under ``offsets``: (the tensor's
    memory as one flat view, the flat index of every element, which elements are real rows)."""
    b, h, s, d = spec.shape if spec is not None else tensor.shape
    _, sh, ss, sd = spec.stride if spec is not None else tensor.stride()
    device = tensor.device
    starts = offsets.reshape(-1)[:b].to(device=device, dtype=torch.int64).view(b, 1, 1, 1)
    within = (
        torch.arange(h, device=device).view(1, h, 1, 1) * sh
        + torch.arange(s, device=device).view(1, 1, s, 1) * ss
        + torch.arange(d, device=device).view(1, 1, 1, d) * sd
    )
    span = memory_span(tensor)
    flat = tensor.as_strided((span,), (1,), tensor.storage_offset())
    index = starts + within
    real = index < span
    if lengths is not None:
        real = real & (torch.arange(s, device=device).view(1, 1, s, 1) < lengths.reshape(-1, 1, 1, 1).to(device))
    return flat, torch.where(real, index, torch.zeros_like(index)), real.expand(b, h, s, d)


def gather_rows(
    tensor: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor | None, spec: TensorSpec | None = None
) -> torch.Tensor:
    """The ragged ``tensor`` as a dense ``[B, H, S, D]`` copy: each sequence's rows, 0 past its end."""
    flat, index, real = row_positions(tensor, offsets, lengths, spec)
    return torch.where(real, flat[index], torch.zeros((), dtype=tensor.dtype, device=tensor.device))


def scatter_rows(
    out: torch.Tensor,
    dense: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor | None,
    spec: TensorSpec | None = None,
) -> None:
    """Write ``dense`` ``[B, H, S, D]`` into the ragged ``out``: only each sequence's real rows."""
    flat, index, real = row_positions(out, offsets, lengths, spec)
    flat[index[real]] = dense.to(out.dtype)[real]
