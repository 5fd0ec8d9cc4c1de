"""``cudnn_attn.fp8``: FP8 attention with fp16/bf16 in and out, scaling done for the caller.

Per-tensor current scaling, as TransformerEngine's current-scaling recipe does: each of Q, K,
V is scaled so that its largest magnitude lands on E4M3's largest value (448), quantised, and
the FP8 op runs with the matching descales; or, with ``scaling=Fp8Scaling()``, delayed
scaling from an amax history (``fp8_scaling.py``). P (the softmax, in [0, 1]) takes the fixed scale
448, as cuDNN's samples do. O's scale needs no second pass: every row of O is a convex
combination of V's rows, so ``|O| <= max|V|`` and V's own scale never saturates O. The FP8
output is dequantised into the inputs' dtype.

Gradients (``backward=``): ``"bf16"`` (the default) recomputes attention from the 16-bit
inputs with the 16-bit forward and backward plans; ``"fp8"`` runs cuDNN's FP8 backward, with
the scales of dS and of the gradients from the amax histories of ``scaling`` (required).
"""

from __future__ import annotations

from typing import Any, cast

import torch

from .core.constructors import backward_problem, forward_problem
from .core.dtypes import dtype_name
from .core.mask import Causal, ScoreOptions, default_scale
from .core.problem import TensorSpec
from .core.roles import FP8_BACKWARD_AMAXES, FP8_BACKWARD_SCALES, FP8_SCALES
from .errors import ShapeMismatchError, UnsupportedError, ValidationError, shown
from .fp8_scaling import Fp8Scaling
from .fp8_tensor import Fp8Tensor, check_fp8_inputs
from .functional.arguments import ARGUMENT_NAMES, check_arguments, materialised
from .kernels.fp8_cast import (
    E4M3,
    E4M3_MAX,
    amax_qkv,
    finite_amaxes,
    from_fp8,
    quantise_qkv,
    reciprocal_scale,
    scale_view,
    scales_for,
)
from .runtime.prepared import PreparedRun, prepare
from .runtime.training import differentiable

BACKWARDS = ("bf16", "fp8")
INPUT_DTYPES = (torch.float16, torch.bfloat16)


