"""Backends side by side behind one interface (``base``), and the choice between them
(``dispatch``: a priority list per device, every backend's reasons in one error)."""

from __future__ import annotations

from .base import Backend, Plan
from .dispatch import BACKEND_NAMES, BACKENDS, LENGTHS_BACKEND_NAMES, get_backend, select
from .reference.backend import ReferenceBackend

__all__ = [
    "Backend",
    "Plan",
    "ReferenceBackend",
    "get_backend",
    "select",
    "BACKEND_NAMES",
    "BACKENDS",
    "LENGTHS_BACKEND_NAMES",
]
