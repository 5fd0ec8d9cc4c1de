"""``cudnn_attn.sdpa(..., sinks=, softcap=, window_size=)``: attention sinks, logit soft-capping
and sliding windows in the torch form, differentiable.

``sinks`` is a logit per query head (``[H_q]``, gpt-oss's ``module.sinks``, FlashInfer's
``sinks``; or ``[1, H_q, 1, 1]``, the frontend's ``sink_token``) added to every softmax
denominator and weighing no value. ``softcap`` is FlashAttention's (and Gemma-2's) cap:
scores become ``cap * tanh(s / cap)`` before the mask and bias; cuDNN runs it as a score modifier
(``core/score_mod.softcap``), with the causal mask written inside it (cuDNN applies no mask of
its own beside a modifier). ``window_size`` is FlashAttention's ``(left, right)`` band
(``core/mask.window_band``). Calls with any of them take this path: the forward problem with its stats
and the backward problem (with ``dSink_token``), each prepared once per geometry
(``runtime.prepare``), through the one training seam (``runtime/training.py``). Dropout draws a fresh seed per call from
torch's default generator, as ``sdpa``'s does; the backward reuses the forward's mask.

Under ``torch.compile`` the same runs sit behind two custom ops (``cudnn_attn::sdpa_terms_forward``
/ ``sdpa_terms_backward``): dynamo cannot trace the prepared-run lookup (it reads the backend
block's context variable), so, as plain ``sdpa`` (``compiled.py``), the call is one opaque op and
``fullgraph=True`` works.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.mask import Causal, ScoreOptions, window_band
from ..core.problem import strides_like
from ..core.score_inputs import check_sinks, sink_dtype, sink_token
from ..core.softcap import softcap_modifier
from ..errors import ShapeMismatchError, UnsupportedError, ValidationError
from ..runtime.training import differentiable
from . import score_terms_runs as runs
from .arguments import ARGUMENT_NAMES, batched, causal_kind, check_arguments
from .softcap_split import CausalSplit, SplitCall, causal_split

# The score terms' own inner names: the sink is sdpa's sinks, and the statistics it needs are
# no argument of sdpa (a backend refusing them refuses the sinks, said once).
SCORE_TERM_NAMES = {**ARGUMENT_NAMES, "sink_token": "sinks", "score_mod": "softcap", "generate_stats": ""}


def sdpa_with_score_terms(
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, sinks, softcap, window_size=(-1, -1)
) -> torch.Tensor:
    """``cudnn_attn.sdpa``'s call with ``sinks``, ``softcap`` or ``window_size`` (its other
    arguments as there)."""
    check_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    try:
        causal, window, right = window_band(window_size, causal_kind(is_causal))
    except ValueError as error:
        raise ValidationError([str(error)], context="sdpa") from None
    query, key, value, bias, scale, restore = batched(query, key, value, attn_mask, scale)
    run = compiled_score_terms_sdpa if torch.compiler.is_compiling() else score_terms_sdpa
    try:
        out = run(query, key, value, bias, scale, causal, float(dropout_p), sinks, softcap, window, right)
    except (ValidationError, UnsupportedError, ShapeMismatchError) as error:
        raise error.renamed(SCORE_TERM_NAMES, context="sdpa") from None
    return restore(out)


def score_terms_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    causal: Causal,
    dropout_p: float,
    sinks: Any,
    softcap: Any = None,
    window: int | None = None,
    right_bound: int | None = None,
) -> torch.Tensor:
    """Attention of ``[B, H, S, D]`` tensors with ``sinks``, ``softcap`` (checked here, by name) or a
    band (``window``: the left bound W, key j visible iff j > i - W; ``right_bound``)."""
    if sinks is not None:
        check_sinks(sinks, q.shape[1], q.device)
    rows = _unseeing_rows_split(
        score_terms_sdpa, q, k, v, bias, scale, causal, dropout_p, sinks, softcap, window, right_bound
    )
    if rows is not None:
        return rows
    options = ScoreOptions(
        attn_scale=scale, causal=causal, sliding_window=window, right_bound=right_bound, dropout_p=float(dropout_p)
    )
    modifier = None
    if softcap is not None:
        modifier, plain = softcap_modifier(softcap, options, q.shape[2], k.shape[2])
        split = causal_split(float(softcap), options, q, k, bias, sinks)
        if split is not None:  # unmasked rectangles and a masked diagonal: no masked tile computed
            return differentiable(SplitCall(split), q, k, v)
        options = plain
    # A fresh dropout seed from torch's default generator (torch.manual_seed repeats it); the
    # backward reuses the forward's mask through the same seed and offset.
    rng = (torch.randint(0, 2**62, (1,), dtype=torch.int64), torch.zeros(1, dtype=torch.int64)) if dropout_p else None
    return differentiable(_ScoreTermsCall(options, modifier, rng, sinks), q, k, v, bias, sinks)


def _unseeing_rows_split(run, q, k, v, bias, scale, causal, *rest) -> torch.Tensor | None:
    """More queries than keys under the bottom-right diagonal, as ``run`` computes them: the first
    L - S rows see no key (0, as torch gives them; a sink weighs no value), the rest make a
    square problem, where the two diagonals are one. None for any other call."""
    unseeing = q.shape[2] - k.shape[2]
    if causal is not Causal.BOTTOM_RIGHT or unseeing <= 0:
        return None
    rows = None if bias is None else bias if bias.shape[-2] == 1 else bias[..., unseeing:, :]
    seen = run(q[:, :, unseeing:], k, v, rows, scale, Causal.TOP_LEFT, *rest)
    return torch.cat([seen.new_zeros(*seen.shape[:2], unseeing, seen.shape[3]), seen], dim=2)


def clear() -> None:
    """Forget every prepared run kept by call geometry."""
    runs.clear()


class _ScoreTermsCall:
    """One call with score terms, as the training seam runs it (``runtime/training.py``):
    inputs ``(q, k, v, bias, sinks)``; the options, modifier and dropout seed are the call's."""

    non_differentiable: tuple[int, ...] = ()

    def __init__(self, options: ScoreOptions, modifier: Any, rng: tuple | None, sinks: Any):
        self.options, self.modifier, self.rng = options, modifier, rng
        self.sink_meta = None if sinks is None else (sinks.shape, sinks.dtype)

    def forward(self, inputs: tuple) -> tuple[tuple[torch.Tensor], tuple, None]:
        q, k, v, bias, sinks = inputs
        sink = sink_token(sinks, q)
        out, stats = runs.forward(q, k, v, bias, sink, self.options, self.modifier, self.rng)
        return (out,), (q, k, v, bias, sink, out, stats), None

    def backward(self, saved: tuple, state: None, grads: tuple, needs: tuple[bool, ...]) -> tuple:
        q, k, v, bias, sink, out, stats = saved
        found = runs.backward(
            self.options, self.modifier, needs[3], q, k, v, bias, sink, out, grads[0], stats, self.rng
        )
        d_sink = None
        if self.sink_meta is not None:
            shape, dtype = self.sink_meta
            d_sink = found["grad_sink"].reshape(shape).to(dtype)
        return found["grad_q"], found["grad_k"], found["grad_v"], found.get("grad_bias"), d_sink


