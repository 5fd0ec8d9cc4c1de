"""``sdpa_fp8(..., backward="fp8")``: gradients through cuDNN's FP8 backward.

dO is scaled by its current amax. dS (cast to FP8 inside the kernel) and the gradients dQ, dK,
dV are written in FP8 too, so their scales must be known before the kernel runs: they come
from the amax histories an ``Fp8Scaling`` keeps (the kernel reports each amax, and every
backward records them). The first backward has no history: it runs the kernel once with
unit scales to measure the amaxes, then again with their scales.
"""

from __future__ import annotations

from typing import Any

import torch

from .core.problem import TensorSpec
from .fp8_scaling import Fp8Scaling
from .graph_cache import GraphCache
from .kernels.fp8_cast import from_fp8

_graphs = GraphCache()


def gradients(saved: dict[str, Any], d_out: torch.Tensor, scaling: Fp8Scaling, dtype: torch.dtype,
              scales: torch.Tensor | None = None) -> tuple[list, torch.Tensor]:  # fmt: skip
    """dQ, dK, dV in ``dtype`` from what the FP8 forward kept (``saved``) and ``d_out``, and
    the gradient scales used ([4]). Given ``scales`` (an earlier backward's), those are used
    and the history is left as it is."""
    from .sdpa_fp8 import quantised

    do8, descale_do = quantised(d_out)
    if scales is not None:
        results = _run(saved, do8, descale_do, scales)
    else:
        scales = scaling.gradient_scales(d_out.device)
        if scales is None:  # no history yet: measure this backward's amaxes first
            scaling.record_gradients(list(_run(saved, do8, descale_do, torch.ones(4, device=d_out.device))[3:]))
            scales = scaling.gradient_scales(d_out.device)
            assert scales is not None
        results = _run(saved, do8, descale_do, scales)
        scaling.record_gradients(list(results[3:]))
    return [from_fp8(g8, (1.0 / scales[i]).reshape(1, 1, 1, 1), dtype) for i, g8 in enumerate(results[:3])], scales


def _run(saved: dict[str, Any], do8: torch.Tensor, descale_do: torch.Tensor, scales: torch.Tensor) -> tuple:
    """The FP8 backward with gradient scales ``scales`` (dQ, dK, dV, dS): (dQ, dK, dV, Amax_dQ,
    Amax_dK, Amax_dV, Amax_dP). Every scale is its own tensor: one given twice would be one input."""
    q8, k8, v8, o8, stats = saved["q8"], saved["k8"], saved["v8"], saved["o8"], saved["stats"]
    scale_s = saved["scale_s"]
    scale_dq, scale_dk, scale_dv, scale_dp = (scales[i].reshape(1, 1, 1, 1).clone() for i in range(4))
    args = (q8, k8, v8, o8, do8, stats, saved["descale_q"], saved["descale_k"], saved["descale_v"],
            saved["descale_v"].clone(), descale_do, 1.0 / scale_s, 1.0 / scale_dp, scale_s.clone(), scale_dq,
            scale_dk, scale_dv, scale_dp)  # fmt: skip
    graph = _graph(args, saved["is_causal"], saved["attn_scale"])
    return graph(*args)


def _graph(args: tuple, is_causal: bool, attn_scale: float) -> Any:
    key = (*(TensorSpec.of(t) for t in args[:6]), is_causal, attn_scale)

    def record(g: Any) -> None:
        g.sdpa_fp8_backward(*args, attn_scale=attn_scale, use_causal_mask=is_causal)

    return _graphs.get_or_build(key, record)
