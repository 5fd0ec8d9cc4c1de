"""When ``cudnn_attn.sdpa`` hands a call to torch's own SDPA kernel, and why.

The drop-in refuses nothing torch accepts only because cuDNN lacks it. Where cuDNN cannot serve
a well-formed call, or serves it worse (float64; float32 on a GPU, slower forward and no backward;
a scale <= 0 on a GPU, NaN; a bottom-right ``CausalBias`` with dropout or with more queries than
keys), the call runs on ``torch.nn.functional.scaled_dot_product_attention`` with the caller's
arguments, and the choice is logged once per reason (``CUDNN_ATTN_LOG_LEVEL=info``).

On the CPU every plain call (``attn_mask``, ``is_causal``, ``scale``, ``dropout_p``,
``enable_gqa``; no sinks, softcap or window, which take the score-terms path) runs on torch's
kernel too: it computes the same problem, 5-35x faster than the reference backend. Inside
``cudnn_attn.backend("reference")`` such calls stay on the reference backend (the oracle), and
the Graph API runs CPU tensors there as before.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import log
from ..core import validation
from ..core.constructors import forward_problem
from ..core.mask import Causal, ScoreOptions
from ..core.problem import TensorSpec
from ..errors import UnsupportedError, ValidationError
from ..runtime import backend_choice
from .arguments import ARGUMENT_NAMES, batched

WHERE = "cudnn_attn.sdpa"
_said: set[str] = set()  # each reason is logged once, not per call


# Measured on an H100 with cuDNN 9.19 (interleaved rounds, medians): torch's float32 kernel ran
# 1.2x (B2 H16 S1k d64) to 2.3x (B1 H32 S8k d128 causal) faster than cuDNN's composite float32
# forward. The Graph API still runs float32 on cuDNN, as the frontend does.
FLOAT32_FORWARD = "float32 on a GPU: torch's float32 kernel measured 1.2-2.3x faster than cuDNN's float32 path"


# Seen on an H100 with cuDNN 9.19 (GPU fuzz campaign): NaN for any scale below 0 and for 0 at most
# lengths; torch 2.13's CPU flash kernel gives NaN for a negative scale with a causal mask. torch's
# math kernel is exact for every scale.
NON_POSITIVE_SCALE = "scale <= 0: cuDNN's kernels give NaN there (torch's math kernel is exact)"


# Measured on a 2-core CPU (torch 2.13, causal B1 H8 d64, docs/benchmarks.md): the reference
# backend ran 5-35x slower than torch's CPU kernel, which computes the same plain attention.
ON_CPU = "CPU tensors: torch's CPU kernel computes this plain attention, 5-35x faster than the reference backend"


def reason(query: torch.Tensor, key: torch.Tensor, dropout_p: float, causal: Causal, train: bool,
           scale: Any = None) -> str | None:  # fmt: skip
    """Why this call cannot run on cudnn_attn's graphs and goes to torch's kernel; None if it can.

    Under ``cudnn_attn.backend("reference")`` a CUDA call is judged as a CPU one (the reference
    backend runs it); under ``backend("cudnn")`` a call cuDNN cannot serve raises
    ``UnsupportedError`` instead of leaving for torch's kernel (float32 forward runs on cuDNN)."""
    chosen = "auto" if torch.compiler.is_compiling() else backend_choice.chosen()
    on_cudnn = query.is_cuda and chosen != "reference"
    why = None
    if scale is not None and float(scale) <= 0 and on_cudnn:  # the reference backend is exact there
        why = NON_POSITIVE_SCALE
    else:
        why = reason_for(query.dtype, on_cudnn, query.shape[-2], key.shape[-2], dropout_p, causal, train)
    if why is None and chosen == "auto" and query.device.type == "cpu":
        return ON_CPU  # the caller checks it as a graph would (check_as_graph)
    if why is None or chosen != "cudnn" or why is FLOAT32_FORWARD:
        return why
    raise UnsupportedError([why], context='sdpa under cudnn_attn.backend("cudnn")',
                           alternatives=['cudnn_attn.backend("auto") runs it on torch\'s kernel'])  # fmt: skip


def reason_for(dtype: torch.dtype, on_gpu: bool, l: int, s: int, dropout_p: float, causal: Causal,  # noqa: E741
               train: bool) -> str | None:  # fmt: skip
    """``reason`` from a call's facts alone (``l``, ``s``: query and key lengths)."""
    if dtype == torch.float64:
        return "float64: cuDNN attention has no double-precision path"
    if dtype == torch.float32 and on_gpu:
        if train:
            return "float32 with gradients: cuDNN has no float32 backward"
        return FLOAT32_FORWARD
    if causal is Causal.BOTTOM_RIGHT:
        if dropout_p:
            return "a bottom-right causal mask with dropout: cuDNN's bottom-right mask takes no dropout"
        if l > s:
            return f"a bottom-right causal mask with L={l} > S={s}: cuDNN's bottom-right mask needs L <= S"
    return None


# The kinds of call ``info`` reports, as (dtype, L, S, dropout_p, causal, train).
_CALLS = {
    "float16/bfloat16": (torch.bfloat16, 128, 128, 0.0, Causal.NONE, True),
    "float32": (torch.float32, 128, 128, 0.0, Causal.NONE, False),
    "float32 with gradients": (torch.float32, 128, 128, 0.0, Causal.NONE, True),
    "float64": (torch.float64, 128, 128, 0.0, Causal.NONE, False),
    "causal_lower_right with dropout": (torch.bfloat16, 128, 256, 0.1, Causal.BOTTOM_RIGHT, True),
}