def compiled_score_terms_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    causal: Causal,
    dropout_p: float,
    sinks: Any,
    softcap: Any = None,
    window: int | None = None,
    right_bound: int | None = None,
) -> torch.Tensor:
    """``score_terms_sdpa`` as ``torch.compile`` sees it: the checks traced, the run one custom op.
    The sinks reach the op as ``[1, H, 1, 1]`` (``sink_token``'s dtype) through differentiable views, so their
    gradient flows back to the caller's shape and dtype."""
    if sinks is not None:
        check_sinks(sinks, q.shape[1], q.device)
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))):
        softcap_modifier(softcap, ScoreOptions(), 1, 1)  # raises its ValidationError; a number is checked in the op
    rows = _unseeing_rows_split(
        compiled_score_terms_sdpa, q, k, v, bias, scale, causal, dropout_p, sinks, softcap, window, right_bound
    )
    if rows is not None:
        return rows
    sink = None if sinks is None else sinks.reshape(1, -1, 1, 1).to(sink_dtype(q.dtype)).contiguous()
    seed = offset = None
    if dropout_p:
        seed, offset = torch.randint(0, 2**62, (1,), dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    cap = None if softcap is None else float(softcap)
    out, _ = sdpa_terms_forward(
        q, k, v, bias, sink, scale, causal.value, dropout_p, window, right_bound, cap, seed, offset
    )
    return out


def _op_options(
    q, k, bias, sink, scale, causal, dropout_p, window, right_bound, softcap
) -> tuple[ScoreOptions, Any, CausalSplit | None]:
    """The custom ops' scalars as the run's options and score modifier, or the call's split."""
    options = ScoreOptions(
        attn_scale=scale, causal=Causal(causal), sliding_window=window, right_bound=right_bound, dropout_p=dropout_p
    )
    if softcap is None:
        return options, None, None
    modifier, plain = softcap_modifier(softcap, options, q.shape[2], k.shape[2])
    return plain, modifier, causal_split(softcap, options, q, k, bias, sink)


def _op_rng(seed, offset) -> tuple | None:
    return None if seed is None else (seed, offset)


@torch.library.custom_op("cudnn_attn::sdpa_terms_forward", mutates_args=())
def sdpa_terms_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    sink: torch.Tensor | None,
    scale: float,
    causal: str,
    dropout_p: float,
    window: int | None,
    right_bound: int | None,
    softcap: float | None,
    seed: torch.Tensor | None,
    offset: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    options, modifier, split = _op_options(q, k, bias, sink, scale, causal, dropout_p, window, right_bound, softcap)
    if split is not None:
        return split.forward(q, k, v)
    return runs.forward(q, k, v, bias, sink, options, modifier, _op_rng(seed, offset))


@sdpa_terms_forward.register_fake
def _(q, k, v, bias, sink, scale, causal, dropout_p, window, right_bound, softcap, seed, offset):
    shape = (*q.shape[:-1], v.shape[-1])
    out = q.new_empty_strided(shape, strides_like(shape, q.stride()))
    return out, q.new_empty((*q.shape[:-1], 1), dtype=torch.float32)


@torch.library.custom_op("cudnn_attn::sdpa_terms_backward", mutates_args=())
def sdpa_terms_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    sink: torch.Tensor | None,
    out: torch.Tensor,
    d_out: torch.Tensor,
    stats: torch.Tensor,
    scale: float,
    causal: str,
    dropout_p: float,
    window: int | None,
    right_bound: int | None,
    softcap: float | None,
    seed: torch.Tensor | None,
    offset: torch.Tensor | None,
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    options, modifier, split = _op_options(q, k, bias, sink, scale, causal, dropout_p, window, right_bound, softcap)
    if split is not None:
        d_q, d_k, d_v = split.backward(q, k, v, out, d_out, stats)
        return d_q, d_k, d_v, q.new_empty(0), q.new_empty(0)
    grads = runs.backward(options, modifier, bias_grad, q, k, v, bias, sink, out, d_out, stats, _op_rng(seed, offset))
    d_bias = grads["grad_bias"] if bias_grad else q.new_empty(0)
    d_sink = grads["grad_sink"].reshape(sink.shape).to(sink.dtype) if sink is not None else q.new_empty(0)
    return grads["grad_q"], grads["grad_k"], grads["grad_v"], d_bias, d_sink


@sdpa_terms_backward.register_fake
def _(
    q,
    k,
    v,
    bias,
    sink,
    out,
    d_out,
    stats,
    scale,
    causal,
    dropout_p,
    window,
    right_bound,
    softcap,
    seed,
    offset,
    bias_grad,
):
    grads = [t.new_empty_strided(t.shape, strides_like(tuple(t.shape), t.stride())) for t in (q, k, v)]
    d_bias = (
        bias.new_empty_strided(bias.shape, strides_like(tuple(bias.shape), bias.stride()))
        if bias_grad
        else q.new_empty(0)
    )
    d_sink = sink.new_empty(sink.shape) if sink is not None else q.new_empty(0)
    return (*grads, d_bias, d_sink)


def _setup_context(ctx, inputs, output):
    q, k, v, bias, sink, scale, causal, dropout_p, window, right_bound, softcap, seed, offset = inputs
    out, stats = output
    ctx.save_for_backward(q, k, v, bias, sink, out, stats, seed, offset)
    ctx.scalars = (scale, causal, dropout_p, window, right_bound, softcap)


def _backward_op(ctx, d_out, _d_stats):
    q, k, v, bias, sink, out, stats, seed, offset = ctx.saved_tensors
    bias_grad = bias is not None and ctx.needs_input_grad[3]
    d_q, d_k, d_v, d_bias, d_sink = sdpa_terms_backward(
        q, k, v, bias, sink, out, d_out, stats, *ctx.scalars, seed, offset, bias_grad
    )
    d_sink = d_sink if sink is not None and ctx.needs_input_grad[4] else None
    return d_q, d_k, d_v, (d_bias if bias_grad else None), d_sink, None, None, None, None, None, None, None, None


torch.library.register_autograd("cudnn_attn::sdpa_terms_forward", _backward_op, setup_context=_setup_context)
