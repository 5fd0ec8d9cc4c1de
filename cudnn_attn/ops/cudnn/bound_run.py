"""A cuDNN plan bound to the tensors that stay fixed for a while: a serving step's page tables
and lengths, shared by every layer.

``CudnnPlan.__call__`` does per call what keeps any input safe: lengths and page indices
clamped into range (looked up per content), outputs filled where cuDNN leaves rows unwritten,
every tensor bound by uid. A decode step passes the same tables to every layer, so ``bind``
does that once: the fixed tensors clamped, the uids ordered, the rows of empty sequences found.
A bound run then binds only the tensors that change (q, the layer's caches, the outputs) and
launches the plan: about half the host time of a plain call (``cudnn-attn bench --overhead``).

The fixed tensors are read as they are at ``bind``: the binder binds again once it writes them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from ...core.bounds import clamped
from ...core.roles import UID

if TYPE_CHECKING:
    from .plan import CudnnPlan


class BoundRun:
    """``plan`` over ``fixed`` tensors by role; called with the ``varying`` roles' tensors, in
    order, then the outputs' in ``output_roles`` order. ``whole_sequences``: each sequence's
    ``seq_len_q`` is 0 or the plan's ``S_q`` (a decode body's), so cuDNN leaves unwritten only
    the rows of sequences with no keys or queries, and one masked fill after the run stands in
    for the fill before it. ``no_empty_sequences``: and the binder knows (from host values) that
    every fixed length is positive, so cuDNN writes every row and nothing is filled (the masked
    fill is 7.4 us of host time alone on an H200 host, a bound decode layer about 30 without it)."""

    def __init__(
        self,
        plan: CudnnPlan,
        fixed: Mapping[str, torch.Tensor],
        varying: Sequence[str],
        output_roles: Sequence[str],
        *,
        whole_sequences: bool,
        no_empty_sequences: bool = False,
    ):
        assert whole_sequences or not no_empty_sequences, "no_empty_sequences speaks of whole sequences"
        problem = plan.problem
        fixed = clamped(problem, fixed, plan.bounds)  # as every plain call clamps them, once
        self._plan = plan
        self._uids = tuple(UID[role] for role in (*varying, *output_roles, *fixed)) + tuple(plan.constants)
        self._fixed = (*fixed.values(), *plan.constants.values())
        self._output_roles = tuple(output_roles)
        self._fill_before = plan.fills_outputs and not whole_sequences
        self._fix_after: Callable[[Mapping[str, torch.Tensor]], None] | None = None
        self._empty: torch.Tensor | None = None
        if no_empty_sequences:
            return  # cuDNN writes every row: nothing to fill or fix
        if plan.fills_outputs and whole_sequences:
            empty = torch.zeros(problem.batch, dtype=torch.bool, device=plan.device)
            for role in ("seq_len_q", "seq_len_kv"):
                if role in fixed:
                    empty |= fixed[role].reshape(-1) <= 0
            self._empty = empty.view(-1, 1, 1, 1)
        elif plan.empty_fix is not None:
            fix = plan.empty_fix
            self._fix_after = lambda outputs: fix(fixed, outputs)

    def __call__(self, *tensors: torch.Tensor) -> None:
        outputs = tensors[-len(self._output_roles) :]
        if self._fill_before:
            for role, tensor in zip(self._output_roles, outputs):
                tensor.fill_(float("-inf") if role == "stats" else 0.0)
        self._plan.execute_ordered((*tensors, *self._fixed), self._uids, None, None, None)
        if self._empty is not None:
            for role, tensor in zip(self._output_roles, outputs):
                tensor.masked_fill_(self._empty, float("-inf") if role == "stats" else 0.0)
        elif self._fix_after is not None:
            self._fix_after(dict(zip(self._output_roles, outputs)))
