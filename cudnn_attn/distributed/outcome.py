"""How a context-parallel call ends: alike on every rank of the group.

A rank that fails inside a call (out of memory in a block's attention, a plan cuDNN cannot build
for its geometry) would otherwise raise alone and leave the others waiting in the ring's next
transfer for as long as the process group's timeout. Instead it keeps taking part in the call's
transfers, computing nothing more, and at the call's end every rank shares how it ended
(``settle``): if any rank failed, every rank raises, the failed rank its own error and the others
an error of the same kind naming that rank and its message. The buffers a call's transfers need
are allocated before its first transfer and agreed the same way (stage ``"allocating"``), so
none is missing once they start.
"""

from __future__ import annotations

import torch

from ..errors import ShapeMismatchError, UnsupportedError, ValidationError
from .control import gather_objects, gather_rows
from .process_group import Members

OK, MALFORMED, UNSUPPORTED, OUT_OF_MEMORY, FAILED = range(5)


def settle(m: Members, error: Exception | None, stage: str, context: str) -> None:
    """Every rank calls it at the same point of a call, with the error it met (None: none).
    Returns when no rank failed; raises on every rank otherwise."""
    rows = gather_rows(m, [OK if error is None else _kind(error)])
    failed = [rank for rank, row in enumerate(rows) if row[0] != OK]
    if not failed:
        return
    texts = gather_objects(m, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    first = failed[0]
    line = f"rank {first} failed {stage} ({texts[first]})"
    if len(failed) > 1:
        line += f", and {'rank' if len(failed) == 2 else 'ranks'} {', '.join(map(str, failed[1:]))} too"
    line += "; every rank of the group stops this call"
    kind = rows[first][0]
    if kind == OUT_OF_MEMORY:
        raise torch.OutOfMemoryError(f"{context}: {line}")
    if kind == UNSUPPORTED:
        raise UnsupportedError([line], context=context)
    if kind == MALFORMED:
        raise ValidationError([line], context=context)
    raise RuntimeError(f"{context}: {line}")


def _kind(error: Exception) -> int:
    if isinstance(error, torch.OutOfMemoryError):
        return OUT_OF_MEMORY
    if isinstance(error, UnsupportedError):
        return UNSUPPORTED
    if isinstance(error, (ValidationError, ShapeMismatchError)):
        return MALFORMED
    return FAILED
