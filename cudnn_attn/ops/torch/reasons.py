"""Why each engine of ``cudnn_attn.sdpa`` passes a call over: the call's half of the dispatch.

The drop-in refuses nothing torch accepts only because cuDNN lacks it. Where cuDNN cannot serve
a well-formed call, or serves it worse (float64; float32 on a GPU, slower forward and no
backward; a scale <= 0 on a GPU, NaN; a bottom-right ``CausalBias`` with dropout or with more
queries than keys), cuDNN's graphs pass it over and torch's SDPA kernel runs it. Asked for by
name (``cudnn_attn.backend("cudnn")``), cuDNN drops the "serves worse" reasons and runs float32
forwards itself.

On the CPU the reference backend passes every plain call over (``ON_CPU``): torch's kernel
computes the same problem, 5-35x faster. What cuDNN lacks is passed over by the reference too,
in every block but ``"cudnn"``, so such a call runs on torch's kernel on every device. Inside
``cudnn_attn.backend("reference")`` the other calls stay on the reference backend (the oracle).
"""

from __future__ import annotations

import torch

from ...core.mask import Causal
from .call import Call

# Measured on an H100 with cuDNN 9.19 (interleaved rounds, medians): torch's float32 kernel ran
# 1.2x (B2 H16 S1k d64) to 2.3x (B1 H32 S8k d128 causal) faster than cuDNN's composite float32
# forward. The Graph API still runs float32 on cuDNN, as the frontend does.
FLOAT32_FORWARD = "float32 on a GPU: torch's float32 kernel measured 1.2-2.3x faster than cuDNN's float32 path"

# Seen on an H100 with cuDNN 9.19 (GPU fuzz campaign): NaN for any scale below 0 and for 0 at most
# lengths; torch 2.13's CPU flash kernel gives NaN for a negative scale with a causal mask. torch's
# math kernel is exact for every scale.
NON_POSITIVE_SCALE = "scale <= 0 or not finite: cuDNN's kernels give NaN there (torch's math kernel is exact)"

# torch takes inf and NaN scales (its answer is NaN); the graphs are keyed by a finite scale.
NON_FINITE_SCALE = "a scale that is inf or NaN: torch's math kernel computes it as torch does"

# torch takes these and answers them exactly; cuDNN's kernels take neither.
ZERO_HEAD_DIM = (
    "a head dim of 0: cuDNN's kernels take head dims >= 8 (torch's math kernel gives the mean of the values)"
)
ALL_DROPPED = "dropout_p=1: cuDNN's dropout scales by 1 / (1 - p) (torch's math kernel gives zeros)"
NO_HEADS = "no query heads: nothing to compute (torch gives the empty output)"
DEGENERATE = (ZERO_HEAD_DIM, ALL_DROPPED, NO_HEADS)

# Measured on a 2-core CPU (torch 2.13, causal B1 H8 d64, docs/benchmarks.md): the reference
# backend ran 5-35x slower than torch's CPU kernel, which computes the same plain attention.
ON_CPU = "CPU tensors: torch's CPU kernel computes this plain attention, 5-35x faster than the reference backend"

# Reasons that say "serves worse", not "cannot": dropped when the backend is asked for by name.
SERVES_WORSE = (FLOAT32_FORWARD, ON_CPU)


def cudnn_lacks(
    dtype: torch.dtype,
    on_gpu: bool,
    length: int,
    keys: int,
    dropout_p: float,
    causal: Causal,
    train: bool,
) -> list[str]:
    """What cuDNN lacks or serves worse for a call of these facts (``length``, ``keys``: L and S)."""
    found = []
    if dtype == torch.float64:
        found.append("float64: cuDNN attention has no double-precision path")
    elif dtype == torch.float32 and on_gpu:
        found.append("float32 with gradients: cuDNN has no float32 backward" if train else FLOAT32_FORWARD)
    if causal is Causal.BOTTOM_RIGHT:
        if dropout_p:
            found.append("a bottom-right causal mask with dropout: cuDNN's bottom-right mask takes no dropout")
        if length > keys:
            found.append(
                f"a bottom-right causal mask with L={length} > S={keys}: cuDNN's bottom-right mask needs L <= S"
            )
    return found


def cudnn(call: Call, asked: bool) -> list[str]:
    """Why cuDNN's graphs pass ``call`` over (``asked``: the block named cuDNN)."""
    found = [NON_POSITIVE_SCALE] if call.on_gpu and not call.scale_positive else []
    found += [NON_FINITE_SCALE] if not call.scale_finite and not found else []
    found += degenerate(call)
    found += cudnn_lacks(
        call.query.dtype, call.on_gpu, call.query.shape[-2], call.key.shape[-2], call.dropout_p, call.causal, call.train
    )
    return [r for r in found if r not in SERVES_WORSE] if asked else found


def degenerate(call: Call) -> list[str]:
    """The degenerate calls torch answers and no kernel should: a head dim of 0, no query heads,
    dropout_p=1."""
    found = [ZERO_HEAD_DIM] if call.query.shape[-1] == 0 or call.value.shape[-1] == 0 else []
    found += [NO_HEADS] if call.query.dim() >= 3 and call.query.shape[-3] == 0 else []
    return found + ([ALL_DROPPED] if call.dropout_p >= 1 else [])


def reference(call: Call, asked: bool) -> list[str]:
    """Why the reference backend's graphs pass ``call`` over: what cuDNN lacks, judged as on the
    CPU (so one kernel runs it on every device), and under "auto" every plain CPU call."""
    found = degenerate(call)
    found += [NON_FINITE_SCALE] if not call.scale_finite else []
    found += cudnn_lacks(
        call.query.dtype, False, call.query.shape[-2], call.key.shape[-2], call.dropout_p, call.causal, call.train
    )
    if not asked and not found and not call.on_gpu:
        found.append(ON_CPU)
    return found


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
    on the CPU, torch's kernel for each of them."""
    found = {}
    for name, (dtype, l, s, p, causal, train) in _CALLS.items():  # noqa: E741
        lacks = cudnn_lacks(dtype, on_gpu, l, s, p, causal, train)
        why = lacks[0] if lacks else (None if on_gpu else ON_CPU)
        found[name] = "cuDNN" if why is None else f"torch's kernel ({why.partition(': ')[2]})"
    return found
