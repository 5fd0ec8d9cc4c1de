"""``prepare(problem)``: the one door below ``Graph``. A validated problem's plan, ready to run.

Every torch-facing entry point (the functional ``sdpa``, its compile op, varlen, FP8,
buckets, ``PagedAttention``, context parallelism) builds its ``AttentionProblem`` once and asks
here for a prepared run: no entry point spells frontend keywords for a graph to parse again,
and none writes a plan-cache key by hand (the planner derives it from the problem). Prepared
runs are kept by problem, so an entry point's own fast key in front of this one is optional.

A prepared run holds its plan. This table (and ``BucketedAttention``'s) registers with the plan
cache's ``on_drop`` and forgets the runs whose plans the cache drops, so a problem asked for again
gets its plan within the cache's bounds; the hot paths' own tables in front (the eager flat key,
context parallelism's blocks) are bounded by entries instead, and keep their runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..cache import default_cache
from ..core import bounds, validation
from ..core.problem import AttentionProblem
from ..core.roles import problem_inputs, problem_outputs
from ..errors import UnsupportedError, ValidationError
from ..ops.cudnn.autotune import enabled_by_default
from . import backend_choice, planner
from .keyed import KeyedCache

MAX_PREPARED = 1024


class PreparedRun:
    """One problem's plan. ``input_roles``/``output_roles``: the run's tensors, in the order
    ``run_ordered`` takes and returns them."""

    def __init__(self, problem: AttentionProblem, planned: planner.Planned):
        self.problem = problem
        self.plan = planned.plan
        self.backend = planned.backend
        self.cache_key = planned.cache_key
        self.input_roles = problem_inputs(problem)
        self.output_roles = problem_outputs(problem)
        specs = [getattr(problem, role) for role in self.output_roles]
        self._allocations = tuple((s.shape, s.stride, s.dtype, s.device) for s in specs)
        direct = getattr(self.plan, "direct_uids", None)
        self._uids = direct(self.input_roles, self.output_roles) if direct is not None else None

    def run(
        self,
        inputs: Mapping[str, Any],
        outputs: Mapping[str, torch.Tensor] | None = None,
        *,
        stream: Any = None,
        workspace: Any = None,
        handle: Any = None,
    ) -> dict[str, torch.Tensor]:
        """Run on tensors by role (geometry proven by the caller); outputs not given are allocated.
        Returns every output by role."""
        written = dict(outputs) if outputs else {}
        for role, (shape, stride, dtype, device) in zip(self.output_roles, self._allocations):
            if role not in written:
                written[role] = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        self.plan(inputs, written, stream=stream, workspace=workspace, handle=handle)
        return written

    def run_ordered(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run on the inputs in ``input_roles`` order (geometry proven by the caller); the outputs,
        allocated here, in ``output_roles`` order. The hot path: one call into the plan."""
        outputs = [
            torch.empty_strided(shape, stride, dtype=dtype, device=device)
            for shape, stride, dtype, device in self._allocations
        ]
        if self._uids is not None:
            self.plan.execute_ordered((*tensors, *outputs), self._uids, None, None, None)  # type: ignore[attr-defined]
        else:
            self.plan(dict(zip(self.input_roles, tensors)), dict(zip(self.output_roles, outputs)))
        return outputs

    def bind(
        self,
        fixed: Mapping[str, torch.Tensor],
        varying: tuple[str, ...],
        *,
        whole_sequences: bool = False,
        no_empty_sequences: bool = False,
    ) -> Callable[..., None]:
        """A run over ``fixed`` tensors by role (a serving step's tables and lengths, read as they
        are now: bind again after writing them), called with the ``varying`` roles' tensors in
        order, then every output in ``output_roles`` order. ``whole_sequences``: each
        ``seq_len_q`` is 0 or the problem's ``S_q``; ``no_empty_sequences``: and every length in
        ``fixed`` is positive (known on the host), so every output row is written. A cuDNN plan
        binds once what a plain run does per call (``ops/cudnn/bound_run.py``); other plans run
        as ``run`` does."""
        bind = getattr(self.plan, "bind", None)
        bound = (
            bind(
                fixed,
                varying,
                self.output_roles,
                whole_sequences=whole_sequences,
                no_empty_sequences=no_empty_sequences,
            )
            if bind
            else None
        )
        if bound is not None:
            return bound
        count = len(varying)

        def run(*tensors: torch.Tensor) -> None:
            inputs = {**fixed, **dict(zip(varying, tensors[:count]))}
            self.run(inputs, dict(zip(self.output_roles, tensors[count:])))

        return run

    @property
    def nbytes(self) -> int:
        return getattr(self.plan, "nbytes", 0)


_prepared = KeyedCache(MAX_PREPARED)


def prepare(
    problem: AttentionProblem,
    *,
    backend: str = "auto",
    autotune: bool | None = None,
    cache: Any = None,
    values: Mapping[str, torch.Tensor] | None = None,
    context: str | None = None,
) -> PreparedRun:
    """``problem`` validated and planned (``ValidationError``/``UnsupportedError`` naming what is
    wrong, with ``context``). ``values``: integer inputs at hand (lengths, page tables, by role)
    whose values are checked too. ``cache``: a ``PlanCache``, the default one if None.
    ``backend``: "auto" takes an enclosing ``cudnn_attn.backend(...)`` block's choice."""
    backend = backend_choice.resolve(backend)  # before the key: runs never cross backends
    cache = cache if cache is not None else default_cache()
    tune = enabled_by_default() if autotune is None else bool(autotune)
    key = (problem, backend, tune, id(cache))
    found = _prepared.get(key)
    if found is not None:
        if values:
            _check_values(problem, values, context)
        return found
    lines = validation.problems(problem)
    if lines:
        raise ValidationError(lines, context=context)
    if values:
        _check_values(problem, values, context)
    try:
        planned = planner.plan(problem, backend, tune, cache)
    except UnsupportedError as error:
        raise UnsupportedError(error.problems, context=context, alternatives=error.alternatives) from None
    cache.on_drop(_prepared.forget_plans)
    return _prepared.put(key, PreparedRun(problem, planned))


def _check_values(problem: AttentionProblem, values: Mapping[str, torch.Tensor], context: str | None) -> None:
    lines = bounds.value_problems(problem, values)
    if lines:
        raise ValidationError(lines, context=context)


def clear() -> None:
    """Forget every prepared run (their plans stay in their plan caches)."""
    _prepared.clear()


def held() -> list[PreparedRun]:
    """The prepared runs kept now, oldest first."""
    return _prepared.values()
