"""Builds of recorded graphs, kept by what was recorded.

A ``with Graph()`` block that records exactly what an earlier block recorded (the same ops,
arguments, tensor geometry and aliasing, handle settings and graph options) would validate
the same problems and get the same plans. Its key proves that, so the graph adopts the
earlier build instead: no keyword parsing, assembly, validation or runner construction,
which is what lets code that rebuilds its graph per call pay a few microseconds for it.

Each plan cache keeps its own recorded builds and forgets them all whenever it drops a plan
(eviction or ``clear``), so a recorded build never holds a plan its cache has let go.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from .problem import TensorSpec

MAX_ENTRIES = 256


@dataclass(frozen=True)
class BuiltNode:
    """One node's share of a build: what ``Node`` fields it had, and which inputs it read."""

    fields: dict[str, Any]  # parsed, spelling, paged, kv_cache_layout, deterministic, problem, plan, ...
    inputs: tuple[tuple[str, str, int], ...]  # (role, "input" | "output", index among those)
    output_specs: tuple[TensorSpec | None, ...]  # in the node's output order
    value_roles: tuple[tuple[str, int], ...]  # integer inputs whose values the build checked: (role, input)


@dataclass(frozen=True)
class InputSource:
    """One run-time input of a build: its handle's name, geometry and first role, and where a
    new recording finds it: its ``index``-th distinct tensor, or its ``index``-th handle made
    with ``Graph.tensor``/``tensor_like`` (``made`` True)."""

    name: str
    spec: TensorSpec
    role: str
    made: bool
    index: int


@dataclass(frozen=True)
class RecordedBuild:
    nodes: tuple[BuiltNode, ...]
    inputs: tuple[InputSource, ...]  # in positional order
    runner: Any  # a Runner to rebind to the new graph's handles
    cache_keys: tuple[Hashable, ...]


class RecordedBuilds:
    """At most ``MAX_ENTRIES`` recorded builds, oldest dropped first."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, RecordedBuild] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> RecordedBuild | None:
        return self._entries.get(key)

    def put(self, key: Hashable, build: RecordedBuild) -> None:
        with self._lock:
            if len(self._entries) >= MAX_ENTRIES:
                self._entries.pop(next(iter(self._entries)))
            self._entries[key] = build

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
