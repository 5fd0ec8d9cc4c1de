"""What ran, and why: the ``cudnn_attn`` logger and its switch.

``CUDNN_ATTN_LOG_LEVEL=info`` (or ``debug``, ``warning``...) prints to stderr one line per plan
(the problem, the backend, where the plan came from: memory, disk, built or tuned; the engine;
seconds) and one line each time a backend is passed over, with the reason. Without the variable
nothing is printed, and the standard ``logging`` machinery decides as usual::

    import logging
    logging.getLogger("cudnn_attn").setLevel(logging.INFO)  # with your own handlers
"""

from __future__ import annotations

import logging
import os

ENV_VAR = "CUDNN_ATTN_LOG_LEVEL"

logger = logging.getLogger("cudnn_attn")


def _configure_from_environment() -> None:
    """Honour ``CUDNN_ATTN_LOG_LEVEL``: a level name (``info``) or number; a bad value is reported once."""
    value = os.environ.get(ENV_VAR, "").strip()
    if not value:
        return
    level = logging.getLevelName(value.upper()) if not value.isdigit() else int(value)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[cudnn_attn %(levelname)s] %(message)s"))
    logger.addHandler(handler)
    if not isinstance(level, int):
        logger.setLevel(logging.WARNING)
        logger.warning("%s=%r is not a logging level; use debug, info, warning or error", ENV_VAR, value)
        return
    logger.setLevel(level)


_configure_from_environment()


def plan(problem: object, backend: str, source: str, engine: str | None, seconds: float) -> None:
    """One line per plan obtained: ``source`` is memory, disk, built or tuned."""
    if logger.isEnabledFor(logging.INFO):
        logger.info("plan %s: backend=%s source=%s engine=%s %.3fs", _short(problem), backend, source, engine, seconds)


def backend_passed_over(where: str, backend: str, reason: str) -> None:
    """One line when ``backend`` is not chosen for a call of ``where``, with the reason."""
    if logger.isEnabledFor(logging.INFO):
        logger.info("%s: not %s: %s", where, backend, reason)


def backend_chosen(where: str, backend: str, why: str) -> None:
    if logger.isEnabledFor(logging.INFO):
        logger.info("%s: runs on %s (%s)", where, backend, why)


def _short(problem: object) -> str:
    describe = getattr(problem, "describe", None)
    return describe() if callable(describe) else repr(problem)