def sdpa_fp8(
    query: torch.Tensor | Fp8Tensor,
    key: torch.Tensor | Fp8Tensor,
    value: torch.Tensor | Fp8Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    backward: str = "bf16",
    scaling: Fp8Scaling | None = None,
    out_dtype: torch.dtype | None = None,
) -> Any:
    """Attention through FP8 (E4M3) kernels, with the scaling done for the caller.

    fp16/bf16 in and out: each of Q, K, V is scaled so that its largest magnitude lands on
    E4M3's largest value (448), quantised, attended with the matching descales, and O
    dequantised into the inputs' dtype (current scaling, TransformerEngine's recipe); or, with
    ``scaling``, delayed scaling from an amax history. FP8 producers and consumers skip the
    casts: pass three ``Fp8Tensor`` and/or ask ``out_dtype=torch.float8_e4m3fn``. On a GPU this
    needs Hopper or newer and cuDNN >= 9.7 (not 9.10.0), head dims up to 128; on the CPU the
    reference backend emulates the FP8 kernels exactly. Differentiable.

    Args:
        query: ``[B, H_q, L, E]`` (or ``[H_q, L, E]``) float16 or bfloat16, or an ``Fp8Tensor``.
        key: ``[B, H_kv, S, E]``, as query.
        value: ``[B, H_kv, S, E_v]``, as query.
        attn_mask: must be None: cuDNN's FP8 attention takes no bias (use ``is_causal``).
        is_causal: top-left causal mask.
        scale: factor on ``query @ key^T``; ``1 / sqrt(E)`` by default.
        enable_gqa: let ``H_kv`` divide ``H_q``.
        backward: how gradients are computed: ``"bf16"`` (the default) recomputes attention
            from the 16-bit inputs with the 16-bit plans; ``"fp8"`` runs cuDNN's FP8 backward,
            with the gradients' scales from ``scaling``'s histories (required then).
        scaling: an ``Fp8Scaling`` for delayed scaling (one pass per tensor, scales from its
            amax history; keep one per attention site); None scales by each call's amaxes.
        out_dtype: float16, bfloat16, float32 or float8_e4m3fn; the inputs' dtype by default
            (FP8 in, FP8 out). ``float8_e4m3fn`` returns an ``Fp8Tensor`` whose descale is V's
            (``|O| <= max|V|``: never saturated); it carries no gradient.

    Returns:
        The attention output ``[B, H_q, L, E_v]`` in ``out_dtype``, or an ``Fp8Tensor``.

    Raises:
        ValidationError: torch's rules on the arguments; inputs other than float16/bfloat16
            (or three ``Fp8Tensor``); empty inputs; a bad ``backward``, ``scaling`` or
            ``out_dtype``; gradients asked of FP8 inputs or outputs.
        UnsupportedError: ``attn_mask`` given, or a GPU/cuDNN that cannot run FP8 attention.

    Example:
        ```python
        import torch

        import cudnn_attn

        q, k, v = (torch.randn(2, 4, 128, 64, dtype=torch.bfloat16) for _ in range(3))
        out = cudnn_attn.sdpa_fp8(q, k, v, is_causal=True)  # bf16 out, within FP8's error
        expected = cudnn_attn.sdpa(q, k, v, is_causal=True).float()
        assert (out.float() - expected).norm() / expected.norm() < 0.1

        q8, k8, v8 = (cudnn_attn.Fp8Tensor.quantise(t) for t in (q, k, v))  # FP8 in and out
        o8 = cudnn_attn.sdpa_fp8(q8, k8, v8, is_causal=True)
        assert o8.data.dtype == torch.float8_e4m3fn
        ```
    """
    if any(isinstance(x, Fp8Tensor) for x in (query, key, value)):
        return _on_fp8_inputs(query, key, value, attn_mask, is_causal, scale, enable_gqa, backward, scaling, out_dtype)
    query, key, value = cast(torch.Tensor, query), cast(torch.Tensor, key), cast(torch.Tensor, value)
    _check_arguments(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    _check_tensors(query, key, value)
    if attn_mask is not None:
        raise UnsupportedError(
            ["attn_mask: FP8 attention takes no mask tensor (cuDNN's FP8 op has no bias); use is_causal"],
            context="sdpa_fp8",
        )
    if scaling is not None and not isinstance(scaling, Fp8Scaling):
        raise ValidationError([f"scaling: {type(scaling).__name__}; expected a cudnn_attn.Fp8Scaling or None"])
    if backward not in BACKWARDS:
        raise ValidationError([f"backward: {backward!r}; allowed 'bf16' or 'fp8'"], context="sdpa_fp8")
    if backward == "fp8" and scaling is None:
        raise ValidationError(
            [
                "backward: 'fp8' needs scaling=cudnn_attn.Fp8Scaling(): the scales of dS and of the gradients "
                "come from its amax histories"
            ],
            context="sdpa_fp8",
        )
    fp8_out = _fp8_output(out_dtype, query.dtype)
    attn_scale = float(scale) if scale is not None else default_scale(query.shape[-1])
    # Autograd turns gradients off inside Function.forward: whether this call trains is decided here.
    trains = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value))
    if fp8_out and trains:
        raise ValidationError(
            [
                "out_dtype: float8_e4m3fn output carries no gradient (torch does not differentiate through "
                "float8 tensors); leave out_dtype unset to train, or run under torch.no_grad()"
            ],
            context="sdpa_fp8",
        )
    fp8_backward = backward == "fp8" and trains
    unbatched = query.dim() == 3  # [H, L, E]: one batch
    batch = (query[None], key[None], value[None]) if unbatched else (query, key, value)
    try:
        if fp8_out:
            out8, descale_o = forward(*batch, bool(is_causal), attn_scale, scaling, fp8_out=True)
            return Fp8Tensor(out8[0] if unbatched else out8, descale_o)
        call = _Fp8Call(bool(is_causal), attn_scale, scaling, fp8_backward, out_dtype)
        out = differentiable(call, *batch)
    except (ValidationError, UnsupportedError, ShapeMismatchError) as error:  # the graph's words for q, k, v
        raise error.renamed(ARGUMENT_NAMES, context="sdpa_fp8") from None
    return out[0] if unbatched else out


OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, E4M3)


