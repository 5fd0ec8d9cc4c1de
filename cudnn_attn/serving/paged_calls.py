"""cuDNN's paged calls of one ``PagedAttention``: the run prepared for each call's problem, found
from its tensors' geometry, and an eager step's runs bound to its tables.

A step's layers repeat one geometry, so the tensors' shapes, strides, dtypes and devices lead
straight to the prepared run (building and hashing the problem's specs costs several times the
tuple). Eager decode steps go one further: the first layer of a geometry after each ``plan``
binds the run to the step's tables and lengths (``PreparedRun.bind``), and every later layer
binds only its query, caches and outputs.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.constructors import forward_problem
from ..core.mask import Causal, ScoreOptions
from ..core.problem import KVCacheLayout, TensorSpec
from ..runtime.keyed import KeyedCache
from ..runtime.prepared import PreparedRun, prepare
from .step import Step, geometry, keyed_parts

MAX_RUNS = 256  # the prepared runs one instance keeps: a few per layer geometry
FIXED_ROLES = ("page_table_k", "page_table_v", "seq_len_q", "seq_len_kv")  # a step's, shared by its layers


class PagedCalls:
    """The paged calls of attention with ``scale`` over caches of ``page_size`` tokens in
    ``kv_layout``. Prepared runs are kept by the problem their plan was built for, as long as
    this object (a captured step replays their plans), not dropped with the plan cache's
    entries."""

    def __init__(self, scale: float, page_size: int, kv_layout: str, autotune: bool):
        self.scale, self.page_size, self.kv_layout, self.autotune = scale, page_size, kv_layout, autotune
        self.runs = KeyedCache(MAX_RUNS)  # by the problem a plan was built for
        self._fast = KeyedCache(4 * MAX_RUNS)  # by the call's tensor geometry, in front

    def run(
        self,
        inputs: dict[str, torch.Tensor],
        outputs: dict[str, torch.Tensor],
        *,
        causal: bool,
        max_seq_len_q: int | None = None,
    ) -> None:
        """One paged forward: ``inputs`` and ``outputs`` by role, bottom-right ``causal`` or not.
        Its problem is these tensors' geometry, the outputs' own strides included; the run
        prepared for it serves every call of that problem (a packed q's token count aside: the
        plan reads it at run time, ``AttentionProblem.for_plan``), trusting the caller's geometry."""
        self.prepared(inputs, outputs, causal, max_seq_len_q).run(inputs, outputs)

    def run_part(
        self,
        part: str,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        derived: dict[str, Any],
        outputs: dict[str, torch.Tensor],
        *,
        eager_step: Step | None,
    ) -> None:
        """One part of a decode layer (``"body"`` or the causal ``"tail"``) over the step's
        ``derived`` tables; ``eager_step``: the planned step, where it is not one captured for
        replay, so bound runs serve it."""
        bound = self._bound(part, q, k_cache, v_cache, outputs, derived, eager_step) if eager_step else None
        if bound is not None:
            bound(q, k_cache, v_cache, *outputs.values())
        else:
            self.run(part_inputs(part, q, k_cache, v_cache, derived), outputs, causal=part == "tail")

    def prepared(
        self, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor], causal: bool, max_seq_len_q: int | None
    ) -> PreparedRun:
        """The run of these tensors' problem (one per plan: a packed q's token count aside)."""
        fast = (causal, max_seq_len_q, *geometry(inputs), *geometry(outputs))
        run = self._fast.get(fast)
        if run is None:
            run = self._fast.put(fast, self._problem_run(inputs, outputs, causal, max_seq_len_q))
        return run

    def _bound(
        self,
        part: str,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        outputs: dict[str, torch.Tensor],
        derived: dict[str, Any],
        step: Step,
    ) -> Any:
        """An eager step's run of one part, bound to the step's tables once. Kept in the step's
        ``derived``, which every plan makes anew; None while a CUDA graph is captured (a replay
        must read the tables as they are then, not as bound now)."""
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        bindings = derived.setdefault("bound", {})
        key: tuple = (part, q.shape, q.stride(), k_cache.shape, k_cache.stride(), v_cache.stride())
        key += tuple(t.stride() for t in outputs.values())
        bound = bindings.get(key)
        if bound is None:
            inputs = part_inputs(part, q, k_cache, v_cache, derived)
            run = self.prepared(inputs, outputs, part == "tail", None)
            assert tuple(outputs) == run.output_roles  # the order a bound run takes them in
            # Every sequence's query rows are whole: a decode part's seq_len_q is its S_q.
            fixed = {role: inputs[role] for role in FIXED_ROLES}
            # Where the host knows now that every row has keys, nothing is filled after cuDNN.
            every_row = part in keyed_parts(step.shortest(), derived["schedule"], self.page_size)
            bound = bindings[key] = run.bind(fixed, ("q", "k", "v"), whole_sequences=True, no_empty_sequences=every_row)
        return bound

    def _problem_run(
        self, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor], causal: bool, max_seq_len_q: int | None
    ) -> PreparedRun:
        """The run prepared for these tensors' problem, built (or found) by the planner."""
        spec = TensorSpec.of
        options = ScoreOptions(
            attn_scale=self.scale, causal=Causal.BOTTOM_RIGHT if causal else Causal.NONE, padding=True
        )
        problem = forward_problem(
            spec(inputs["q"]),
            spec(inputs["k"]),
            spec(inputs["v"]),
            options,
            stats="stats" in outputs,
            seq_len_q=spec(inputs["seq_len_q"]),
            seq_len_kv=spec(inputs["seq_len_kv"]),
            max_seq_len_q=max_seq_len_q,
            max_seq_len_kv=inputs["page_table_k"].shape[1] * self.page_size,
            page_table_k=spec(inputs["page_table_k"]),
            page_table_v=spec(inputs["page_table_v"]),
            kv_cache_layout=KVCacheLayout(self.kv_layout),
            sink_token=spec(inputs["sink_token"]) if "sink_token" in inputs else None,
        )
        o, stats = spec(outputs["o"]), spec(outputs["stats"]) if "stats" in outputs else None
        if problem.o != o or problem.stats != stats:  # the outputs given are laid out otherwise
            problem = problem.replace(o=o, stats=stats)
        key = problem.for_plan()
        run = self.runs.get(key)
        if run is None:  # values checked once, as a plan's first build does
            run = self.runs.put(key, prepare(problem, autotune=self.autotune, values=inputs, context="PagedAttention"))
        return run


def part_inputs(
    part: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, derived: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """A decode part's inputs by role: the layer's q and caches, the step's tables for ``part``."""
    table = derived[f"{part}_table"]
    return {
        "q": q,
        "k": k_cache,
        "v": v_cache,
        "page_table_k": table,
        "page_table_v": table,
        "seq_len_q": derived[f"{part}_q_lengths"],
        "seq_len_kv": derived[f"{part}_lengths"],
    }
