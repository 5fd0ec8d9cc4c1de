"""The versions ``cudnn-attn --version`` and ``info`` report, and whether cuDNN loads here.

Example::

    $ cudnn-attn --version
    cudnn-attn 0.1.0 (torch 2.13.0+cpu, cuDNN not loadable, frontend 1.32.0, Python 3.11.7)
"""

from __future__ import annotations

import importlib.metadata
import platform
from typing import Any

DISTRIBUTION = "cudnn-attn"


def package_version() -> str:
    """The installed distribution's version; the source tree's ``__version__`` when not installed."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        from .. import __version__

        return __version__


def frontend_versions() -> dict[str, Any]:
    """The frontend's version and the cuDNN library it loads; ``*_error`` keys say why one is missing."""
    try:
        import cudnn  # noqa: PLC0415 - optional and heavy: only imported here
    except Exception as error:  # the package may be missing or its native part unloadable
        return {"frontend": None, "frontend_error": str(error)}
    found: dict[str, Any] = {"frontend": getattr(cudnn, "__version__", "unknown")}
    try:
        found["cudnn"] = cudnn.backend_version_string()
    except Exception as error:  # no libcudnn on this machine
        found["cudnn"] = None
        found["cudnn_error"] = (
            f"the cuDNN library is not loadable here ({str(error).splitlines()[0]}); "
            "on a GPU machine install the cu12 or cu13 extra"
        )
    return found


def cudnn_missing() -> str | None:
    """Why cuDNN cannot run here (no frontend, no library); None when it can."""
    found = frontend_versions()
    if found["frontend"] is None:
        return f"the cuDNN frontend does not import ({found['frontend_error']})"
    return found.get("cudnn_error")


def version_text() -> str:
    """One line: this package's version, then torch's, cuDNN's, the frontend's and Python's."""
    import torch

    found = frontend_versions()
    cudnn = found.get("cudnn") or "not loadable"
    frontend = found.get("frontend") or "not installed"
    return (
        f"{DISTRIBUTION} {package_version()} (torch {torch.__version__}, cuDNN {cudnn}, frontend {frontend}, "
        f"Python {platform.python_version()})"
    )
