"""The functional form as torch custom ops, for ``torch.compile``: one opaque node each (no
graph break, ``fullgraph=True`` works), autograd through ``register_autograd``, fake tensors
with the right strides. Eager calls take the lighter path of ``eager.py`` instead."""

from __future__ import annotations

import torch

from ..core.problem import strides_like
from ..errors import GraphStateError
from ..runtime.interop import in_layout_of
from . import problems


@torch.library.custom_op("cudnn_attn::sdpa_forward", mutates_args=())
def sdpa_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    causal: str,
    dropout_p: float,
    seed: torch.Tensor | None,
    offset: torch.Tensor | None,
    train: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    run = problems.forward_run(q, k, v, bias, scale, causal, dropout_p, seed, offset, train)
    result = run.run_ordered(problems.forward_inputs(q, k, v, bias, dropout_p, seed, offset))
    if train:
        return result[0], result[1]
    return result[0], q.new_empty(0, dtype=torch.float32)


@sdpa_forward.register_fake
def _(q, k, v, bias, scale, causal, dropout_p, seed, offset, train):
    shape = (*q.shape[:-1], v.shape[-1])
    out = q.new_empty_strided(shape, strides_like(shape, q.stride()))
    stats = q.new_empty((*q.shape[:-1], 1), dtype=torch.float32) if train else q.new_empty(0, dtype=torch.float32)
    return out, stats


@torch.library.custom_op("cudnn_attn::sdpa_backward", mutates_args=())
def sdpa_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    d_out: torch.Tensor,
    stats: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    causal: str,
    dropout_p: float,
    seed: torch.Tensor | None,
    offset: torch.Tensor | None,
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    d_out = in_layout_of(d_out, out)
    run = problems.backward_run(q, k, v, out, d_out, stats, bias, scale, causal, dropout_p, seed, offset, bias_grad)
    grads = run.run_ordered(problems.backward_inputs(q, k, v, out, d_out, stats, bias, dropout_p, seed, offset))
    return grads[0], grads[1], grads[2], grads[3] if bias_grad else q.new_empty(0)


@sdpa_backward.register_fake
def _(q, k, v, out, d_out, stats, bias, scale, causal, dropout_p, seed, offset, bias_grad):
    grads = [t.new_empty_strided(t.shape, strides_like(tuple(t.shape), t.stride())) for t in (q, k, v)]
    d_bias = (
        bias.new_empty_strided(bias.shape, strides_like(tuple(bias.shape), bias.stride()))
        if bias_grad
        else q.new_empty(0)
    )
    return (*grads, d_bias)


def _setup_context(ctx, inputs, output):
    q, k, v, bias, scale, causal, dropout_p, seed, offset, train = inputs
    out, stats = output
    ctx.save_for_backward(q, k, v, bias, out, stats, seed, offset)
    ctx.scalars = (scale, causal, dropout_p)


def _backward(ctx, d_out, _d_stats):
    q, k, v, bias, out, stats, seed, offset = ctx.saved_tensors
    if stats.numel() == 0:
        raise GraphStateError("cudnn_attn.sdpa: backward of a call made without gradients enabled")
    bias_grad = bias is not None and ctx.needs_input_grad[3]
    d_q, d_k, d_v, d_bias = sdpa_backward(q, k, v, out, d_out, stats, bias, *ctx.scalars, seed, offset, bias_grad)
    return d_q, d_k, d_v, (d_bias if bias_grad else None), None, None, None, None, None, None


torch.library.register_autograd("cudnn_attn::sdpa_forward", _backward, setup_context=_setup_context)
