"""What ran, and why: the ``cudnn_attn`` logger and its switch.

``CUDNN_ATTN_LOG_LEVEL=info`` (or ``debug``, ``warning``...) prints to stderr one line per plan
a graph obtains (the problem, the backend, where the plan came from: memory, disk, built or
tuned; the engine; seconds), one line each time a backend is passed over, with the reason,
and why the plan store was not used; ``debug`` adds a line for each backend a dispatch passed
over (``ops/dispatch.py``), with all its reasons. Without the variable nothing is configured, and the
standard ``logging`` machinery decides as usual (warnings reach stderr through its last-resort
handler)::

    import logging
    logging.getLogger("cudnn_attn").setLevel(logging.INFO)  # with your own handlers

Lines are per plan, never per run: a graph's steady-state calls log nothing, whatever the level.
A recording that adopts an earlier identical one (``recorded_builds.py``) takes its plans
without a line at ``info`` (code that records its graph per call would print one per call);
``debug`` shows those too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

ENV_VAR = "CUDNN_ATTN_LOG_LEVEL"
SOURCES = ("memory", "disk", "built", "tuned")

logger = logging.getLogger("cudnn_attn")


def _configure_from_environment() -> None:
    """Honour ``CUDNN_ATTN_LOG_LEVEL``: a level name (``info``) or number; a bad value is reported once."""
    value = os.environ.get(ENV_VAR, "").strip()
    if not value:
        return
    # isdecimal, not isdigit: "²" is a digit that int() refuses (and the import would fail with it)
    level = logging.getLevelName(value.upper()) if not value.isdecimal() else int(value)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[cudnn_attn %(levelname)s] %(message)s"))
    logger.addHandler(handler)
    if not isinstance(level, int):
        logger.setLevel(logging.WARNING)
        logger.warning("%s=%r is not a logging level; use debug, info, warning or error", ENV_VAR, value)
        return
    logger.setLevel(level)


_configure_from_environment()


def level() -> str:
    """The level the ``cudnn_attn`` logger lets through now, and what set it (for ``cudnn-attn info``)."""
    name = logging.getLevelName(logger.getEffectiveLevel())
    value = os.environ.get(ENV_VAR, "").strip()
    if value:
        return f"{name} ({ENV_VAR}={value})"
    return f"{name} (set {ENV_VAR}=info to log every plan)"


def plan(problem: object, backend: str, source: str, engine: str | None, seconds: float) -> None:
    """One line per plan obtained: ``source`` is memory, disk, built or tuned.

    The values also ride on the record (``record.plan_backend``, ``plan_source``,
    ``plan_engine``, ``plan_seconds``) for handlers that collect them."""
    if logger.isEnabledFor(logging.INFO):
        extra = {"plan_backend": backend, "plan_source": source, "plan_engine": engine, "plan_seconds": seconds}
        logger.info(
            "plan %s: backend=%s source=%s engine=%s %.3fs",
            _short(problem),
            backend,
            source,
            engine,
            seconds,
            extra=extra,
        )


def plan_adopted(problem: object, backend: str) -> None:
    """A plan taken by a recording that repeats an earlier one: debug only (see the module docstring)."""
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("plan %s: backend=%s source=memory (a repeated recording)", _short(problem), backend)


def store_unused(reason: str) -> None:
    """Why plans are built in this process instead of loaded from (and saved to) the plan store."""
    if logger.isEnabledFor(logging.INFO):
        logger.info("plan store not used: %s", reason)


def backend_passed_over(where: str, backend: str, reason: str) -> None:
    """One line when ``backend`` is not chosen for a call of ``where``, with the reason."""
    if logger.isEnabledFor(logging.INFO):
        logger.info("%s: not %s: %s", where, backend, reason)


_skipped: set[tuple[str, str, str]] = set()


def backend_skipped(where: Callable[[], str], backend: str, reasons: list[str]) -> None:
    """One debug line per backend a dispatch passed over, with all its reasons (``ops/dispatch.py``);
    once per call signature and backend, so calls that dispatch on every run log it once.
    ``where()`` describes the call, only when the line may be written."""
    if logger.isEnabledFor(logging.DEBUG):
        said = (where(), backend, "; ".join(reasons))
        if said not in _skipped:
            if len(_skipped) > 4096:  # bounded: a long-lived process sees many signatures
                _skipped.clear()
            _skipped.add(said)
            logger.debug("%s: %s backend passed over: %s", *said)


def backend_chosen(where: str, backend: str, why: str) -> None:
    if logger.isEnabledFor(logging.INFO):
        logger.info("%s: runs on %s (%s)", where, backend, why)


def _short(problem: object) -> str:
    describe = getattr(problem, "describe", None)
    return describe() if callable(describe) else repr(problem)
