"""``cudnn_attn.backend(name)``: the backend for a block of code, as torch's ``sdpa_kernel`` is SDPA's.

The choice is a context variable: it holds in the thread (and asyncio task) that entered the
block, nests, and is restored when the block exits, by an exception too. A thread started
inside the block does not inherit it (Python's threads start with an empty context).

Where a call asks for ``"auto"`` (every door's default, ``Graph()``'s included), ``resolve``
gives the block's choice; an explicit ``Graph(backend=...)`` wins over the block. Every cache in
front of a plan keys on the resolved name, so a plan made under one backend is never run
under the other.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from ..errors import ValidationError
from ..ops import BACKEND_NAMES

_chosen: ContextVar[str] = ContextVar("cudnn_attn_backend", default="auto")


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Run the attention calls of a block on one backend.

    Honoured by ``cudnn_attn.sdpa``, ``varlen_sdpa``, ``sdpa_fp8``, ``nn.Attention`` and
    ``Graph()`` (built in the block) when they are given no backend of their own.

    Args:
        name: ``"cudnn"`` (cuDNN's fused kernels; CUDA tensors only), ``"reference"`` (the
            pure-PyTorch backend, on any device: slow, exact, the oracle), ``"torch"`` (torch's
            own SDPA kernel: every ``cudnn_attn.sdpa`` call, and a ``Graph``'s plain forward
            nodes) or ``"auto"`` (the default: each device's priority list in
            ``ops/dispatch.py``; cuDNN for CUDA tensors, the reference backend for CPU tensors,
            where a plain ``cudnn_attn.sdpa`` call runs on torch's own kernel).

    Under ``"cudnn"``, a call ``cudnn_attn.sdpa`` would otherwise hand to torch's own kernel
    (float64, a scale <= 0, ...) raises ``UnsupportedError`` saying why, as does a call on CPU
    tensors. Under ``"reference"`` nothing runs on cuDNN, CUDA tensors included.

    Returns:
        A context manager (also usable as a decorator) that sets the choice for its block.

    Raises:
        ValidationError: ``name`` is not a backend.

    Example:
        ```python
        import torch

        import cudnn_attn

        q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
        with cudnn_attn.backend("reference"):
            out = cudnn_attn.sdpa(q, q, q)  # on the reference backend, whatever the device
        ```
    """
    if not isinstance(name, str) or name not in BACKEND_NAMES:
        raise ValidationError([f"name: {name!r}; allowed {', '.join(map(repr, BACKEND_NAMES))}"], context="backend")
    token = _chosen.set(name)
    try:
        yield
    finally:
        _chosen.reset(token)


def chosen() -> str:
    """The backend the innermost ``backend(...)`` block chose here; ``"auto"`` outside any."""
    return _chosen.get()


def resolve(requested: str) -> str:
    """``requested``, or the block's choice where it is ``"auto"``."""
    return _chosen.get() if requested == "auto" else requested


def kept_for_backward(function: Any) -> Any:
    """Class decorator for a ``torch.autograd.Function``: its backward runs under the block its
    forward ran in. The autograd engine runs a CUDA backward on a thread of its own, which does
    not inherit the caller's context, so without this a backward would plan on ``"auto"``."""
    forward, backward = function.forward, function.backward

    def forward_noting_the_block(ctx: Any, *args: Any) -> Any:
        ctx.backend_choice = _chosen.get()
        return forward(ctx, *args)

    def backward_in_the_block(ctx: Any, *grads: Any) -> Any:
        token = _chosen.set(getattr(ctx, "backend_choice", "auto"))
        try:
            return backward(ctx, *grads)
        finally:
            _chosen.reset(token)

    function.forward = staticmethod(functools.wraps(forward)(forward_noting_the_block))
    function.backward = staticmethod(functools.wraps(backward)(backward_in_the_block))
    return function
