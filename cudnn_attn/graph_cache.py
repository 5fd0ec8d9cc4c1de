"""Built graphs kept by a caller's own key (a call signature): what the functional form and
``BucketedAttention`` look up on every call instead of recording and building again.

An LRU bounded in entries and in the bytes the graphs' plans hold.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from . import lifecycle
from .graph import Graph

DEFAULT_MAX_GRAPHS = 256
DEFAULT_MAX_BYTES = 1 << 30

_instances: weakref.WeakSet[GraphCache] = weakref.WeakSet()


class GraphCache:
    """Built graphs by key. ``get_or_build(key, record)`` records a new graph with
    ``record(graph)`` and builds it on a miss."""

    def __init__(self, maxsize: int = DEFAULT_MAX_GRAPHS, max_bytes: int = DEFAULT_MAX_BYTES, **graph_options: Any):
        self.maxsize = maxsize
        self.max_bytes = max_bytes
        self.graph_options = graph_options
        self._graphs: OrderedDict[Hashable, tuple[Graph, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        _instances.add(self)

    def get_or_build(self, key: Hashable, record: Callable[[Graph], Any]) -> Graph:
        with self._lock:
            entry = self._graphs.get(key)
            if entry is not None:
                self._graphs.move_to_end(key)
                return entry[0]
        graph = Graph(**self.graph_options)
        record(graph)
        graph.build()
        size = graph.nbytes()
        with self._lock:
            if key not in self._graphs:
                self._graphs[key] = (graph, size)
                self._bytes += size
            while self._graphs and (len(self._graphs) > self.maxsize or self._bytes > self.max_bytes):
                _, (_, dropped) = self._graphs.popitem(last=False)
                self._bytes -= dropped
        return graph

    def __len__(self) -> int:
        return len(self._graphs)

    def graphs(self) -> list[Graph]:
        """The held graphs, least recently used first."""
        with self._lock:
            return [graph for graph, _ in self._graphs.values()]

    @property
    def nbytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        with self._lock:
            self._graphs.clear()
            self._bytes = 0


@lifecycle.at_exit
def _clear_all() -> None:
    for cache in list(_instances):
        cache.clear()
