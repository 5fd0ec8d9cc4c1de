"""cudnn_attn: NVIDIA's fused attention (cuDNN SDPA) as a declarative graph API.

    import cudnn_attn as cudnn
    with cudnn.Graph() as g:
        o, stats = g.sdpa(q=Q, k=K, v=V, generate_stats=True, use_causal_mask=True)
    O, S = g(Q, K, V)

CPU tensors run on the pure-PyTorch reference backend; CUDA tensors on cuDNN.

The cuDNN frontend's module-level attention names (``backend_version``, ``set_stream``,
``diagonal_alignment``, ``cudnnGraphNotSupportedError``, ...) mean here what they mean there
(``frontend/compat.py``, ``errors.py``); the frontend's other names (convolutions, norms, GEMMs,
``create_kernel_cache``, ...) raise an ``AttributeError`` that points to ``import cudnn``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import TYPE_CHECKING, Any

from .errors import GraphStateError, ShapeMismatchError, UnsupportedError, ValidationError

if TYPE_CHECKING:  # what the names below resolve to, for type checkers and editors
    from . import nn
    from .buckets import BucketedAttention
    from .cache import PlanCache, default_cache
    from .core.dtypes import data_type
    from .core.problem import AttentionProblem, Causal, KVCacheLayout, Op, TensorSpec
    from .errors import cudnnGraphNotSupportedError
    from .fp8 import sdpa_fp8
    from .fp8_scaling import Fp8Scaling
    from .fp8_tensor import Fp8Tensor
    from .frontend.compat import (
        Handle,
        attention_implementation,
        backend_version,
        backend_version_string,
        build_plan_policy,
        create_handle,
        cuda_graph_retention,
        destroy_handle,
        diagonal_alignment,
        get_last_error_string,
        get_stream,
        handle,
        heur_mode,
        scalar_type,
        set_stream,
    )
    from .frontend.decorators import graph_cache, jit
    from .functional import sdpa
    from .graph import Graph, graph, pygraph
    from .ops.cudnn.autotune import set_autotune
    from .runtime.backend_choice import backend
    from .serving.paged_attention import PagedAttention
    from .varlen import varlen_sdpa

# Each public name and the module that defines it, imported when the name is first used: the
# package's modules (and through them the frontend, Triton, ...) cost start-up a script that only
# imports the package should not pay. ``graph`` is the frontend's function, not the module.
_LAZY = {
    "nn": ".nn",
    "BucketedAttention": ".buckets",
    "PlanCache": ".cache",
    "default_cache": ".cache",
    "data_type": ".core.dtypes",
    **dict.fromkeys(("AttentionProblem", "Causal", "KVCacheLayout", "Op", "TensorSpec"), ".core.problem"),
    "cudnnGraphNotSupportedError": ".errors",
    "sdpa_fp8": ".fp8",
    "Fp8Scaling": ".fp8_scaling",
    "Fp8Tensor": ".fp8_tensor",
    **dict.fromkeys(
        (
            "Handle",
            "attention_implementation",
            "backend_version",
            "backend_version_string",
            "build_plan_policy",
            "create_handle",
            "cuda_graph_retention",
            "destroy_handle",
            "diagonal_alignment",
            "get_last_error_string",
            "get_stream",
            "handle",
            "heur_mode",
            "scalar_type",
            "set_stream",
        ),
        ".frontend.compat",
    ),
    **dict.fromkeys(("graph_cache", "jit"), ".frontend.decorators"),
    "sdpa": ".functional",
    **dict.fromkeys(("Graph", "graph", "pygraph"), ".graph"),
    "set_autotune": ".ops.cudnn.autotune",
    "backend": ".runtime.backend_choice",
    "PagedAttention": ".serving.paged_attention",
    "varlen_sdpa": ".varlen",
}

_SUBMODULES = frozenset({"nn"})  # the public names that are the submodule itself

__version__ = "0.1.0"  # this library's version; the frontend's is cudnn.__version__


def __getattr__(name: str) -> Any:
    """A public name on first use (imported from its module, then kept here). Names this package
    does not have: the frontend's (outside the attention surface covered here) are pointed to
    ``import cudnn``; any other, private names included, is the usual ``AttributeError``, so
    ``hasattr`` answers as without this hook."""
    where = _LAZY.get(name)
    if where is not None:
        module = importlib.import_module(where, __name__)
        # Only the names in _SUBMODULES are modules: ``graph`` names both a module and the
        # frontend's function defined in it, and the package's ``graph`` is the function.
        value = module if name in _SUBMODULES else getattr(module, name)
        setattr(sys.modules[__name__], name, value)  # through _Package.__setattr__, its one rule
        return globals()[name]
    message = f"module {__name__!r} has no attribute {name!r}"
    public = name.isidentifier() and not name.startswith("_")
    # A submodule of ours not imported yet is ours, whatever the frontend calls the same name.
    if public and importlib.util.find_spec(f"{__name__}.{name}") is None:
        from .frontend.compat import frontend_names

        if name in frontend_names():
            message += (
                f"; cudnn_attn covers the cuDNN frontend's attention surface only, and {name!r} is a frontend name "
                f"it does not provide: use cudnn.{name} from nvidia-cudnn-frontend (import cudnn)"
            )
    raise AttributeError(message, name=name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


class _Package(types.ModuleType):
    """This package's module type: importing the submodule ``graph`` (which the package's own
    modules do) binds the frontend's function ``graph`` here, not the module, as the frontend's
    ``cudnn.graph`` is. The module itself stays ``sys.modules["cudnn_attn.graph"]``."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "graph" and isinstance(value, types.ModuleType):
            value = value.graph
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = [
    "AttentionProblem",
    "BucketedAttention",
    "Causal",
    "Graph",
    "GraphStateError",
    "Handle",
    "KVCacheLayout",
    "Op",
    "PagedAttention",
    "PlanCache",
    "ShapeMismatchError",
    "TensorSpec",
    "UnsupportedError",
    "ValidationError",
    "attention_implementation",
    "backend",
    "backend_version",
    "backend_version_string",
    "build_plan_policy",
    "create_handle",
    "cuda_graph_retention",
    "cudnnGraphNotSupportedError",
    "data_type",
    "default_cache",
    "destroy_handle",
    "diagonal_alignment",
    "get_last_error_string",
    "get_stream",
    "graph",
    "graph_cache",
    "handle",
    "heur_mode",
    "jit",
    "nn",
    "pygraph",
    "scalar_type",
    "sdpa",
    "Fp8Scaling",
    "Fp8Tensor",
    "sdpa_fp8",
    "set_autotune",
    "set_stream",
    "varlen_sdpa",
]
