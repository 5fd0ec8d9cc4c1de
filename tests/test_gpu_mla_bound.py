"""``bench --mla``'s no-math columns (``bench/mla_bound.py``): the streaming kernel reads every page
of its program's chunk, in the table's order, and the bound column's partials merge into ``out``."""

from __future__ import annotations

import pytest
import torch

from cudnn_attn.bench import mla_bound

pytestmark = pytest.mark.gpu

D, DV, PAGE = 576, 512, 64


@pytest.fixture
def hopper():
    if not torch.cuda.is_available() or not mla_bound.available(torch.device("cuda")):
        pytest.skip("the streaming kernel needs an sm_90 GPU with Gluon")


@pytest.mark.parametrize("heads, batch, pages, splits", [(16, 3, 10, 4), (128, 2, 8, 1), (72, 1, 33, 5)])
def test_programs_read_their_pages(hopper, heads, batch, pages, splits):
    cache = torch.randn(batch * pages + 3, 1, PAGE, D, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(cache.shape[0], device="cuda")[: batch * pages].int().view(batch, pages)
    chunk = -(-pages // splits)
    lse = torch.full((batch, splits, heads), float("nan"), device="cuda")
    o = torch.full((batch, splits, heads, DV), float("nan"), device="cuda")
    blocks = -(-heads // 64)
    # what each program sums: the first 64 dims of the first 8 tokens of each page of its chunk
    seen = cache[:, 0, :8, :64].float().sum((1, 2))[table.long()]  # [batch, pages]
    want = torch.stack([seen[:, s * chunk : (s + 1) * chunk].sum(1) for s in range(splits)], 1)
    mla_bound.layer(cache, table, heads=heads, splits=splits, chunk_pages=chunk, partial_o=o, partial_lse=lse, out=None)
    torch.cuda.synchronize()
    for block in range(blocks):  # without partials: one value per program, its first head's
        got = lse[:, :, block * 64]
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-2), (got, want)
    assert torch.isnan(o).all(), "the read column writes no partial output"

    out = torch.full((batch, heads, 1, DV), float("nan"), device="cuda", dtype=torch.bfloat16)
    partial_o = o if splits > 1 else out.transpose(1, 2)
    mla_bound.layer(
        cache, table, heads=heads, splits=splits, chunk_pages=chunk, partial_o=partial_o, partial_lse=lse, out=out
    )
    torch.cuda.synchronize()
    assert torch.allclose(lse, want[:, :, None].expand_as(lse), rtol=1e-4, atol=1e-2)  # every live head's row
    assert (out == 0).all(), "the partials (zeros) merge into zeros"
