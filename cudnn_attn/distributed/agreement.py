"""Checks that every rank of a group called with compatible arguments, raising on every rank alike.

A rank that refuses its arguments alone would leave the others waiting in the next collective
forever. So before the first run of a call signature, each rank shares a few integers (its
count of local problems, then the fields that must agree: shard lengths, head counts, dtypes,
flags) in one small all-gather, and every rank derives the same verdict from the same table.
A signature that passed is remembered, so steady-state calls pay a tuple and a set lookup.

Limitation, documented to callers: ranks check a signature when it is new to them. A rank
whose arguments change while another's stay at a signature already checked skips the
exchange the other enters; as with any collective, every rank must change together.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import UnsupportedError, ValidationError
from .process_group import Members

MAX_REMEMBERED = 4096
MALFORMED, UNSUPPORTED = 1, 2  # why a rank refused its arguments
MAX_DIMS = 8  # shape fields are padded to this many, so every rank's row has one length
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_agreed: set[Hashable] = set()


@dataclass(frozen=True)
class Field:
    """One integer every rank must give alike; ``render`` shows a code to the user (a dtype)."""

    label: str  # "argument: what", e.g. "q: shard length"
    value: int
    render: Callable[[int], str] = str


def shape_fields(name: str, shape: Sequence[int]) -> list[Field]:
    """Fields for a tensor's rank and sizes (a row of fixed length whatever the rank)."""
    sizes = [*shape[:MAX_DIMS], *[-1] * (MAX_DIMS - len(shape))]
    return [
        Field(f"{name}: dimensions", len(shape)),
        *(Field(f"{name}: size of dim {i}", n) for i, n in enumerate(sizes)),
    ]


def dtype_field(name: str, dtype: torch.dtype) -> Field:
    code = DTYPES.index(dtype) if dtype in DTYPES else len(DTYPES)
    return Field(
        f"{name}: dtype", code, lambda c: str(DTYPES[c]).removeprefix("torch.") if c < len(DTYPES) else "other"
    )


def known(signature: Hashable) -> bool:
    """Whether every rank already agreed on ``signature`` (raises TypeError if unhashable)."""
    return signature in _agreed


def agree(
    m: Members,
    signature: Hashable | None,
    local: Sequence[str],
    fields: Sequence[Field],
    device: torch.device,
    context: str,
    local_unsupported: bool = False,
) -> None:
    """Raise on every rank when any rank has ``local`` problems or a field differs across ranks.

    signature: the call's hashable key (remembered once agreed; None: check every time).
    local: this rank's own problems (lines naming the argument); ``local_unsupported``: they
    are limits (``UnsupportedError``) rather than malformed input.
    device: where the small table travels (a CUDA device for NCCL, the CPU for gloo).

    Example::

        agree(m, key, problems, [Field("q: shard length", q.shape[2])], q.device, "context_parallel_sdpa")
    """
    if signature is not None and signature in _agreed:
        return
    kind = 0 if not local else UNSUPPORTED if local_unsupported else MALFORMED
    row = torch.tensor([len(local), kind, *(f.value for f in fields)], dtype=torch.int64, device=device)
    if m.world > 1:
        gathered = [torch.empty_like(row) for _ in range(m.world)]
        dist.all_gather(gathered, row, group=m.group)  # the list form: every backend has it
        rows = torch.stack(gathered).tolist()  # one host sync, once per signature
    else:
        rows = [row.tolist()]
    problems = list(local)
    others = [j for j, r in enumerate(rows) if j != m.rank and r[0]]
    if others and local:
        problems.append(f"group: {_ranks(others)} refused their arguments too (listed in their errors)")
    elif others:
        problems.append(f"group: {_ranks(others)} refused its own arguments (listed in its error)"
                        if len(others) == 1 else f"group: {_ranks(others)} refused their own arguments "
                        "(listed in their errors)")  # fmt: skip
    if not local and not others:  # fields of a rank with local problems may be placeholders
        for i, f in enumerate(fields, 2):
            column = [r[i] for r in rows]
            if len(set(column)) > 1:
                given = ", ".join(f"rank {j}: {f.render(v)}" for j, v in enumerate(column))
                problems.append(f"{f.label} differs across ranks ({given}); every rank must give the same")
    if problems:
        if all(r[1] == UNSUPPORTED for r in rows if r[0]) and any(r[0] for r in rows):
            raise UnsupportedError(problems, context=context)  # every refusal is a limit, not a mistake
        raise ValidationError(problems, context=context)
    if signature is None:  # not hashable: agreed, but not remembered
        return
    if len(_agreed) >= MAX_REMEMBERED:
        _agreed.clear()
    _agreed.add(signature)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
