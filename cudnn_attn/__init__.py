"""cudnn_attn: NVIDIA's fused attention (cuDNN SDPA) as a declarative graph API.

    import cudnn_attn as cudnn
    with cudnn.Graph() as g:
        o, stats = g.sdpa(q=Q, k=K, v=V, generate_stats=True, use_causal_mask=True)
    O, S = g(Q, K, V)

CPU tensors run on the pure-PyTorch reference backend; CUDA tensors on cuDNN.
"""

from __future__ import annotations

from . import nn
from .buckets import BucketedAttention
from .cache import PlanCache, default_cache
from .compat import Handle, create_handle, destroy_handle, heur_mode
from .core.dtypes import data_type
from .core.problem import AttentionProblem, Causal, KVCacheLayout, Op, TensorSpec
from .errors import GraphStateError, ShapeMismatchError, UnsupportedError, ValidationError
from .fp8 import sdpa_fp8
from .fp8_scaling import Fp8Scaling
from .functional import sdpa
from .graph import Graph
from .ops.cudnn.autotune import set_autotune
from .serving.paged_attention import PagedAttention
from .varlen import varlen_sdpa

__version__ = "0.1.0"

# The frontend's spelling, for `import cudnn_attn as cudnn` drop-in use.
pygraph = Graph

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
    "create_handle",
    "data_type",
    "default_cache",
    "destroy_handle",
    "heur_mode",
    "nn",
    "pygraph",
    "sdpa",
    "Fp8Scaling",
    "sdpa_fp8",
    "set_autotune",
    "varlen_sdpa",
]
