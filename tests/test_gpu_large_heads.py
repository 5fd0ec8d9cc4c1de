"""Head dims past 256 on Hopper and newer: cuDNN's forward plans them; each result against the
reference backend on the same GPU and inputs (outputs poisoned first)."""

from __future__ import annotations

import pytest
import torch
from conftest import TOLERANCE, rel_err

import cudnn_attn

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "d_qk, d_v, h_kv, options",
    [
        (264, 264, 4, {"use_causal_mask": True}),
        (384, 128, 2, {}),
        (512, 512, 1, {"use_padding_mask": True}),
        (520, 520, 4, {"bias": True}),
    ],
    ids=["d264-causal", "d384-128-gqa", "d512-mqa-padding", "d520-bias"],
)
def test_forward_past_256_matches_the_reference(d_qk, d_v, h_kv, options):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("head dims past 256 run on Hopper and newer")
    gen = torch.Generator().manual_seed(d_qk)
    b, h, s = 2, 4, 96

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to("cuda", torch.float16)

    q, k, v = randn(b, h, s, d_qk), randn(b, h_kv, s, d_qk), randn(b, h_kv, s, d_v)
    keywords = dict(options)
    if keywords.pop("bias", False):
        keywords["attn_bias"] = randn(1, h, s, s)
    if keywords.get("use_padding_mask"):
        lengths = torch.tensor([s, 37], dtype=torch.int32, device="cuda")
        keywords.update(seq_len_q=lengths, seq_len_kv=lengths.clone())
    results = {}
    for backend in ("cudnn", "reference"):
        with cudnn_attn.Graph(backend=backend) as g:
            o, stats = g.sdpa(q, k, v, generate_stats=True, **keywords)
        out = torch.full((b, h, s, d_v), float("nan"), dtype=torch.float16, device="cuda")
        lse = torch.full((b, h, s, 1), float("nan"), device="cuda")
        g(q, k, v, *(t for t in keywords.values() if isinstance(t, torch.Tensor)), out=(out, lse))
        results[backend] = (out, lse)
    assert rel_err(results["cudnn"][0], results["reference"][0]) < TOLERANCE[torch.float16]
    assert rel_err(results["cudnn"][1], results["reference"][1]) < 1e-4
