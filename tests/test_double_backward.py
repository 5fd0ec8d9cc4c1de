"""Gradients of gradients (``create_graph=True``, then a derivative of the gradients): every door
whose backward runs through the training seam (score terms, varlen, the reference backend) gave
silently wrong second derivatives, the backward's own ops recorded as if they were its
derivative. They are now refused by name; the first-order gradients under ``create_graph=True``
keep their values, and doors that run torch's own SDPA keep torch's double backward."""

from __future__ import annotations

import pytest
import torch

import cudnn_attn
from cudnn_attn.errors import UnsupportedError

SHAPE = (1, 2, 5, 4)


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*SHAPE, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(3)]


def _varlen(q, k, v):
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    flat = [t[0].transpose(0, 1) for t in (q, k, v)]  # [T=5, H, D]
    return cudnn_attn.varlen_sdpa(*flat, cu, cu, 3, 3, causal=True)


DOORS = {
    "window": lambda q, k, v: cudnn_attn.sdpa(q, k, v, window_size=(1, 1)),
    "softcap": lambda q, k, v: cudnn_attn.sdpa(q, k, v, softcap=3.0),
    "sinks": lambda q, k, v: cudnn_attn.sdpa(q, k, v, sinks=torch.tensor([0.5, -1.0], dtype=torch.float64)),
    "varlen": _varlen,
}


@pytest.mark.parametrize("door", DOORS, ids=list(DOORS))
def test_a_derivative_of_the_gradients_is_refused_by_name_and_the_gradients_keep_their_values(door):
    q, k, v = _inputs()
    out = DOORS[door](q, k, v)
    plain = torch.autograd.grad(out.square().sum(), (q, k, v), retain_graph=True)
    graphed = torch.autograd.grad(out.square().sum(), (q, k, v), create_graph=True)
    for a, b in zip(plain, graphed):
        assert torch.equal(a, b)
    assert all(g.requires_grad for g in graphed)
    with pytest.raises(UnsupportedError, match="create_graph: a gradient of cudnn_attn's attention was differentiated"):
        torch.autograd.grad(sum(g.square().sum() for g in graphed), (q, k, v))


def test_first_order_gradients_of_the_score_terms_still_check_against_finite_differences():
    for door in ("window", "softcap", "sinks"):
        assert torch.autograd.gradcheck(DOORS[door], _inputs(1))


def test_plain_attention_keeps_torchs_double_backward():
    """Plain float64 attention runs torch's own SDPA here, whose math kernel differentiates twice."""
    assert torch.autograd.gradgradcheck(lambda q, k, v: cudnn_attn.sdpa(q, k, v, is_causal=True), _inputs(2))


def test_a_jacobian_vector_product_through_the_gradients_is_refused_not_zero():
    """torch.autograd.functional.jvp differentiates the gradients with respect to the incoming
    gradient: with the backward unrecorded it came back as zeros, silently."""
    q, k, v = _inputs(3)
    tangents = tuple(torch.ones_like(t) for t in (q, k, v))
    with pytest.raises(UnsupportedError, match="create_graph"):
        torch.autograd.functional.jvp(DOORS["softcap"], (q, k, v), tangents)
