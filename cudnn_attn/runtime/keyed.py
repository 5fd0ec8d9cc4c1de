"""``KeyedCache``: a bounded dict for the runtime's memo tables (prepared runs by call signature,
recorded builds by recording), oldest entry dropped first.

Reads take no lock: the hot paths look a key up on every call, and a dict read is atomic.
Writes and clears hold the lock, so concurrent first calls never lose an entry or overflow.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any

from . import lifecycle


class KeyedCache:
    """At most ``maxsize`` entries by key; ``release_at_exit`` clears it while the interpreter is whole
    (its values hold native plans)."""

    def __init__(self, maxsize: int, release_at_exit: bool = True):
        self.maxsize = maxsize
        self._entries: dict[Hashable, Any] = {}
        self._lock = threading.Lock()
        if release_at_exit:
            lifecycle.track_releasable(self)

    def get(self, key: Hashable) -> Any:
        return self._entries.get(key)

    def put(self, key: Hashable, value: Any) -> Any:
        """Keep ``value`` under ``key`` (a value already there wins: two threads built the same);
        returns the value kept."""
        with self._lock:
            kept = self._entries.get(key)
            if kept is not None:
                return kept
            if len(self._entries) >= self.maxsize:
                self._entries.pop(next(iter(self._entries)))
            self._entries[key] = value
            return value

    def values(self) -> list[Any]:
        with self._lock:
            return list(self._entries.values())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def release(self) -> None:
        self.clear()

    def forget_plans(self, keys: set[Hashable] | None) -> None:
        """Drop the entries whose run holds a plan of ``keys`` (plan-cache keys; None: every entry),
        for ``PlanCache.on_drop``."""
        with self._lock:
            if keys is None:
                self._entries.clear()
                return
            for key in [k for k, run in self._entries.items() if getattr(run, "cache_key", None) in keys]:
                del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)
