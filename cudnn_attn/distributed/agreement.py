"""Checks that every rank of a group called with compatible arguments, raising on every rank alike.

A rank that refuses its arguments alone would leave the others waiting in the next collective
forever. So before every call's first collective, each rank shares a short row: whether it
refused its arguments, and a checksum of the fields that must agree (shard lengths, head counts,
dtypes, flags). When every row is clear and the checksums match, the call goes on; otherwise
every rank shares the whole table (``Field`` by ``Field``) and derives the same verdict from it.
A signature that passed keeps its checksum, so a steady-state call pays a tuple lookup and one
small exchange on the CPU (``control.py``), and a rank whose shard changed while the others'
did not is caught there: its checksum differs.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from ..errors import UnsupportedError, ValidationError
from .control import gather_rows
from .process_group import Members

MAX_REMEMBERED = 4096
MALFORMED, UNSUPPORTED = 1, 2  # why a rank refused its arguments
MAX_DIMS = 8  # shape fields are padded to this many, so every rank's row has one length
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_agreed: dict[Hashable, int] = {}  # signature -> its fields' checksum


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
    fields: Sequence[Field] | Callable[[], Sequence[Field]],
    context: str,
    local_unsupported: bool = False,
) -> None:
    """Raise on every rank when any rank has ``local`` problems or a field differs across ranks.
    Every rank calls it on every call, before the call's first collective.

    signature: the call's hashable key (its checksum remembered once agreed; None: never).
    local: this rank's own problems (lines naming the argument); ``local_unsupported``: they
    are limits (``UnsupportedError``) rather than malformed input.
    fields: the fields every rank must give alike, or a function making them (called only when
    the signature is new here, or some rank disagrees).

    Example::

        agree(m, key, problems, [Field("q: shard length", q.shape[2])], "context_parallel_sdpa")
    """
    made: Sequence[Field] | None = None if callable(fields) else fields
    checksum = _agreed.get(signature) if signature is not None and not local else None
    if checksum is None:
        made = made if made is not None else fields()  # type: ignore[operator]
        checksum = _checksum(made)
    kind = 0 if not local else UNSUPPORTED if local_unsupported else MALFORMED
    short = gather_rows(m, [len(local), kind, checksum])
    if all(not r[0] for r in short) and len({r[2] for r in short}) == 1:
        if signature is not None:
            if len(_agreed) >= MAX_REMEMBERED:
                _agreed.clear()
            _agreed[signature] = checksum
        return
    # Some rank refused, or the fields differ somewhere: every rank shares the whole table.
    made = made if made is not None else fields()  # type: ignore[operator]
    row = [len(local), kind, *(f.value for f in made)]
    rows = gather_rows(m, row)
    problems = list(local)
    others = [j for j, r in enumerate(rows) if j != m.rank and r[0]]
    if others and local:
        problems.append(f"group: {_ranks(others)} refused their arguments too (listed in their errors)")
    elif others:
        problems.append(
            f"group: {_ranks(others)} refused its own arguments (listed in its error)"
            if len(others) == 1
            else f"group: {_ranks(others)} refused their own arguments (listed in their errors)"
        )
    if not local and not others:  # fields of a rank with local problems may be placeholders
        for i, f in enumerate(made, 2):
            column = [r[i] for r in rows]
            if len(set(column)) > 1:
                given = ", ".join(f"rank {j}: {f.render(v)}" for j, v in enumerate(column))
                problems.append(f"{f.label} differs across ranks ({given}); every rank must give the same")
    if not problems:  # the checksums differed only through a field no rank shows: refuse all the same
        problems.append("the ranks' arguments differ (their checksums); every rank must give the same")
    if all(r[1] == UNSUPPORTED for r in rows if r[0]) and any(r[0] for r in rows):
        raise UnsupportedError(problems, context=context)  # every refusal is a limit, not a mistake
    raise ValidationError(problems, context=context)


def _checksum(fields: Sequence[Field]) -> int:
    """63 bits over every field's label and value: equal tables give equal checksums."""
    text = repr([(f.label, f.value) for f in fields]).encode()
    return (zlib.crc32(text) << 31) ^ zlib.adler32(text)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
