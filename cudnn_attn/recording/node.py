"""A graph node: one recorded op, its input and output handles and its parsed arguments.

Recording never raises for bad input: every problem becomes a line of ``node.errors``, and
the graph reports all of them together when it is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.problem import AttentionProblem, Op
from ..core.roles import user_name
from .keywords import Parsed

if TYPE_CHECKING:
    from ..ops.base import Plan
    from .handles import InputHandle, OutputHandle


@dataclass
class Node:
    op: Op
    name: str
    positional: tuple[str, ...]  # the recording method's input roles, in its parameter order
    parsed: Parsed | None = None  # the mask/scale/length/dropout keywords, parsed when the graph is built
    spelling: dict[str, str] = field(default_factory=dict)  # role -> this method's argument name
    inputs: dict[str, InputHandle | OutputHandle] = field(default_factory=dict)
    outputs: dict[str, OutputHandle] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    paged: bool = False  # k and v are paged caches
    kv_cache_layout: Any = None  # as given; inferred from the cache's shape when None
    deterministic: bool = False
    fp8: bool = False  # recorded by sdpa_fp8 / sdpa_fp8_backward: FP8 data with per-tensor scales
    problem: AttentionProblem | None = None
    plan: Plan | None = None
    backend: str | None = None
    cache_key: Any = None  # the plan's key in the plan cache

    @property
    def runtime(self) -> dict[str, int]:
        """Inputs passed by value on every run (int dropout seeds and offsets)."""
        return self.parsed.runtime if self.parsed is not None else {}

    def argument(self, role: str) -> str:
        """The name this node's method gives ``role`` (what errors should say)."""
        return self.spelling.get(role) or user_name(role)
