"""Releasing native plans before the interpreter shuts down.

Built cuDNN plans are native objects. Left to interpreter teardown, they can outlive the
frontend's native module, which then reports them as leaks. At exit, every cache and every
live graph drops its plans while the frontend is still whole.
"""

from __future__ import annotations

import atexit
import gc
import weakref
from typing import Any

_graphs: weakref.WeakSet[Any] = weakref.WeakSet()
_caches: weakref.WeakSet[Any] = weakref.WeakSet()


def track_graph(graph: Any) -> None:
    _graphs.add(graph)


def track_cache(cache: Any) -> None:
    _caches.add(cache)


@atexit.register
def release_plans() -> None:
    from . import functional

    functional._clear_graphs()
    for graph in list(_graphs):
        graph._release()
    for cache in list(_caches):
        cache.clear()
    gc.collect()
