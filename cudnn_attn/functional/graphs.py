"""The functional form's forward and backward, each on a built graph kept per call signature.

Shared by the eager path (``eager.py``) and the custom ops ``torch.compile`` sees
(``compiled.py``). Keys here are full ``TensorSpec`` signatures: the first call of a
signature lands here; the eager path keeps a flat key in front for the calls after it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.mask import Causal
from ..core.problem import TensorSpec
from ..graph import Graph
from ..graph_cache import GraphCache

graphs = GraphCache()


def _spec(t: torch.Tensor | None) -> TensorSpec | None:
    return None if t is None else TensorSpec.of(t)


def _options(scale: float, causal: str, dropout_p: float, seed: Any, offset: Any) -> dict:
    """``causal``: a ``Causal`` value ("none", "top_left", "bottom_right")."""
    options: dict[str, Any] = dict(
        attn_scale=scale,
        use_causal_mask=causal == Causal.TOP_LEFT,
        use_causal_mask_bottom_right=causal == Causal.BOTTOM_RIGHT,
    )
    if dropout_p > 0:
        options.update(dropout=dropout_p, dropout_seed=seed, dropout_offset=offset)
    return options


def aliasing(tensors: list[Any]) -> tuple[int, ...]:
    """Which inputs are the same tensor: graphs count a tensor given twice once."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(id(t), i) for i, t in enumerate(tensors))


def distinct(tensors: list[Any]) -> list[Any]:
    seen: set[int] = set()
    return [t for t in tensors if not (id(t) in seen or seen.add(id(t)))]  # type: ignore[func-returns-value]


def forward_inputs(q, k, v, bias, dropout_p, seed, offset) -> list[Any]:
    return [t for t in (q, k, v, bias) if t is not None] + ([seed, offset] if dropout_p > 0 else [])


def forward_graph(q, k, v, bias, scale: float, causal: str, dropout_p: float, seed, offset, train: bool) -> Graph:
    """The built forward graph of this signature (O, plus stats when ``train``)."""
    inputs = forward_inputs(q, k, v, bias, dropout_p, seed, offset)
    key = ("forward", *map(_spec, (q, k, v, bias)), aliasing(inputs), scale, causal, dropout_p, train)
    options = _options(scale, causal, dropout_p, seed, offset)
    return graphs.get_or_build(key, lambda g: g.sdpa(q, k, v, attn_bias=bias, generate_stats=train, **options))


def backward_inputs(q, k, v, out, d_out, stats, bias, dropout_p, seed, offset) -> list[Any]:
    inputs: list[Any] = [q, k, v, out, d_out, stats] + ([bias] if bias is not None else [])
    return inputs + ([seed, offset] if dropout_p > 0 else [])


def backward_graph(
    q, k, v, out, d_out, stats, bias, scale: float, causal: str, dropout_p: float, seed, offset, bias_grad: bool
) -> Graph:
    """The built backward graph of this signature (dQ, dK, dV, plus dBias when ``bias_grad``).
    ``d_out`` must have ``out``'s strides (see ``like``)."""
    inputs = backward_inputs(q, k, v, out, d_out, stats, bias, dropout_p, seed, offset)
    key = ("backward", *map(_spec, (q, k, v, bias, out, d_out)), aliasing(inputs), scale, causal, dropout_p,
           bias_grad)  # fmt: skip
    options = _options(scale, causal, dropout_p, seed, offset)
    return graphs.get_or_build(
        key, lambda g: g.sdpa_backward(q, k, v, out, d_out, stats, attn_bias=bias, bias_grad=bias_grad, **options)
    )


def like(t: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """``t``'s values in ``template``'s layout (the backward reads dO in O's layout)."""
    if t.stride() == template.stride():
        return t
    out = torch.empty_strided(template.shape, template.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(t)
