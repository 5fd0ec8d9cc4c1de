"""What the frontend's dialect reads of a graph: ``Graph``'s public face, as a Protocol, so that
the wing takes a graph without importing ``graph.py`` (which imports the wing)."""

from __future__ import annotations

from typing import Any, Protocol

from ..cache import PlanCache
from ..recording.handles import OutputHandle
from ..recording.node import Node
from ..recording.state import Recording


class GraphPort(Protocol):
    """A ``cudnn_attn.Graph``: its recording, how it plans, and its build and call."""

    @property
    def name(self) -> str: ...

    @property
    def handle(self) -> Any: ...

    @property
    def backend(self) -> str: ...

    @property
    def autotune(self) -> bool: ...

    @property
    def cache(self) -> PlanCache: ...

    @property
    def is_override_shape_enabled(self) -> bool: ...

    @property
    def recording(self) -> Recording: ...

    @property
    def nodes(self) -> list[Node]: ...

    @property
    def outputs(self) -> list[OutputHandle]: ...

    def build(self, heuristics: Any = None) -> Any: ...

    def __call__(
        self, *args: Any, handle: Any = None, stream: Any = None, out: Any = None, workspace: Any = None
    ) -> Any: ...
