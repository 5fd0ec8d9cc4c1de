"""The cuDNN backend: lowers problems to cuDNN execution plans through the frontend."""

from __future__ import annotations

from ..problem import AttentionProblem


class CudnnBackend:
    name = "cudnn"

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        if not problem.device.startswith("cuda"):
            return [f"device={problem.device}: cuDNN runs on CUDA tensors"]
        return ["the cuDNN lowering is not available in this version"]

    def plan_key(self, problem: AttentionProblem) -> tuple:
        return ()

    def build(self, problem: AttentionProblem):
        raise NotImplementedError