def _fp8_output(out_dtype: Any, inputs: torch.dtype) -> bool:
    """Whether O is returned in FP8 (``out_dtype``, or the inputs' dtype where it is None)."""
    if out_dtype is not None and out_dtype not in OUT_DTYPES:
        allowed = ", ".join(dtype_name(t) for t in OUT_DTYPES)
        raise ValidationError([f"out_dtype: {shown(out_dtype)}; expected None or one of {allowed}"], context="sdpa_fp8")
    return (out_dtype if out_dtype is not None else inputs) == E4M3


def _on_fp8_inputs(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any,
    is_causal: Any,
    scale: Any,
    enable_gqa: Any,
    backward: str,
    scaling: Any,
    out_dtype: Any,
) -> Any:
    """``sdpa_fp8`` on ``Fp8Tensor`` inputs: no casts in, O in FP8 or dequantised once."""
    tensors = {"query": query, "key": key, "value": value}
    check_fp8_inputs(tensors)
    if attn_mask is not None:
        raise UnsupportedError(
            ["attn_mask: FP8 attention takes no mask tensor (cuDNN's FP8 op has no bias); use is_causal"],
            context="sdpa_fp8",
        )
    # torch's rules on shapes and flags, read from stand-ins of the data's shapes in a dtype they take.
    q, k, v = (
        torch.empty_strided(t.data.shape, t.data.stride(), dtype=torch.bfloat16, device="meta")
        for t in tensors.values()
    )
    _check_arguments(q, k, v, None, is_causal, scale, enable_gqa)
    problems = []
    if scaling is not None:
        problems.append(
            "scaling: the inputs are Fp8Tensor, already quantised under their own descales; "
            "scaling applies to float16/bfloat16 inputs"
        )
    if backward not in BACKWARDS:
        problems.append(f"backward: {backward!r}; allowed 'bf16' or 'fp8'")
    for name, t in tensors.items():
        if torch.is_grad_enabled() and t.data.requires_grad:
            problems.append(
                f"{name}: an Fp8Tensor takes no gradient (torch does not differentiate through "
                "float8 tensors); pass the 16-bit tensors to train"
            )
    if problems:
        raise ValidationError(problems, context="sdpa_fp8")
    fp8_out = _fp8_output(out_dtype, E4M3)
    attn_scale = float(scale) if scale is not None else default_scale(query.data.shape[-1])
    unbatched = query.data.dim() == 3
    q8, k8, v8 = (t.data[None] if unbatched else t.data for t in tensors.values())
    descale_q, descale_k, descale_v = (t.descale.reshape(1, 1, 1, 1) for t in tensors.values())
    try:
        out8 = _run_forward(q8, k8, v8, descale_q, descale_k, descale_v, bool(is_causal), attn_scale)[0]
    except (ValidationError, UnsupportedError, ShapeMismatchError) as error:
        raise error.renamed(ARGUMENT_NAMES, context="sdpa_fp8") from None
    out8 = out8[0] if unbatched else out8
    if fp8_out:
        return Fp8Tensor(out8, value.descale.reshape(()))
    return from_fp8(out8, descale_v, out_dtype)


def _check_arguments(
    query: Any, key: Any, value: Any, attn_mask: Any, is_causal: Any, scale: Any, enable_gqa: Any
) -> None:
    """torch's rules on the arguments ``sdpa_fp8`` shares with its SDPA, in its own name; first
    what only FP8 attention refuses, so that its reason is the one given."""
    named = (("query", query), ("key", key), ("value", value))
    nested = [name for name, t in named if isinstance(t, torch.Tensor) and t.is_nested]
    if nested:
        raise UnsupportedError(
            [
                f"{nested[0]}: a nested tensor; sdpa_fp8 takes dense [B, H, L, E] tensors (cudnn_attn.sdpa takes nested ones)"
            ],
            context="sdpa_fp8",
        )
    raw = [name for name, t in named if isinstance(t, torch.Tensor) and t.dtype in (E4M3, torch.float8_e5m2)]
    if raw:
        raise ValidationError(
            [
                f"{name}: a raw FP8 tensor; sdpa_fp8 takes float16/bfloat16 tensors, which it casts, "
                "or cudnn_attn.Fp8Tensor (FP8 data with its descale)"
                for name in raw
            ],
            context="sdpa_fp8",
        )
    try:
        check_arguments(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa)
    except ValidationError as error:
        raise error.renamed({}, context="sdpa_fp8") from None


