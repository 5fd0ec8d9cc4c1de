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
        return (None, *ctx.call.backward(ctx.saved_tensors, ctx.state, grads, ctx.needs_input_grad[1:]))
