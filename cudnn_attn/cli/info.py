"""``cudnn-attn info``: versions, the GPU, the plan store, which features run here, and every
environment variable the package reads."""

from __future__ import annotations

import json
import platform
from typing import Any

import torch

from .. import log, plan_store
from ..core.environment import VARIABLES
from ..ops import get_backend
from ..ops.dispatch import candidates
from ..ops.torch import reasons as sdpa_reasons
from . import features, versions


def collect() -> dict[str, Any]:
    report: dict[str, Any] = {
        "cudnn_attn": versions.package_version(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
    }
    report.update(versions.frontend_versions())
    report["log_level"] = log.level()
    store = plan_store.default_path()
    report["plan_store"] = str(store) if store is not None else f'off ({plan_store.ENV}="")'
    device = "cpu"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        report["gpu"] = props.name
        report["compute_capability"] = f"{props.major}.{props.minor}"
        device = "cuda:0"
    backend_name = candidates("auto", device)[0]  # the first a Graph tries here
    backend = get_backend(backend_name)
    found = {}
    for feature, problem in features.sample_problems(device).items():
        reasons = backend.not_supported_reasons(problem)
        found[feature] = "yes" if not reasons else "no: " + "; ".join(reasons)
    distributed = features.distributed_reasons()
    found["context parallel"] = "yes" if not distributed else "no: " + "; ".join(distributed)
    report["backend"] = backend_name
    report["features"] = found
    report["sdpa_runs"] = sdpa_reasons.choices(on_gpu=device != "cpu")
    report["environment"] = [
        {"name": v.name, "value": v.current(), "default": v.default, "meaning": v.meaning} for v in VARIABLES
    ]
    return report


def as_text(report: dict[str, Any]) -> str:
    lines = []
    for key, value in report.items():
        if key not in ("features", "sdpa_runs", "environment"):
            lines.append(f"{key:<20} {value}")
    lines.append(f"features on the {report['backend']} backend:")
    lines += [f"  {name:<34} {status}" for name, status in report["features"].items()]
    lines.append("cudnn_attn.sdpa runs:")
    lines += [f"  {name:<32} on {where}" for name, where in report["sdpa_runs"].items()]
    lines.append("environment variables:")
    for v in report["environment"]:
        now = "unset" if v["value"] is None else repr(v["value"])
        lines.append(f"  {v['name']:<26} {now} (default {v['default']}): {v['meaning']}")
    return "\n".join(lines)


def as_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2)
