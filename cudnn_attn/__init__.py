"""cudnn_attn: NVIDIA's fused attention (cuDNN SDPA) as a declarative graph API.

    import cudnn_attn as cudnn
    with cudnn.Graph() as g:
        o, stats = g.sdpa(q=Q, k=K, v=V, generate_stats=True, use_causal_mask=True)
    O, S = g(Q, K, V)

CPU tensors run on the pure-PyTorch reference backend; CUDA tensors on cuDNN.

The cuDNN frontend's module-level attention names (``backend_version``, ``set_stream``,
``diagonal_alignment``, ``cudnnGraphNotSupportedError``, ...) mean here what they mean there
(``compat.py``, ``errors.py``); the frontend's other names (convolutions, norms, GEMMs,
``create_kernel_cache``, ...) raise an ``AttributeError`` that points to ``import cudnn``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from . import nn
from .buckets import BucketedAttention
from .cache import PlanCache, default_cache
from .compat import (
    Handle,
    attention_implementation,
    backend_version,
    backend_version_string,
    build_plan_policy,
    create_handle,
    destroy_handle,
    diagonal_alignment,
    get_last_error_string,
    get_stream,
    handle,
    heur_mode,
    set_stream,
)
from .compat import frontend_names as _frontend_names
from .core.dtypes import data_type
from .core.problem import AttentionProblem, Causal, KVCacheLayout, Op, TensorSpec
from .errors import GraphStateError, ShapeMismatchError, UnsupportedError, ValidationError, cudnnGraphNotSupportedError
from .fp8 import sdpa_fp8
from .fp8_scaling import Fp8Scaling
from .functional import sdpa
from .graph import Graph, graph, pygraph  # graph: the frontend's function, shadowing the module on purpose
from .ops.cudnn.autotune import set_autotune
from .recording.frontend_steps import graph_cache, jit
from .serving.paged_attention import PagedAttention
from .varlen import varlen_sdpa

__version__ = "0.1.0"  # this library's version; the frontend's is cudnn.__version__


def __getattr__(name: str) -> Any:
    """Names this package does not have: the frontend's (outside the attention surface covered
    here) are pointed to ``import cudnn``; any other, private names included, is the usual
    ``AttributeError``, so ``hasattr`` answers as without this hook."""
    message = f"module {__name__!r} has no attribute {name!r}"
    public = name.isidentifier() and not name.startswith("_")
    # A submodule of ours not imported yet is ours, whatever the frontend calls the same name.
    if public and name in _frontend_names() and importlib.util.find_spec(f"{__name__}.{name}") is None:
        message += (
            f"; cudnn_attn covers the cuDNN frontend's attention surface only, and {name!r} is a frontend name it "
            f"does not provide: use cudnn.{name} from nvidia-cudnn-frontend (import cudnn)"
        )
    raise AttributeError(message, name=name)


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
    "backend_version",
    "backend_version_string",
    "build_plan_policy",
    "create_handle",
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
    "sdpa",
    "Fp8Scaling",
    "sdpa_fp8",
    "set_autotune",
    "set_stream",
    "varlen_sdpa",
]
