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

from .graph import Graph
from .runtime import lifecycle

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
        self._graphs: OrderedDict[Hashable, Graph] = OrderedDict()
        self._lock = threading.Lock()
        _instances.add(self)

    def get_or_build(self, key: Hashable, record: Callable[[Graph], Any]) -> Graph:
        with self._lock:
            graph = self._graphs.get(key)
            if graph is not None:
                self._graphs.move_to_end(key)
                return graph
        graph = Graph(**self.graph_options)
        record(graph)
        graph.build()
        with self._lock:
            self._graphs.setdefault(key, graph)
            self._evict()
        return graph

    def _evict(self) -> None:
        """Drop least recently used graphs while over either bound (the newest always stays).
        Bytes are summed afresh: a cuDNN plan's workspace appears on its first run."""
        held = sum(graph.nbytes() for graph in self._graphs.values())
        while len(self._graphs) > 1 and (len(self._graphs) > self.maxsize or held > self.max_bytes):
            _, dropped = self._graphs.popitem(last=False)
            held -= dropped.nbytes()

    def __len__(self) -> int:
        return len(self._graphs)

    def graphs(self) -> list[Graph]:
        """The held graphs, least recently used first."""
        with self._lock:
            return list(self._graphs.values())

    def nbytes(self) -> int:
        """Bytes the held graphs' plans hold now."""
        with self._lock:
            return sum(graph.nbytes() for graph in self._graphs.values())

    def clear(self) -> None:
        with self._lock:
            self._graphs.clear()


@lifecycle.at_exit
def _clear_all() -> None:
    for cache in list(_instances):
        cache.clear()
