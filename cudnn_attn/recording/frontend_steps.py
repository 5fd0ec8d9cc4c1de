"""The cuDNN frontend's build steps and ``execute``, for code written against ``cudnn.pygraph``.

The frontend builds in steps (validate, build the operation graph, create and check plans,
build plans); here all of them amount to one ``build()``, so frontend code runs unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ShapeMismatchError, ValidationError
from .handles import InputHandle, OutputHandle


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
        """The frontend's run: ``variant_pack`` maps every handle (inputs and outputs) to a tensor."""
        if not isinstance(variant_pack, Mapping):
            raise ValidationError([f"variant_pack: {type(variant_pack).__name__}; expected a dict of handle -> tensor"])
        self.build()
        inputs = {h: t for h, t in variant_pack.items() if isinstance(h, InputHandle)}
        outputs = {h: t for h, t in variant_pack.items() if isinstance(h, OutputHandle)}
        missing = [h.name for h in self.outputs if h not in outputs]  # type: ignore[attr-defined]
        if missing:
            raise ShapeMismatchError(
                [f"{name}: missing from the variant pack (outputs are written in place)" for name in missing]
            )
        self(inputs, handle=handle, stream=stream, out=outputs, workspace=workspace)  # type: ignore[operator]