def _check_tensors(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """What torch's SDPA takes and FP8 attention cannot: inputs wider than 16 bits (the FP8
    casts and the 16-bit backward take fp16/bf16) and empty ones (no amax to scale by)."""
    problems = []
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dtype not in INPUT_DTYPES:
            problems.append(f"{name}: dtype {dtype_name(t.dtype)}; sdpa_fp8 takes float16 or bfloat16")
        elif t.numel() == 0:
            problems.append(f"{name}: shape {list(t.shape)} has an empty dimension; every dimension must be >= 1")
    if problems:
        raise ValidationError(problems, context="sdpa_fp8")


def quantised(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in E4M3 under its current scale, and the descale that undoes it (float32 [1, 1, 1, 1]).

    Two passes: min/max, then one fused scale-saturate-cast (``fp8_cast``).
    """
    data, descale = Fp8Tensor.quantise(x)
    return data, descale.reshape(1, 1, 1, 1)


def forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    is_causal: bool,
    attn_scale: float,
    scaling: Fp8Scaling | None = None,
    keep: dict[str, Any] | None = None,
    fp8_out: bool = False,
    out_dtype: torch.dtype | None = None,
) -> Any:
    """O in ``out_dtype`` (the inputs' by default); with ``keep``, what the FP8 backward needs is
    put there. With ``fp8_out``, O in E4M3 and its descale (V's, 0-d) instead."""
    inputs = tuple(materialised(x) for x in (query, key, value))
    if scaling is not None:
        (q8, k8, v8), used, descales = scaling.stage(inputs)
    else:  # current scaling: one pass for the three amaxes, one for the three casts
        (q8, k8, v8), used, descales = quantise_qkv(inputs, amaxes=amax_qkv(inputs))
    descale_q, descale_k, descale_v = (scale_view(descales, i) for i in range(3))
    scale_o = scale_view(used, 2)  # V's scale: |O| <= max|V|, so O under it never saturates
    softmax = _softmax_scales(query.device)
    try:
        results = _run_forward(
            q8, k8, v8, descale_q, descale_k, descale_v, is_causal, attn_scale, scale_o, softmax, stats=keep is not None
        )
    except BaseException:
        if scaling is not None:  # a refused call leaves the history as it was
            scaling.discard()
        raise
    if scaling is not None:
        scaling.commit()
    out8 = results[0]
    if keep is not None:
        keep.update(
            q8=q8,
            k8=k8,
            v8=v8,
            o8=out8,
            stats=results[1],
            descale_q=descale_q,
            descale_k=descale_k,
            descale_v=descale_v,
            scale_s=softmax[1],
            is_causal=is_causal,
            attn_scale=attn_scale,
        )
    if fp8_out:
        return out8, descale_v.reshape(())
    return from_fp8(out8, descale_v, out_dtype or query.dtype)  # one rounding, into the dtype asked for


def _run_forward(
    q8: torch.Tensor,
    k8: torch.Tensor,
    v8: torch.Tensor,
    descale_q: torch.Tensor,
    descale_k: torch.Tensor,
    descale_v: torch.Tensor,
    is_causal: bool,
    attn_scale: float,
    scale_o: torch.Tensor | None = None,
    softmax: tuple | None = None,
    stats: bool = False,
) -> tuple:
    """The FP8 forward's results (O in E4M3 under ``scale_o``, default ``1 / descale_v``; Stats
    where asked for). ``softmax``: P's descale and scale, default the device's constants."""
    descale_s, scale_s = softmax if softmax is not None else _softmax_scales(q8.device)
    if scale_o is None:
        scale_o = reciprocal_scale(descale_v)  # a descale of 0 (V all zeros) gives O of zeros, not NaN
    args = (q8, k8, v8, descale_q, descale_k, descale_v, descale_s, scale_s, scale_o)
    return tuple(_forward_run(args, is_causal, attn_scale, stats=stats).run_ordered(args))


_softmax_constants: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _softmax_scales(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """P's descale and scale (1/448, 448): kept per device, made afresh while capturing (a
    tensor first filled inside a capture holds its value only once the graph replays)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing() and device not in _softmax_constants:
        return torch.full((1, 1, 1, 1), 1.0 / E4M3_MAX, device=device), torch.full(
            (1, 1, 1, 1), E4M3_MAX, device=device
        )
    if device not in _softmax_constants:
        _softmax_constants[device] = (
            torch.full((1, 1, 1, 1), 1.0 / E4M3_MAX, device=device),
            torch.full((1, 1, 1, 1), E4M3_MAX, device=device),
        )
    return _softmax_constants[device]


def _scores(is_causal: bool, attn_scale: float) -> ScoreOptions:
    return ScoreOptions(attn_scale=attn_scale, causal=Causal.TOP_LEFT if is_causal else Causal.NONE)


def _forward_run(args: tuple, is_causal: bool, attn_scale: float, stats: bool = False) -> PreparedRun:
    """O (and stats) of the FP8 forward; its amaxes are not asked for (Amax_S narrows cuDNN's engines)."""
    q, k, v, *scales = (TensorSpec.of(t) for t in args)
    problem = forward_problem(q, k, v, _scores(is_causal, attn_scale), stats=stats, fp8=dict(zip(FP8_SCALES, scales)))
    return prepare(problem, context="sdpa_fp8")


# What the FP8 backward reads from its forward, saved as torch saves tensors: freed by a
# backward that does not retain the graph, kept for every backward of one that does.
_FP8_SAVED = ("q8", "k8", "v8", "o8", "stats", "descale_q", "descale_k", "descale_v", "scale_s")


class _Fp8Call:
    """The FP8 forward as the training seam runs it (``runtime/training.py``), inputs
    ``(query, key, value)``; gradients from the 16-bit inputs (``backward="bf16"``) or through
    the FP8 backward (``backward="fp8"``, ``gradients`` below)."""

    non_differentiable: tuple[int, ...] = ()

    def __init__(
        self, is_causal: bool, attn_scale: float, scaling: Any, fp8_backward: bool, out_dtype: torch.dtype | None
    ):
        self.is_causal, self.attn_scale, self.scaling, self.fp8_backward = is_causal, attn_scale, scaling, fp8_backward
        self.out_dtype = out_dtype  # O's, when not the inputs': dequantised into it in one rounding
        self.gradient_scales: torch.Tensor | None = None  # the FP8 backward's, set by its first run

    def forward(self, inputs: tuple) -> tuple[tuple[torch.Tensor], tuple, None]:
        query, key, value = inputs
        self.input_dtype = query.dtype
        call = (query, key, value, self.is_causal, self.attn_scale, self.scaling)
        if not self.fp8_backward:
            return (forward(*call, out_dtype=self.out_dtype),), inputs, None
        keep: dict[str, Any] = {}
        out = forward(*call, keep=keep, out_dtype=self.out_dtype)
        return (out,), tuple(keep[name] for name in _FP8_SAVED), None

    def backward(self, saved: tuple, state: None, grads: tuple, needs: tuple[bool, ...]) -> tuple:
        d_out = grads[0].to(self.input_dtype)  # the gradients are the inputs' dtype, whatever O's
        if self.fp8_backward:
            kept = dict(zip(_FP8_SAVED, saved), is_causal=self.is_causal, attn_scale=self.attn_scale)
            # A retained graph differentiated again is the same derivative: it reuses the
            # gradient scales of its first backward (the history has moved on since, with that
            # backward's own amaxes), so it gives the same gradients, and it records nothing:
            # the history holds one backward per forward, not repeats of it.
            found, self.gradient_scales = gradients(kept, d_out, self.scaling, d_out.dtype, scales=self.gradient_scales)
            return tuple(g if needed else None for g, needed in zip(found, needs))
        from .functional import sdpa

        query, key, value = saved
        enable_gqa = query.shape[-3] != key.shape[-3]
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(x.requires_grad) for x in (query, key, value)]
            q, k, v = leaves
            out = sdpa(q, k, v, is_causal=self.is_causal, scale=self.attn_scale, enable_gqa=enable_gqa)
            wanted = [x for x in leaves if x.requires_grad]
            found_iter = iter(torch.autograd.grad(out, wanted, d_out))
        return tuple(next(found_iter) if x.requires_grad else None for x in leaves)


# backward="fp8": gradients through cuDNN's FP8 backward.
#
# dO is scaled by its current amax. dS (cast to FP8 inside the kernel) and the gradients dQ, dK,
# dV are written in FP8 too, so their scales must be known before the kernel runs: they come
# from the amax histories an ``Fp8Scaling`` keeps (the kernel reports each amax, and every
# backward records them). The first backward has no history: it runs the kernel once with
# unit scales to measure the amaxes, then again with their scales.


def gradients(
    saved: dict[str, Any],
    d_out: torch.Tensor,
    scaling: Fp8Scaling,
    dtype: torch.dtype,
    scales: torch.Tensor | None = None,
) -> tuple[list, torch.Tensor]:
    """dQ, dK, dV in ``dtype`` from what the FP8 forward kept (``saved``) and ``d_out``, and
    the gradient scales used ([4]). Given ``scales`` (an earlier backward's), those are used
    and the history is left as it is."""
    do8, descale_do = quantised(d_out)
    if scales is not None:
        results = _run_backward(saved, do8, descale_do, scales)
    else:
        scales = scaling.gradient_scales(d_out.device)
        if scales is None:  # no history yet: measure this backward's amaxes first (not recorded:
            # the history keeps one backward per forward, the real pass's below). dQ and dK come
            # from dS as quantised under dP's scale: at scale 1 a small dS flushed to zero (and
            # dQ, dK with it) and a large one saturated, so dP's amax is measured first.
            ones = torch.ones(4, device=d_out.device)
            scale_dp = scales_for(_amaxes(_run_backward(saved, do8, descale_do, ones)))[3:]
            scales = scales_for(_amaxes(_run_backward(saved, do8, descale_do, torch.cat([ones[:3], scale_dp]))))
        results = _run_backward(saved, do8, descale_do, scales)
        scaling.record_gradients(list(results[3:]))
    return [from_fp8(g8, (1.0 / scales[i]).reshape(1, 1, 1, 1), dtype) for i, g8 in enumerate(results[:3])], scales


def _amaxes(results: tuple) -> torch.Tensor:
    """A backward's amaxes of dQ, dK, dV and dP ([4]), an inf or NaN one as 0 (scale 1)."""
    return finite_amaxes(torch.cat([a.reshape(1) for a in results[3:]]))


def _run_backward(saved: dict[str, Any], do8: torch.Tensor, descale_do: torch.Tensor, scales: torch.Tensor) -> tuple:
    """The FP8 backward with gradient scales ``scales`` (dQ, dK, dV, dS): (dQ, dK, dV, Amax_dQ,
    Amax_dK, Amax_dV, Amax_dP). Every scale is its own tensor: one given twice would be one input."""
    q8, k8, v8, o8, stats = saved["q8"], saved["k8"], saved["v8"], saved["o8"], saved["stats"]
    scale_s = saved["scale_s"]
    scale_dq, scale_dk, scale_dv, scale_dp = (scales[i].reshape(1, 1, 1, 1).clone() for i in range(4))
    args = (
        q8,
        k8,
        v8,
        o8,
        do8,
        stats,
        saved["descale_q"],
        saved["descale_k"],
        saved["descale_v"],
        saved["descale_v"].clone(),
        descale_do,
        1.0 / scale_s,
        1.0 / scale_dp,
        scale_s.clone(),
        scale_dq,
        scale_dk,
        scale_dv,
        scale_dp,
    )
    return tuple(_backward_run(args, saved["is_causal"], saved["attn_scale"]).run_ordered(args))


def _backward_run(args: tuple, is_causal: bool, attn_scale: float) -> PreparedRun:
    q, k, v, o, grad_o, stats, *scales = (TensorSpec.of(t) for t in args)
    amax = TensorSpec.contiguous((1, 1, 1, 1), torch.float32, q.device)
    fp8 = {**dict(zip(FP8_BACKWARD_SCALES, scales)), **dict.fromkeys(FP8_BACKWARD_AMAXES, amax)}
    problem = backward_problem(q, k, v, o, grad_o, stats, _scores(is_causal, attn_scale), fp8=fp8)
    return prepare(problem, context="sdpa_fp8")
