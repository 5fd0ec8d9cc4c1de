"""Diagonal bands the frontend's keywords spell (any alignment, left and right bounds) on cuDNN,
forward and backward, against the reference backend on the same fresh inputs."""

from __future__ import annotations

import pytest
import torch
from conftest import TOLERANCE, poisoned, rel_err

import cudnn_attn as cudnn

pytestmark = pytest.mark.gpu

BANDS = [
    ("TOP_LEFT", None, 64),
    ("BOTTOM_RIGHT", None, 64),
    ("BOTTOM_RIGHT", 96, None),
    ("TOP_LEFT", 128, 32),
    ("BOTTOM_RIGHT", 100, 17),
]


def _band(alignment, left, right) -> dict:
    keywords: dict = dict(diagonal_alignment=getattr(cudnn.diagonal_alignment, alignment))
    if left is not None:
        keywords["diagonal_band_left_bound"] = left
    if right is not None:
        keywords["diagonal_band_right_bound"] = right
    return keywords


def _run(device, dtype, tensors, keywords, bias=None):
    q, k, v, d_o = (t.to(device=device, dtype=dtype) for t in tensors)
    extra = {} if bias is None else {"bias": bias.to(device=device, dtype=dtype)}
    with cudnn.Graph() as fwd:
        fwd.sdpa(q, k, v, generate_stats=True, attn_scale=0.125, **keywords, **extra)
    o, stats = fwd(q, k, v, *extra.values(), out=[poisoned(h) for h in fwd.outputs])  # unwritten shows as NaN
    with cudnn.Graph() as bwd:
        bwd.sdpa_backward(q, k, v, o, d_o, stats, attn_scale=0.125, **keywords, **extra)
    return (o, *bwd(q, k, v, o, d_o, stats, *extra.values(), out=[poisoned(h) for h in bwd.outputs]))


@pytest.mark.parametrize("alignment,left,right", BANDS)
def test_a_diagonal_band_on_cudnn_matches_the_reference(alignment, left, right):
    gen = torch.Generator().manual_seed(11)
    tensors = [torch.randn(2, 4, s, 64, generator=gen) for s in (200, 320, 320, 200)]
    keywords = _band(alignment, left, right)
    got = _run("cuda", torch.bfloat16, tensors, keywords)
    want = _run("cpu", torch.float32, [t.to(torch.bfloat16).float() for t in tensors], keywords)
    for name, a, b in zip(("O", "dQ", "dK", "dV"), got, want):
        assert rel_err(a.float().cpu(), b) < 2 * TOLERANCE[torch.bfloat16], name


@pytest.mark.parametrize("d_qk,d_v", [(64, 520), (320, 320)])
def test_head_dims_past_256_run_forward_on_cudnn_and_backward_is_refused_on_hopper(d_qk, d_v):
    """Hopper: cuDNN's forward plans heads past 256 (checked against the reference); its backward
    declines them, as do the frontend's own engines (sm100-103 only): refused by name, catchable
    as the frontend's not-supported error; the reference runs it."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper rule")
    gen = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 2, 96, d, generator=gen).to(torch.bfloat16) for d in (d_qk, d_qk, d_v))
    with cudnn.Graph() as g:
        g.sdpa(q.cuda(), k.cuda(), v.cuda(), use_causal_mask=True)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert rel_err(g(q.cuda(), k.cuda(), v.cuda()).cpu(), want) < 2 * TOLERANCE[torch.bfloat16]
    o, d_o = (torch.randn(1, 2, 96, d_v).to("cuda", torch.bfloat16) for _ in range(2))
    stats = torch.zeros(1, 2, 96, 1, device="cuda")
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match="head_dim"):
        with cudnn.Graph() as g:
            g.sdpa_backward(q.cuda(), k.cuda(), v.cuda(), o, d_o, stats)
    with cudnn.Graph() as g:
        g.sdpa(q.float(), k.float(), v.float(), use_causal_mask=True)
    assert rel_err(g(q.float(), k.float(), v.float()), want) < 1e-5


def test_a_bottom_right_window_with_a_bias_on_cudnn_matches_the_reference():
    gen = torch.Generator().manual_seed(13)
    tensors = [torch.randn(2, 4, s, 64, generator=gen) for s in (200, 320, 320, 200)]
    bias = torch.randn(1, 4, 200, 320, generator=gen)
    keywords = _band("BOTTOM_RIGHT", 96, None)  # a right bound with a bias: cuDNN refuses (next test)
    got = _run("cuda", torch.bfloat16, tensors, keywords, bias)
    want = _run(
        "cpu", torch.float32, [t.to(torch.bfloat16).float() for t in tensors], keywords, bias.to(torch.bfloat16).float()
    )
    for name, a, b in zip(("O", "dQ", "dK", "dV"), got, want):
        assert rel_err(a.float().cpu(), b) < 2 * TOLERANCE[torch.bfloat16], name


def test_a_bottom_right_right_bound_with_a_bias_is_refused_on_cudnn_with_its_reason():
    q, k, v = (torch.randn(1, 2, s, 64, device="cuda", dtype=torch.bfloat16) for s in (64, 96, 96))
    bias = torch.randn(1, 2, 64, 96, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(cudnn.UnsupportedError, match="[Bb]ottom.right"):
        with cudnn.Graph() as g:
            g.sdpa(q, k, v, bias=bias, **_band("BOTTOM_RIGHT", None, 8))
