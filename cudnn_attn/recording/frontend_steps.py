"""The cuDNN frontend's build steps and ``execute``, for code written against ``cudnn.pygraph``.

The frontend builds in steps (validate, build the operation graph, create and check plans,
build plans); here all of them amount to one ``build()``, so frontend code runs unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ShapeMismatchError, UnsupportedError, ValidationError
from .declared import resolve
from .handles import InputHandle

RETENTION = ("PER_GRAPH", "NONE")


# pygraph's own parameters at their defaults, in its order (sm_count ... is_cuda_graph_replay_expected).
FRONTEND_DEFAULTS = (None, None, None, None, False, False, None, False)


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
        raise UnsupportedError(["device_property: deviceless (ahead-of-time) compilation is not available here; "
                                "plans are built on the GPU that runs them"], context="Graph")  # fmt: skip
    problems = [f"{name}: not a parameter of pygraph" for name in unknown]
    for name, value in (("sm_count", sm_count), ("sm_version", sm_version)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            problems.append(f"{name}: {value!r}; expected an int >= 1 or None")
    for name, flag in (("is_dynamic_shape_enabled", is_dynamic_shape_enabled),
                       ("is_override_shape_enabled", is_override_shape_enabled),
                       ("is_cuda_graph_replay_expected", is_cuda_graph_replay_expected)):  # fmt: skip
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
        reasons.append("is_virtual: virtual tensors connect the frontend's non-attention ops, which cudnn_attn does "
                       "not provide (use cudnn for such graphs)")  # fmt: skip
    if multiplier != 1:
        reasons.append(f"ragged_offset_multiplier: {multiplier!r}; ragged offsets are taken in elements (multiplier 1): "
                       "multiply the offsets tensor instead")  # fmt: skip
    if reordering_type is not None and getattr(reordering_type, "name", reordering_type) != "NONE":
        reasons.append(f"reordering_type: {reordering_type!r}; block-scaled (MXFP8) layouts are not supported")
    return reasons


class FrontendSteps:
    """Mixed into ``Graph``: the frontend's method names, each a call of ``build()``."""

    def build(self) -> Any:
        raise NotImplementedError

    def validate(self) -> Any:
        return self.build()

    def build_operation_graph(self) -> Any:
        return self.build()

    def create_execution_plans(self, *heuristics: Any) -> Any:
        return self.build()

    def check_support(self, *args: Any) -> Any:
        return self.build()

    def build_plans(self, *args: Any) -> Any:
        return self.build()

    def get_workspace_size(self) -> int:
        self.build()
        return max((getattr(node.plan, "workspace_size", 0) for node in self.nodes), default=0)  # type: ignore[attr-defined]

    def execute(
        self, variant_pack: Mapping[Any, Any], workspace: Any = None, handle: Any = None, stream: Any = None
    ) -> None:
        """The frontend's run: ``variant_pack`` maps every tensor of the graph (inputs and the outputs
        produced) to its data, keyed by handle, name or uid; ``None`` keys are ignored, as there."""
        if not isinstance(variant_pack, Mapping):
            raise ValidationError([f"variant_pack: {type(variant_pack).__name__}; expected a dict of handle -> tensor"])
        self.build()
        recording = self.recording  # type: ignore[attr-defined]
        inputs: dict[Any, Any] = {}
        outputs: dict[Any, Any] = {}
        unknown: list[str] = []
        for key, value in variant_pack.items():
            handle = resolve(recording, key)
            if handle is None:
                if key is not None:
                    unknown.append(f"{key!r}: not a tensor of this graph (keys: handles, names or uids)")
                continue
            (inputs if isinstance(handle, InputHandle) else outputs)[handle] = value
        if unknown:
            raise ShapeMismatchError(unknown, context="execute")
        missing = [h.name for h in self.outputs if h not in outputs]  # type: ignore[attr-defined]
        if missing:
            raise ShapeMismatchError(
                [f"{name}: missing from the variant pack (outputs are written in place)" for name in missing]
            )
        self(inputs, handle=handle, stream=stream, out=outputs, workspace=workspace)  # type: ignore[operator]
