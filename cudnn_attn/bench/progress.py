"""Progress bars for long measurements: tqdm on stderr, shown only when stderr is a terminal.

Piped or redirected output (logs, ``--json -``) gets no bar: ``disable=None`` is tqdm's "off when
not a terminal". Bars are cleared when done, so the tables printed after them stay clean.

Example::

    for round_ in progress(range(30), "b4-h16-s4096-d128", unit="round"):
        ...
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


def progress(items: Iterable[T], what: str, unit: str = "round", total: int | None = None, **options: Any) -> Any:
    """``items`` wrapped in a bar labelled ``what``; iterating it yields ``items`` unchanged."""
    return tqdm(items, desc=what, unit=unit, total=total, leave=options.pop("leave", False), disable=None, **options)
