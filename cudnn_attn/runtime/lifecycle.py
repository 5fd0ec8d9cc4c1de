"""Releasing native plans before the interpreter shuts down.

Built cuDNN plans are native objects. Left to interpreter teardown, they can outlive the
frontend's native module, which then reports them as leaks. At exit, every registered
clean-up runs, then every cache and every live graph drops its plans while the frontend
is still whole. Modules that hold plans register their own clean-up with ``at_exit``.
"""

from __future__ import annotations

import atexit
import gc
import weakref
from collections.abc import Callable
from typing import Any

_graphs: weakref.WeakSet[Any] = weakref.WeakSet()
_caches: weakref.WeakSet[Any] = weakref.WeakSet()
_hooks: list[Callable[[], None]] = []


def track_graph(graph: Any) -> None:
    _graphs.add(graph)


def track_cache(cache: Any) -> None:
    _caches.add(cache)


def at_exit(hook: Callable[[], None]) -> Callable[[], None]:
    """Run ``hook`` at interpreter exit, before plans are released (usable as a decorator)."""
    _hooks.append(hook)
    return hook


@atexit.register
def release_plans() -> None:
    for hook in _hooks:
        hook()
    for graph in list(_graphs):
        graph._release()
    for cache in list(_caches):
        cache.clear()
    gc.collect()
