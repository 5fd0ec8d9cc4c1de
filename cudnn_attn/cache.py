"""The in-memory plan cache: build a plan once per signature, reuse it everywhere.

Keys are ``(backend name, backend.plan_key(problem), problem)``: the frozen problem holds
every shape, stride, dtype, mask, flag and the scale; the backend adds what else decides
its plan (GPU architecture, library versions). Thread-safe: concurrent first requests
for one key build once, the others wait for that build.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

from . import log as _log
from .errors import ValidationError
from .plan_store import ENV, PlanStore, default_path
from .runtime import lifecycle
from .runtime.keyed import KeyedCache

DEFAULT_MAXSIZE = 1024
RECORDED_BUILDS = 256  # recorded builds kept per cache
DEFAULT_MAX_BYTES = 4 << 30  # device memory plans may hold in constant inputs and prepared buffers


class PlanCache:
    """LRU cache of built plans, bounded in entries and in the bytes the plans hold.

    Every backend goes through one (for the reference backend the cached plan is its prepared
    callable). Keys hold everything that changes a plan (every shape, stride, dtype, mask and
    flag, the scale, the GPU, the cuDNN and frontend versions) and nothing else. Thread-safe:
    concurrent first requests for one key build once. With ``path``, built cuDNN plans are
    also stored on disk and loaded by later processes (every byte checked).

    Args:
        maxsize: plans kept at most (least recently used dropped first).
        path: a directory to store built plans in (private to this user); None or ``""`` for
            none (as ``CUDNN_ATTN_CACHE_DIR=""``; the current directory is ``"."``).
        max_bytes: device and host bytes the plans may hold in workspaces and prepared buffers.

    Raises:
        ValidationError: ``maxsize`` or ``max_bytes`` not an int >= 1.

    Example:
        ```python
        import torch

        import cudnn_attn

        cache = cudnn_attn.PlanCache(maxsize=64)
        q = torch.randn(1, 2, 32, 64)
        for _ in range(2):
            with cudnn_attn.Graph(cache=cache) as g:
                g.sdpa(q, q, q)
        stats = cache.stats()
        assert stats["builds"] == 1 and len(cache) == 1
        ```
    """

    def __init__(
        self, maxsize: int = DEFAULT_MAXSIZE, path: str | os.PathLike | None = None, max_bytes: int = DEFAULT_MAX_BYTES
    ):
        problems = [
            f"{name}: {value!r}; must be an int >= 1"
            for name, value in (("maxsize", maxsize), ("max_bytes", max_bytes))
            if isinstance(value, bool) or not isinstance(value, int) or value < 1
        ]
        if path is not None and not isinstance(path, (str, os.PathLike)):
            problems.append(f"path: {path!r}; expected a directory path (str or os.PathLike) or None")
        if problems:
            raise ValidationError(problems, context="PlanCache")
        if path == "":  # no store, as the variable's "" says: Path("") would be the working directory
            path = None
            off = 'this PlanCache was made with path="" (no store)'
        else:
            off = "this PlanCache was made without path="
        self.maxsize = maxsize
        self.max_bytes = max_bytes
        self.path = path
        # Built plans persist here across processes (cuDNN plans; see plan_store.py).
        self.store = PlanStore(path) if path is not None else None
        # Why plans are not stored, said once (log.store_unused) by the first plan that could have been.
        self.store_off: str | None = None if path is not None else off
        lifecycle.track_cache(self)
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        self._building: dict[Hashable, Future] = {}
        self._lock = threading.Lock()
        self._counts = {"hits": 0, "misses": 0, "builds": 0, "evictions": 0, "build_errors": 0}
        self._build_seconds = 0.0
        # Whole graph builds by what was recorded (recording/reuse.py); forgotten whenever a plan goes.
        self.recorded = KeyedCache(RECORDED_BUILDS, release_at_exit=False)
        self._drop_hooks: list[Any] = []  # weak references to bound methods, or plain functions

    def get_or_build(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The plan for ``key``, calling ``build()`` on a miss (once, however many threads ask)."""
        return self.obtain(key, build)[0]

    def obtain(self, key: Hashable, build: Callable[[], Any]) -> tuple[Any, bool]:
        """``get_or_build``, and whether this call built the plan (False: it was in memory, or
        another thread's build of it was under way and this call waited for it).

        A build that raises (the GPU out of memory, say) leaves nothing behind: no entry, no
        in-flight marker; its error reaches every waiter, and the next request builds afresh.
        """
        with self._lock:
            plan = self._entries.get(key)
            if plan is not None:
                self._entries.move_to_end(key)
                self._counts["hits"] += 1
                return plan, False
            self._counts["misses"] += 1
            pending = self._building.get(key)
            if pending is None:
                pending = self._building[key] = Future()
                owner = True
            else:
                owner = False
        if not owner:
            return pending.result(), False  # re-raises the builder's error, if any
        start = time.perf_counter()
        try:
            plan = build()
        except BaseException as error:
            with self._lock:
                self._counts["build_errors"] += 1
                del self._building[key]
            pending.set_exception(error)
            raise
        elapsed = time.perf_counter() - start
        with self._lock:
            self._counts["builds"] += 1
            self._build_seconds += elapsed
            self._entries[key] = plan
            del self._building[key]
            self._evict()
        pending.set_result(plan)
        return plan, True

    def store_unused_reason(self) -> str | None:
        """Why this cache stores no plans (no path, or the variable turned it off): once, then None."""
        with self._lock:
            reason, self.store_off = self.store_off, None
        return reason

    def _evict(self) -> None:
        """Drop least recently used plans while over either bound (the newest always stays).
        Bytes are summed afresh: a plan's workspace appears on its first run."""
        held = sum(getattr(plan, "nbytes", 0) for plan in self._entries.values())
        dropped = set()
        while len(self._entries) > 1 and (len(self._entries) > self.maxsize or held > self.max_bytes):
            key, plan = self._entries.popitem(last=False)
            held -= getattr(plan, "nbytes", 0)
            self._counts["evictions"] += 1
            dropped.add(key)
        if dropped:
            self._dropped(dropped)

    def on_drop(self, hook: Callable[[set[Hashable] | None], None]) -> None:
        """Call ``hook(keys)`` whenever this cache drops plans: the dropped keys on eviction, None on
        ``clear`` (all of them). Tables that keep runs over its plans forget those runs, so no plan
        outlives its cache's bounds. A hook is kept once; a bound method weakly."""
        held = weakref.WeakMethod(hook) if inspect.ismethod(hook) else hook  # a table may go before its cache
        with self._lock:
            if held not in self._drop_hooks:
                self._drop_hooks.append(held)

    def _dropped(self, keys: set[Hashable] | None) -> None:
        self.recorded.clear()  # recorded builds hold several plans each: forgotten whole
        live = []
        for held in self._drop_hooks:
            hook = held() if isinstance(held, weakref.WeakMethod) else held
            if hook is not None:
                hook(keys)
                live.append(held)
        self._drop_hooks = live

    def touch(self, keys: tuple[Hashable, ...]) -> bool:
        """Count a hit on each of ``keys`` and mark them recently used; False (nothing counted)
        when one of them is no longer cached."""
        with self._lock:
            entries = self._entries
            if any(key not in entries for key in keys):
                return False
            for key in keys:
                entries.move_to_end(key)
            self._counts["hits"] += len(keys)
        if _log.logger.isEnabledFor(logging.DEBUG):  # info stays silent here: code may record per call
            for key in keys:
                if isinstance(key, tuple) and len(key) == 4:  # build.plan_nodes': (backend, platform, problem, tuned)
                    _log.plan_adopted(key[2], key[0])
                else:
                    _log.plan_adopted(key, "?")
        return True

    def nbytes(self) -> int:
        """Bytes the cached plans hold now."""
        with self._lock:
            return sum(getattr(plan, "nbytes", 0) for plan in self._entries.values())

    def stats(self) -> dict[str, float]:
        """Counters: ``hits``, ``misses``, ``builds``, ``evictions``, ``build_errors``,
        ``build_seconds``, ``size`` (plans held) and ``in_flight`` (builds under way)."""
        with self._lock:
            return {
                **self._counts,
                "build_seconds": self._build_seconds,
                "size": len(self._entries),
                "in_flight": len(self._building),
            }

    def clear(self) -> None:
        """Drop every plan and zero the counters; the workspaces plans share on each stream
        (``ops/cudnn/workspace.py``) go back to torch's allocator too."""
        # Only where it was imported: no workspace exists otherwise, and an import in the clear at
        # exit (lifecycle) fails, the interpreter shutting down.
        workspace = sys.modules.get(f"{__package__}.ops.cudnn.workspace")
        if workspace is not None:
            workspace.release()
        with self._lock:
            self._entries.clear()
            self._dropped(None)
            self._counts = dict.fromkeys(self._counts, 0)
            self._build_seconds = 0.0

    def keys(self) -> list[Hashable]:
        """The keys of the cached plans, least recently used first."""
        with self._lock:
            return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries


_default: PlanCache | None = None
_default_lock = threading.Lock()


def default_cache() -> PlanCache:
    """The process-wide plan cache: what graphs and functional calls use unless given ``cache=``.

    It stores built cuDNN plans under ``$CUDNN_ATTN_CACHE_DIR`` (default
    ``~/.cache/cudnn_attn``; ``CUDNN_ATTN_CACHE_DIR=""`` turns storing off).

    Returns:
        The one ``PlanCache`` of this process, made on first use.

    Example:
        ```python
        import cudnn_attn

        cache = cudnn_attn.default_cache()
        print(len(cache), cache.stats()["hits"])
        ```
    """
    global _default
    if _default is not None:  # every graph asks: no lock once it exists
        return _default
    with _default_lock:
        if _default is None:
            path = default_path()
            _default = PlanCache(path=path)
            if path is None:
                _default.store_off = f'{ENV}="" turns it off'
        return _default
