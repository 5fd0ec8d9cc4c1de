"""The library's exceptions: each lists every problem it found, one per line.

``UnsupportedError`` is also the cuDNN frontend's ``cudnnGraphNotSupportedError`` (its subclass)
wherever the frontend is imported: code written for the frontend skips a case with
``except cudnn.cudnnGraphNotSupportedError`` whichever of the two packages ``cudnn`` names.
Importing this library does not import the frontend (it costs start-up, and the reference
backend needs none of it): until something imports it, a stand-in of the same name is the base,
and the frontend's class takes its place once the frontend is imported and an error is made, or
``cudnn_attn.cudnnGraphNotSupportedError`` is asked for.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Mapping
from typing import Any


class _StandInError(Exception):
    """The frontend's exception until the frontend is imported."""


_StandInError.__name__ = _StandInError.__qualname__ = "cudnnGraphNotSupportedError"


def frontend_not_supported() -> type[Exception]:
    """The frontend's "this GPU / cuDNN cannot run this graph" exception (importing the frontend),
    with ``UnsupportedError`` rebased on it; the stand-in where the frontend does not import."""
    try:
        import cudnn

        found = cudnn.cudnnGraphNotSupportedError
        if isinstance(found, type) and issubclass(found, Exception):
            return _rebase(found)
    except Exception as error:  # not installed, or broken: the library still runs on the reference backend
        logging.getLogger("cudnn_attn").debug(
            "nvidia-cudnn-frontend unavailable (%s); its exception is stood in", error
        )
    return _StandInError


def _rebase(frontend: type[Exception]) -> type[Exception]:
    """``UnsupportedError`` derived from the frontend's class from now on (instances made before too)."""
    if frontend not in UnsupportedError.__mro__:
        UnsupportedError.__bases__ = tuple(frontend if b is _StandInError else b for b in UnsupportedError.__bases__)
    return frontend


def _adopt_imported_frontend() -> None:
    """Rebase on the frontend's class if the frontend has been imported since."""
    if _StandInError in UnsupportedError.__bases__:
        found = getattr(sys.modules.get("cudnn"), "cudnnGraphNotSupportedError", None)
        if isinstance(found, type) and issubclass(found, Exception):
            _rebase(found)


def shown(value: Any, limit: int = 40) -> str:
    """``repr(value)`` clipped to ``limit`` characters, for error lines about huge inputs."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _ProblemList:
    """Mixin: keeps the individual problems and formats them one per line."""

    headline = "problems"
    problems: list[str]

    def _format(self, problems: Iterable[str], context: str | None) -> str:
        self.problems = list(problems)
        head = f"{context}: " if context else ""
        if len(self.problems) == 1:
            return f"{head}{self.problems[0]}"
        lines = "\n".join(f"  - {p}" for p in self.problems)
        return f"{head}{len(self.problems)} {self.headline}:\n{lines}"

    def renamed(self, names: Mapping[str, str], context: str | None = None) -> Any:
        """The same error with each line's leading argument renamed by ``names`` (how a
        wrapper makes errors speak of its own arguments)."""
        lines = []
        for line in self.problems:
            argument, colon, rest = line.partition(":")
            lines.append(f"{names[argument]}{colon}{rest}" if colon and argument in names else line)
        extra = {"alternatives": getattr(self, "alternatives", ())} if isinstance(self, UnsupportedError) else {}
        return type(self)(lines, context, **extra)  # type: ignore[call-arg]


class ValidationError(_ProblemList, ValueError):
    """The request is malformed. ``.problems`` holds one line per problem.

    Each line names the argument, what was given and what is allowed, e.g.
    ``"k: head dim d_qk=60 differs from q's 64; q and k must share d_qk"``.
    """

    headline = "problems"

    def __init__(self, problems: Iterable[str], context: str | None = None):
        super().__init__(self._format(problems, context))


class UnsupportedError(_ProblemList, NotImplementedError, _StandInError):
    """Well formed, but this GPU / cuDNN version / backend cannot run it.

    ``.problems`` lists the reasons; ``.alternatives`` what would work, where known. Caught by
    ``except NotImplementedError`` (and so ``RuntimeError``) and by the frontend's
    ``except cudnn.cudnnGraphNotSupportedError``.
    """

    headline = "reasons"

    def __init__(self, reasons: Iterable[str], context: str | None = None, alternatives: Iterable[str] = ()):
        _adopt_imported_frontend()  # before the raise: the frontend's except clause then catches it
        self.alternatives = list(alternatives)
        message = self._format(reasons, context)
        if self.alternatives:
            message += "\nwhat would work: " + "; ".join(self.alternatives)
        super().__init__(message)


class ShapeMismatchError(_ProblemList, ValueError):
    """A run's tensors do not match the geometry of the graph they are run on."""

    headline = "mismatches"

    def __init__(self, problems: Iterable[str], context: str | None = None):
        super().__init__(self._format(problems, context))


class GraphStateError(RuntimeError):
    """The graph was used out of order (ops added after build, run before build, ...)."""


def __getattr__(name: str) -> Any:
    """``cudnnGraphNotSupportedError``: the frontend's class, imported when first asked for."""
    if name == "cudnnGraphNotSupportedError":
        return frontend_not_supported()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}", name=name)
