"""The cuDNN frontend's own options, checked: ``pygraph``'s parameters beyond Graph's, ``tensor()``'s
descriptor flags, heuristic modes and ``build_plans`` policies.

Each check returns the problems as lines (none: taken); the caller raises them together, naming
itself. Most of these options are accepted and change nothing here (plans are built for the GPU
that runs them, through the plan cache); what each means is said where it is checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..cache import PlanCache
from ..core.dtypes import to_torch_dtype_or_problem
from ..errors import UnsupportedError, ValidationError
from ..ops import BACKEND_NAMES

RETENTION = ("PER_GRAPH", "NONE")


# pygraph's own parameters at their defaults, in its order (sm_count ... is_cuda_graph_replay_expected).
FRONTEND_DEFAULTS = (None, None, None, None, False, False, None, False)
DTYPE_ARGUMENTS = ("io_data_type", "intermediate_data_type", "compute_data_type")


def graph_arguments(
    name: Any, dtypes: tuple, backend: Any, cache: Any, frontend: tuple, kwargs: dict[str, Any]
) -> dict[str, torch.dtype | None]:
    """``Graph(...)``'s arguments checked, all problems in one ``ValidationError``; returns the
    torch dtypes of ``io_data_type``, ``intermediate_data_type`` and ``compute_data_type``.
    ``frontend``: the frontend's own graph parameters, in ``FRONTEND_DEFAULTS``' order."""
    problems: list[str] = []
    converted: dict[str, torch.dtype | None] = dict.fromkeys(DTYPE_ARGUMENTS)
    if any(value is not None for value in dtypes):
        for arg, value in zip(DTYPE_ARGUMENTS, dtypes):
            converted[arg] = to_torch_dtype_or_problem(value, arg, problems)
    if backend not in BACKEND_NAMES:
        problems.append(f"backend: {backend!r}; allowed {', '.join(map(repr, BACKEND_NAMES))}")
    if cache is not None and not isinstance(cache, PlanCache):
        problems.append(f"cache: {type(cache).__name__}; expected a cudnn_attn.PlanCache")
    if kwargs or frontend != FRONTEND_DEFAULTS:  # checked only when given: graphs are made per call
        problems += frontend_options(*frontend, **kwargs)
    if name is not None and not isinstance(name, str):
        problems.append(f"name: {name!r}; expected a string")
    if problems:
        raise ValidationError(problems, context="Graph")
    return converted


def frontend_options(
    sm_count: Any,
    sm_version: Any,
    kernel_cache: Any,
    device_property: Any,
    is_dynamic_shape_enabled: Any,
    is_override_shape_enabled: Any,
    cuda_graph_retention: Any,
    is_cuda_graph_replay_expected: Any,
    /,
    **unknown: Any,
) -> list[str]:
    """The problems with ``pygraph``'s own parameters, one line each. What they mean here:
    ``sm_count`` and ``sm_version`` are recorded on the graph (plans are built for, and use the
    whole of, the GPU that runs them); ``kernel_cache`` is accepted (the plan cache and store keep
    built plans); the shape flags and the CUDA-graph hints are accepted (a packed plan serves
    every token count; captured runs replay as built). ``device_property`` asks for deviceless
    compilation, which is refused: plans are built on the GPU that runs them."""
    if device_property is not None:
        raise UnsupportedError(
            [
                "device_property: deviceless (ahead-of-time) compilation is not available here; "
                "plans are built on the GPU that runs them"
            ],
            context="Graph",
        )
    problems = [f"{name}: not a parameter of pygraph" for name in unknown]
    for name, value in (("sm_count", sm_count), ("sm_version", sm_version)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            problems.append(f"{name}: {value!r}; expected an int >= 1 or None")
    for name, flag in (
        ("is_dynamic_shape_enabled", is_dynamic_shape_enabled),
        ("is_override_shape_enabled", is_override_shape_enabled),
        ("is_cuda_graph_replay_expected", is_cuda_graph_replay_expected),
    ):
        if not isinstance(flag, bool):
            problems.append(f"{name}: {flag!r}; expected True or False")
    retention = getattr(cuda_graph_retention, "name", cuda_graph_retention)
    if retention is not None and retention not in RETENTION:
        problems.append(f"cuda_graph_retention: {cuda_graph_retention!r}; allowed None, PER_GRAPH or NONE")
    return problems


def frontend_tensor_options(is_virtual: Any, reordering_type: Any, multiplier: Any) -> list[str]:
    """Why a ``tensor(...)`` of the frontend cannot be taken here, one line per reason (none: taken)."""
    reasons = []
    if is_virtual:
        reasons.append(
            "is_virtual: virtual tensors connect the frontend's non-attention ops, which cudnn_attn does "
            "not provide (use cudnn for such graphs)"
        )
    if multiplier != 1:
        reasons.append(
            f"ragged_offset_multiplier: {multiplier!r}; ragged offsets are taken in elements (multiplier 1): "
            "multiply the offsets tensor instead"
        )
    if reordering_type is not None and getattr(reordering_type, "name", reordering_type) != "NONE":
        reasons.append(f"reordering_type: {reordering_type!r}; block-scaled (MXFP8) layouts are not supported")
    return reasons


HEURISTIC_MODES = ("A", "B", "FALLBACK", "OPENSOURCE")


def heuristics_problems(modes: Any, argument: str = "heuristics") -> list[str]:
    """Why ``modes`` (a heur_mode, or a list of them, ours or the frontend's) is not a list of heuristic modes."""
    given = modes if isinstance(modes, (list, tuple)) else [modes]
    bad = [m for m in given if getattr(m, "name", m) not in HEURISTIC_MODES]
    return [f"{argument}: {m!r}; expected heur_mode members ({', '.join(HEURISTIC_MODES)})" for m in bad]


def check_heuristics(given: Sequence[Any], context: str) -> None:
    """``ValidationError`` for every entry of ``given`` (each a heur_mode or a list of them) that is none."""
    problems = [p for modes in given for p in heuristics_problems(modes)]
    if problems:
        raise ValidationError(problems, context=context)


POLICIES = ("HEURISTICS_CHOICE", "ALL")


def check_policies(args: tuple, kwargs: dict[str, Any], context: str) -> None:
    """``ValidationError`` unless ``build_plans(*args, **kwargs)`` is given ``build_plan_policy`` members
    (as ``policy``)."""
    bad = [p for p in [*args, *kwargs.values()] if getattr(p, "name", p) not in POLICIES]
    unknown = [f"{k}: not a parameter of build_plans" for k in set(kwargs) - {"policy"}]
    if bad or unknown:
        policies = [f"policy: {p!r}; expected build_plan_policy.HEURISTICS_CHOICE or ALL" for p in bad]
        raise ValidationError(policies + unknown, context=context)
