"""Releasing native plans before the interpreter shuts down.

Built cuDNN plans are native objects. Left to interpreter teardown, they can outlive the
frontend's native module, which then reports them as leaks. At exit, every registered
clean-up runs, then every tracked holder (graphs, memo tables) releases its plans and every
plan cache is cleared, while the frontend is still whole. Modules that hold plans register
their own clean-up with ``at_exit``, or their holders with ``track_releasable``.
"""

from __future__ import annotations

import atexit
import gc
import weakref
from collections.abc import Callable
from typing import Any

_holders: weakref.WeakSet[Any] = weakref.WeakSet()  # objects with a release() method
_caches: weakref.WeakSet[Any] = weakref.WeakSet()
_hooks: list[Callable[[], None]] = []


def track_releasable(holder: Any) -> None:
    """Call ``holder.release()`` at exit (held weakly: a holder gone by then needs nothing)."""
    _holders.add(holder)


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
    for holder in list(_holders):
        holder.release()
    for cache in list(_caches):
        cache.clear()
    gc.collect()
