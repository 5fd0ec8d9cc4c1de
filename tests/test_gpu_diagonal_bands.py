"""Diagonal bands the frontend's keywords spell (any alignment, left and right bounds) on cuDNN,
forward and backward, against the reference backend on the same fresh inputs."""

from __future__ import annotations

import pytest
import torch
from conftest import TOLERANCE, poisoned, rel_err

import cudnn_attn as cudnn

pytestmark = pytest.mark.gpu

BANDS = [("TOP_LEFT", None, 64), ("BOTTOM_RIGHT", None, 64), ("BOTTOM_RIGHT", 96, None), ("TOP_LEFT", 128, 32),
         ("BOTTOM_RIGHT", 100, 17)]  # fmt: skip


def _band(alignment, left, right) -> dict:
    keywords: dict = dict(diagonal_alignment=getattr(cudnn.diagonal_alignment, alignment))
    if left is not None:
        keywords["diagonal_band_left_bound"] = left
    if right is not None:
        keywords["diagonal_band_right_bound"] = right
    return keywords


def _run(device, dtype, tensors, keywords):
    q, k, v, d_o = (t.to(device=device, dtype=dtype) for t in tensors)
    with cudnn.Graph() as fwd:
        fwd.sdpa(q, k, v, generate_stats=True, attn_scale=0.125, **keywords)
    o, stats = fwd(q, k, v, out=[poisoned(h) for h in fwd.outputs])  # unwritten elements show as NaN
    with cudnn.Graph() as bwd:
        bwd.sdpa_backward(q, k, v, o, d_o, stats, attn_scale=0.125, **keywords)
    return (o, *bwd(q, k, v, o, d_o, stats, out=[poisoned(h) for h in bwd.outputs]))


@pytest.mark.parametrize("alignment,left,right", BANDS)
def test_a_diagonal_band_on_cudnn_matches_the_reference(alignment, left, right):
    gen = torch.Generator().manual_seed(11)
    tensors = [torch.randn(2, 4, s, 64, generator=gen) for s in (200, 320, 320, 200)]
    keywords = _band(alignment, left, right)
    got = _run("cuda", torch.bfloat16, tensors, keywords)
    want = _run("cpu", torch.float32, [t.to(torch.bfloat16).float() for t in tensors], keywords)
    for name, a, b in zip(("O", "dQ", "dK", "dV"), got, want):
        assert rel_err(a.float().cpu(), b) < 2 * TOLERANCE[torch.bfloat16], name
