"""Every environment variable the package reads, in one table: name, default, meaning.

Each variable is still read where it acts (``log.py``, ``plan_store.py``, ``core/derived.py``,
``ops/cudnn/autotune.py``: those modules load before anything else, some without torch); this
table is what ``cudnn-attn info`` prints and the docs list, and a test holds it equal to the
variables those modules read.

Example::

    from cudnn_attn.core.environment import VARIABLES
    for variable in VARIABLES:
        print(variable.name, variable.current())
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    """One environment variable: its name, what applies when it is unset, and what it does."""

    name: str
    default: str
    meaning: str

    def current(self) -> str | None:
        """The value set in this process, or None when unset."""
        return os.environ.get(self.name)


VARIABLES = (
    Variable(
        "CUDNN_ATTN_CACHE_DIR",
        "~/.cache/cudnn_attn",
        'the persistent plan store\'s directory; "" turns the store off',
    ),
    Variable(
        "CUDNN_ATTN_AUTOTUNE",
        "0",
        "1 (true, yes, on) tunes every graph that does not say otherwise; set_autotune() overrides it",
    ),
    Variable(
        "CUDNN_ATTN_LOG_LEVEL",
        "logging's own (warning)",
        "debug, info, warning or error: info logs one line per plan (source, engine, seconds) to stderr",
    ),
    Variable(
        "CUDNN_ATTN_DERIVED_CACHE",
        "1",
        "0 (false, no, off) derives clamped lengths and offsets on every call, for inputs written behind torch's back",
    ),
)