def choices(on_gpu: bool) -> dict[str, str]:
    """Where ``cudnn_attn.sdpa`` runs the calls that may leave cuDNN, on this machine (for ``info``):
    on the CPU, torch's kernel for each of them (``reason``)."""
    found = {}
    for name, (dtype, l, s, p, causal, train) in _CALLS.items():  # noqa: E741
        why = reason_for(dtype, on_gpu, l, s, p, causal, train) or (None if on_gpu else ON_CPU)
        found[name] = "cuDNN" if why is None else f"torch's kernel ({why.partition(': ')[2]})"
    return found


def check_as_graph(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Any,
    dropout_p: float,
    causal: Causal,
    scale: Any,
    train: bool,
) -> None:
    """Refuse an ``ON_CPU`` call the graphs would refuse (a head dim not a multiple of 8, ...), so
    code that runs on the CPU runs unchanged on a GPU: validation is the same whatever runs it."""
    q, k, v, bias, scale, _ = batched(query, key, value, attn_mask, scale)
    seed = torch.zeros(1, dtype=torch.int64) if dropout_p else None
    spec = TensorSpec.of
    problem = forward_problem(
        spec(q),
        spec(k),
        spec(v),
        ScoreOptions(attn_scale=scale, causal=causal, dropout_p=float(dropout_p)),
        stats=train,
        bias=None if bias is None else spec(bias),
        dropout_seed=None if seed is None else spec(seed),
        dropout_offset=None if seed is None else spec(seed),
    )
    lines = validation.problems(problem)
    if lines:
        raise ValidationError(lines, context="sdpa").renamed(ARGUMENT_NAMES, context="sdpa")


def run(why: str, query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: float, causal: Causal,
        scale: Any, enable_gqa: bool) -> torch.Tensor:  # fmt: skip
    """torch's SDPA on the call (a bottom-right causal mask as torch's own ``causal_lower_right``)."""
    if why not in _said and not torch.compiler.is_compiling():
        _said.add(why)
        log.backend_passed_over(WHERE, "cudnn_attn's graphs", why + "; runs on torch's SDPA kernel")
    problems = shape_problems(query, key, value, enable_gqa)
    if problems:  # what torch's kernel would raise a RuntimeError for, said as the graphs say it
        raise ValidationError(problems, context="sdpa")
    if isinstance(attn_mask, torch.Tensor) and attn_mask.dim() < 2:
        # torch 2.13's CPU flash kernel raises IndexError for a 0-D or 1-D mask beside 4-D inputs
        # (its math kernel broadcasts it, as documented): [S] and [1, S] are the same mask.
        attn_mask = attn_mask.reshape((1,) * (2 - attn_mask.dim()) + tuple(attn_mask.shape))
    if causal is Causal.BOTTOM_RIGHT:
        from torch.nn.attention.bias import causal_lower_right  # loads torch._dynamo: not at import

        attn_mask = causal_lower_right(query.shape[-2], key.shape[-2])
    if why is ON_CPU and (scale is None or float(scale) > 0):
        return _torch_sdpa(query, key, value, attn_mask, dropout_p, causal, scale, enable_gqa)  # torch's own choice
    if query.device.type == "cpu" or why is NON_POSITIVE_SCALE:
        # torch 2.13's CPU flash kernel returns NaN everywhere for a negative scale with a causal
        # mask (float32 and float64); its math kernel is exact there.
        with sdpa_kernel(SDPBackend.MATH):
            return _torch_sdpa(query, key, value, attn_mask, dropout_p, causal, scale, enable_gqa)
    return _torch_sdpa(query, key, value, attn_mask, dropout_p, causal, scale, enable_gqa)


def shape_problems(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool) -> list[str]:
    """The geometry torch's kernel needs and the graphs check themselves (head dims, lengths, heads)."""
    problems = []
    if query.shape[-1] == 0 or value.shape[-1] == 0:
        problems.append(f"query: head dim {query.shape[-1]} (value {value.shape[-1]}); head dims must be >= 1")
    if key.shape[-1] != query.shape[-1]:
        problems.append(f"key: head dim {key.shape[-1]} differs from query's {query.shape[-1]}")
    if value.shape[-2] != key.shape[-2]:
        problems.append(f"value: {value.shape[-2]} keys but key has {key.shape[-2]}; they must match")
    if query.dim() >= 3 and (key.shape[-3] != value.shape[-3] or query.shape[-3] % max(key.shape[-3], 1)):
        problems.append(
            f"key: {key.shape[-3]} heads (value {value.shape[-3]}) for query's {query.shape[-3]}; key and value "
            "share one head count that divides query's" + ("" if enable_gqa else " (and enable_gqa=True for fewer)")
        )
    if query.dim() == 4 and not (query.shape[0] == key.shape[0] == value.shape[0]):
        problems.append(f"key: batch {key.shape[0]} (value {value.shape[0]}) differs from query's {query.shape[0]}")
    return problems


def _torch_sdpa(query, key, value, attn_mask, dropout_p, causal: Causal, scale, enable_gqa) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=causal is Causal.TOP_LEFT,
        scale=scale, enable_gqa=enable_gqa,
    )  # fmt: skip
