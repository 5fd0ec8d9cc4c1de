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
from typing import TYPE_CHECKING, Any


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
        wrapper makes errors speak of its own arguments); a name mapped to ``""`` is an inner
        detail whose line is dropped where another line remains."""
        lines, details = [], []
        for line in self.problems:
            argument, colon, rest = line.partition(":")
            if colon and names.get(argument) == "":
                details.append(line)
            else:
                lines.append(f"{names[argument]}{colon}{rest}" if colon and argument in names else line)
        lines = lines or details
        extra = {"alternatives": getattr(self, "alternatives", ())} if isinstance(self, UnsupportedError) else {}
        return type(self)(lines, context, **extra)  # type: ignore[call-arg]


class ValidationError(_ProblemList, ValueError):
    """The request is malformed: every problem found, one per line.

    A ``ValueError``. Raised by the same checks on every backend, before any GPU work. Each
    line names the argument, what was given and what is allowed, e.g.
    ``"k: head dim d_qk=60 differs from q's 64; q and k must share d_qk"``; ``.problems``
    holds the lines.

    Args:
        problems: the lines, one per problem.
        context: what was called (``"sdpa"``, a graph's name), prefixed to the message.

    Example:
        ```python
        import torch

        import cudnn_attn

        q = torch.randn(1, 2, 8, 64)
        try:
            cudnn_attn.sdpa(q, q, q, dropout_p=1.5, is_causal="yes")
        except cudnn_attn.ValidationError as error:
            assert [line.split(":")[0] for line in error.problems] == ["dropout_p", "is_causal"]
        ```
    """

    headline = "problems"

    def __init__(self, problems: Iterable[str], context: str | None = None):
        super().__init__(self._format(problems, context))


class UnsupportedError(_ProblemList, NotImplementedError, _StandInError):
    """Well formed, but this GPU, cuDNN version or backend cannot run it.

    A ``NotImplementedError`` (so a ``RuntimeError``), and the cuDNN frontend's
    ``cudnnGraphNotSupportedError`` wherever the frontend is imported: frontend code that skips
    a case with ``except cudnn.cudnnGraphNotSupportedError`` keeps working. ``.problems`` lists
    the reasons (phrased as the failing condition, e.g. ``"paged K/V caches need cuDNN >= 9.5
    (have 9.3)"``); ``.alternatives`` what would work, where known. Code written on a CPU runs
    unchanged on a GPU except for these limits.

    Args:
        reasons: the lines, one per reason.
        context: what was called, prefixed to the message.
        alternatives: what would work instead, where known.

    Example:
        ```python
        import torch

        import cudnn_attn

        q = torch.randn(1, 2, 8, 64, dtype=torch.float16)
        try:  # the cuDNN backend runs CUDA tensors only
            with cudnn_attn.Graph(backend="cudnn") as g:
                g.sdpa(q, q, q)
        except cudnn_attn.UnsupportedError as error:
            print(error.problems, error.alternatives)
        ```
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
    """A run's tensors do not match the graph they are run on.

    A ``ValueError``, raised when a built graph is called: an input missing or extra, or of
    another shape, strides, dtype or device than the template the graph was built for. Checked
    on the host, before any GPU work. ``.problems`` names each input.

    Args:
        problems: the lines, one per mismatch.
        context: the graph's name, prefixed to the message.

    Example:
        ```python
        import torch

        import cudnn_attn

        q = torch.randn(1, 2, 16, 64)
        with cudnn_attn.Graph() as g:
            g.sdpa(q, q, q)
        try:
            g(torch.randn(1, 2, 32, 64))  # S = 32: the graph was built for 16
        except cudnn_attn.ShapeMismatchError as error:
            print(error)
        ```
    """

    headline = "mismatches"

    def __init__(self, problems: Iterable[str], context: str | None = None):
        super().__init__(self._format(problems, context))


class GraphStateError(RuntimeError):
    """A graph was used out of order: a tensor or op added after the build, a setter called on a
    built graph's output, or a graph run after its plans were released at exit. A ``RuntimeError``.

    Example:
        ```python
        import torch

        import cudnn_attn

        q = torch.randn(1, 2, 16, 64)
        with cudnn_attn.Graph() as g:
            o, _ = g.sdpa(q, q, q)
        try:
            g.sdpa(q, q, q)  # the graph was built on leaving the block
        except cudnn_attn.GraphStateError as error:
            print(error)
        ```
    """


if TYPE_CHECKING:  # resolved by __getattr__ below; declared for type checkers and the API reference

    class cudnnGraphNotSupportedError(Exception):  # noqa: N801 - the frontend's spelling
        """The cuDNN frontend's "this GPU or cuDNN cannot run this graph" exception.

        ``cudnn_attn.cudnnGraphNotSupportedError`` is the frontend's own class, imported when
        first asked for (a stand-in of the same name where the frontend does not import), and
        ``UnsupportedError`` derives from it: ``except cudnn.cudnnGraphNotSupportedError``
        catches this library's refusals whichever package ``cudnn`` names.

        Example:
            ```python
            import torch

            import cudnn_attn as cudnn

            q = torch.randn(1, 2, 8, 64, dtype=torch.float16)
            try:
                with cudnn.Graph(backend="cudnn") as g:  # CPU tensors: refused
                    g.sdpa(q, q, q)
            except cudnn.cudnnGraphNotSupportedError:
                print("skipped")
            ```
        """


def __getattr__(name: str) -> Any:
    """``cudnnGraphNotSupportedError``: the frontend's class, imported when first asked for."""
    if name == "cudnnGraphNotSupportedError":
        return frontend_not_supported()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}", name=name)
