"""The one small interface every backend implements.

A backend declares what it can run as ``not_supported_reasons(problem)`` (xformers-style:
each reason is the failing condition, e.g. "head_dim=320 > 256"), and turns a problem into
a ``Plan``: a prepared callable, built once and cached, cheap to run and safe to call
many times.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from ..core.problem import AttentionProblem

# Run-time values a plan reads: tensors by role, plus int dropout seeds/offsets.
RunInputs = Mapping[str, "torch.Tensor | int"]


class Plan(Protocol):
    workspace_size: int

    def __call__(
        self,
        inputs: RunInputs,
        outputs: Mapping[str, torch.Tensor],
        *,
        stream: Any = None,
        workspace: torch.Tensor | None = None,
        handle: Any = None,
    ) -> None:
        """Compute the node, writing every tensor of ``outputs`` (role -> tensor) in place."""

    def plan_count(self) -> int:
        """How many candidate plans the backend ranked for the problem (the frontend's plan helpers)."""

    def plan_name_at(self, index: int) -> str:
        """Candidate ``index``'s name."""

    def at_index(self, index: int) -> Plan:
        """This plan running candidate ``index`` instead of the chosen one."""


class Backend(Protocol):
    name: str
    tunable: bool  # whether ``build(autotune=True)`` times candidate plans
    stores_plans: bool  # whether ``build`` loads and saves plans through the persistent store

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        """Why this backend cannot run ``problem`` here; empty when it can."""

    def plan_key(self, problem: AttentionProblem) -> tuple:
        """What besides the problem decides the built plan (GPU architecture, library versions)."""

    def from_blob(self, problem: AttentionProblem, blob: bytes) -> Plan:
        """A plan ``to_blob`` serialized (a graph's ``serialize()``), ready to run again."""

    def to_blob(self, plan: Any) -> bytes:
        """What ``from_blob`` needs besides the problem to run ``plan`` again."""

    def build(self, problem: AttentionProblem, *, autotune: bool = False, store: Any = None) -> Plan:
        """A ready-to-run plan for a problem this backend supports (tuned, and loaded from or
        saved to the persistent ``store``, where the backend has such things)."""
