"""What this machine offers: versions, the GPU, and which attention features run here."""

from __future__ import annotations

import json
import platform
from typing import Any

import torch

from .. import __version__, log, plan_store
from ..core.mask import Causal, ScoreOptions
from ..core.problem import AttentionProblem, KVCacheLayout, Op, TensorSpec
from ..functional import torch_kernel
from ..ops import get_backend


def _frontend() -> dict[str, Any]:
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


def _sample_problems(device: str) -> dict[str, AttentionProblem]:
    """One small problem per feature, to ask each backend what it supports."""

    def spec(*shape: int, dtype: torch.dtype = torch.bfloat16) -> TensorSpec:
        return TensorSpec.contiguous(shape, dtype, device)

    q = spec(2, 8, 128, 128)
    base = AttentionProblem(op=Op.FORWARD, q=q, k=q, v=q, o=q, options=ScoreOptions(attn_scale=128**-0.5))
    lengths = spec(2, dtype=torch.int32)
    stats = spec(2, 8, 128, 1, dtype=torch.float32)
    cache = spec(16, 16, 8, 128)
    table = spec(2, 8, dtype=torch.int32)
    q_thd = spec(256, 8, 128)
    return {
        "forward fp16": base.replace(
            q=spec(2, 8, 128, 128, dtype=torch.float16),
            k=spec(2, 8, 128, 128, dtype=torch.float16),
            v=spec(2, 8, 128, 128, dtype=torch.float16),
            o=spec(2, 8, 128, 128, dtype=torch.float16),
        ),
        "forward bf16": base,
        "forward fp32": base.replace(
            q=spec(2, 8, 128, 128, dtype=torch.float32),
            k=spec(2, 8, 128, 128, dtype=torch.float32),
            v=spec(2, 8, 128, 128, dtype=torch.float32),
            o=spec(2, 8, 128, 128, dtype=torch.float32),
        ),
        "causal": base.replace(causal=Causal.TOP_LEFT),
        "causal bottom-right": base.replace(causal=Causal.BOTTOM_RIGHT),
        "sliding window": base.replace(causal=Causal.TOP_LEFT, sliding_window=64),
        "GQA": base.replace(k=spec(2, 2, 128, 128), v=spec(2, 2, 128, 128)),
        "bias": base.replace(bias=spec(1, 8, 128, 128)),
        "ALiBi": base.replace(causal=Causal.TOP_LEFT, alibi=True),
        "padding": base.replace(padding=True, seq_len_q=lengths, seq_len_kv=lengths),
        "THD (ragged)": base.replace(
            q=q_thd,
            k=q_thd,
            v=q_thd,
            o=q_thd,
            padding=True,
            seq_len_q=lengths,
            seq_len_kv=lengths,
            max_seq_len_q=128,
            max_seq_len_kv=128,
        ),
        "dropout": base.replace(dropout_p=0.1, stats=stats),
        "head dim 256": base.replace(
            q=spec(2, 8, 128, 256), k=spec(2, 8, 128, 256), v=spec(2, 8, 128, 256), o=spec(2, 8, 128, 256)
        ),
        "paged KV cache": base.replace(
            q=spec(2, 8, 1, 128),
            o=spec(2, 8, 1, 128),
            k=cache,
            v=cache,
            padding=True,
            seq_len_kv=lengths,
            page_table_k=table,
            page_table_v=table,
            kv_cache_layout=KVCacheLayout.NPHD,
        ),
        "backward": base.replace(op=Op.BACKWARD, stats=stats, grad_o=q, grad_q=q, grad_k=q, grad_v=q),
    }


def collect() -> dict[str, Any]:
    report: dict[str, Any] = {
        "cudnn_attn": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
    }
    report.update(_frontend())
    report["log_level"] = log.level()
    store = plan_store.default_path()
    report["plan_store"] = str(store) if store is not None else f'off ({plan_store.ENV}="")'
    device = "cpu"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        report["gpu"] = props.name
        report["compute_capability"] = f"{props.major}.{props.minor}"
        device = "cuda:0"
    backend_name = "cudnn" if device != "cpu" else "reference"
    backend = get_backend(backend_name)
    features = {}
    for feature, problem in _sample_problems(device).items():
        reasons = backend.not_supported_reasons(problem)
        features[feature] = "yes" if not reasons else "no: " + "; ".join(reasons)
    report["backend"] = backend_name
    report["features"] = features
    report["sdpa_runs"] = torch_kernel.choices(on_gpu=device != "cpu")
    return report


def as_text(report: dict[str, Any]) -> str:
    lines = []
    for key, value in report.items():
        if key not in ("features", "sdpa_runs"):
            lines.append(f"{key:<20} {value}")
    lines.append(f"features on the {report['backend']} backend:")
    lines += [f"  {name:<22} {status}" for name, status in report["features"].items()]
    lines.append("cudnn_attn.sdpa runs:")
    lines += [f"  {name:<32} on {where}" for name, where in report["sdpa_runs"].items()]
    return "\n".join(lines)


def as_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2)
