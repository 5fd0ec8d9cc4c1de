"""Backends side by side behind one interface, and the choice between them."""

from __future__ import annotations

from ..core.problem import AttentionProblem
from ..errors import UnsupportedError
from .base import Backend, Plan
from .reference.backend import ReferenceBackend

BACKEND_NAMES = ("auto", "cudnn", "reference")

_backends: dict[str, Backend] = {}


def get_backend(name: str) -> Backend:
    """The backend instance called ``name`` ("cudnn" or "reference"); created once."""
    if name not in _backends:
        if name == "reference":
            _backends[name] = ReferenceBackend()
        elif name == "cudnn":
            from .cudnn.backend import CudnnBackend  # the frontend is imported lazily

            _backends[name] = CudnnBackend()
        else:
            raise ValueError(f"backend: {name!r}; allowed {', '.join(BACKEND_NAMES)}")
    return _backends[name]


def select_backend(requested: str, problem: AttentionProblem) -> Backend:
    """The backend that will run ``problem``: cuDNN for CUDA tensors and the reference
    backend for CPU tensors under "auto"; raises ``UnsupportedError`` with every reason."""
    name = requested
    if requested == "auto":
        name = "cudnn" if problem.device.startswith("cuda") else "reference"
    backend = get_backend(name)
    reasons = backend.not_supported_reasons(problem)
    if reasons:
        alternatives = [] if name == "reference" else [_reference_hint(problem)]
        raise UnsupportedError(reasons, context=f"{name} backend, {problem.describe()}", alternatives=alternatives)
    return backend


def _reference_hint(problem: AttentionProblem) -> str:
    """What would work instead, phrased so that following it works."""
    import torch

    if problem.device.startswith("cuda") and not torch.cuda.is_available():
        return (
            "no CUDA device is visible here: give CPU tensors (or Graph.tensor(..., device='cpu')) "
            "to run on the reference backend"
        )
    return 'backend="reference" runs every valid problem on these tensors (slowly)'


__all__ = ["Backend", "Plan", "ReferenceBackend", "get_backend", "select_backend", "BACKEND_NAMES"]
