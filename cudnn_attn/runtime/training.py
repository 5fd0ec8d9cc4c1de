"""The one training seam: every door's differentiable call goes through one autograd function.

A door (``sdpa``'s eager path and its score terms, ``varlen_sdpa``, ``sdpa_fp8``) describes one
call as a ``Trainable``: its ``forward`` gives the outputs, the tensors the backward reads and
any small per-call state (a dropout seed, an FP8 backward's scales), and its ``backward`` gives
each input's gradient from them. ``differentiable`` runs it: the saved tensors are saved as
torch saves them (freed by a backward that does not retain the graph), the backward runs under
the backend block its forward ran in (``backend_choice.kept_for_backward``), and the door is
told which inputs need gradients. Context parallelism keeps its ring's own function: its
backward is a ring of transfers, each block's backward one of these.

Example, a door's call::

    out = differentiable(entry, q, k, v, bias)   # entry: a Trainable
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..errors import UnsupportedError
from . import backend_choice

Tensors = tuple[torch.Tensor | None, ...]


class Trainable(Protocol):
    """One differentiable call of a door.

    ``forward(inputs)`` returns ``(outputs, saved, state)``: the output tensors, the tensors the
    backward reads (None allowed), and anything else it needs (kept on the autograd node).
    ``backward(saved, state, grads, needs)`` returns one gradient (or None) per input, given
    the outputs' gradients and which inputs need one. ``non_differentiable``: indices of
    outputs no gradient flows through (an LSE returned beside the output)."""

    non_differentiable: tuple[int, ...]

    def forward(self, inputs: Tensors) -> tuple[tuple[torch.Tensor, ...], Tensors, Any]: ...

    def backward(self, saved: Tensors, state: Any, grads: Tensors, needs: tuple[bool, ...]) -> Tensors: ...


def differentiable(call: Trainable, *inputs: torch.Tensor | None) -> Any:
    """``call``'s outputs (one tensor, or a tuple of them), on the autograd tape."""
    return _Trained.apply(call, *inputs)


@backend_choice.kept_for_backward
class _Trained(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: Trainable, *inputs):  # type: ignore[override]
        outputs, saved, state = call.forward(inputs)
        ctx.save_for_backward(*saved)
        ctx.call, ctx.state = call, state
        for index in call.non_differentiable:
            ctx.mark_non_differentiable(outputs[index])
        return outputs[0] if len(outputs) == 1 else outputs

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        # Under create_graph=True autograd records the backward's own ops, and a door's backward
        # (fused kernels, or torch ops around them) is no graph of its second derivative: run it
        # unrecorded, and refuse by name a derivative of its gradients instead of a wrong one.
        with torch.no_grad():
            found = ctx.call.backward(ctx.saved_tensors, ctx.state, grads, ctx.needs_input_grad[1:])
        if torch.is_grad_enabled():
            found = _first_order_only(found, (*ctx.saved_tensors, *grads))
        return (None, *found)


def _first_order_only(found: Tensors, sources: Tensors) -> Tensors:
    """``found``'s gradients as the outputs of a node over what they derive from (the saved
    inputs and the incoming gradients, which a Jacobian-vector product differentiates through),
    whose backward refuses."""
    given = [g for g in found if g is not None]
    inputs = [t for t in sources if t is not None and t.requires_grad]
    if not given or not inputs:
        return found
    marked = iter(_FirstOrderOnly.apply(len(given), *given, *inputs))
    return tuple(None if g is None else next(marked) for g in found)


class _FirstOrderOnly(torch.autograd.Function):
    """Gradients returned under ``create_graph=True``: the same values, whose own gradient is
    refused with ``UnsupportedError`` (torch's fused attention kernels refuse it too)."""

    @staticmethod
    def forward(ctx, count: int, *tensors):  # type: ignore[override]
        return tuple(g.view_as(g) for g in tensors[:count])  # the rest: the inputs they depend on

    @staticmethod
    def backward(ctx, *_):  # type: ignore[override]
        raise UnsupportedError(
            [
                "create_graph: a gradient of cudnn_attn's attention was differentiated again (double "
                "backward); its backward gives first-order gradients only"
            ],
            context="attention backward",
            alternatives=["torch.nn.functional.scaled_dot_product_attention under the math backend"],
        )
