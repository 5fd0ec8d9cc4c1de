"""The MLA decode kernels (``kernels/mla_decode.py``'s Triton kernel and, on Hopper, the
warp-specialised one in ``mla_decode_hopper.py``) against float64 attention over the pages, on
caches whose rows past each sequence's end hold NaN, into outputs poisoned with NaN."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err

from cudnn_attn.kernels.mla_decode import mla_decode, supported
from cudnn_attn.kernels.mla_decode_hopper import usable

pytestmark = pytest.mark.gpu

D, DV, PAGE = 576, 512, 64
SCALE = 192**-0.5
CASES = {  # heads, lengths, splits, sink, dtype, layout
    "h128-one-split": (128, [1000, 64, 4096], 1, False, torch.bfloat16, "NHPD"),
    "h128-splits-sink": (128, [3000, 1, 0], 4, True, torch.bfloat16, "NHPD"),
    "h16-splits": (16, [4096, 130], 8, False, torch.bfloat16, "NHPD"),
    "h96-two-blocks": (96, [700, 2048], 3, False, torch.bfloat16, "NPHD"),
    "h64-fp16": (64, [1500, 333], 2, True, torch.float16, "NHPD"),
}


def _reference(q, latent, table, lengths, sink, layout):
    """float64 attention of each sequence over its gathered pages (V the latent's first DV dims)."""
    out = torch.zeros(q.shape[0], q.shape[1], 1, DV, dtype=torch.float64)
    for b, n in enumerate(lengths):
        pages = latent[table[b].long()].double().cpu()
        rows = (pages.squeeze(1) if layout == "NHPD" else pages.squeeze(2)).reshape(-1, D)[:n]
        s = q[b, :, 0].double().cpu() @ rows.T * SCALE
        if sink is not None:
            s = torch.cat([s, sink.double().cpu()[:, None]], 1)
        p = torch.softmax(s, -1)[:, :n] if s.shape[1] else s
        out[b, :, 0] = p @ rows[:, :DV] if n else 0.0
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("kernel", ["triton", "hopper"])
def test_mla_decode_kernel_matches_float64(case, kernel):
    heads, lengths, splits, with_sink, dtype, layout = CASES[case]
    gen = torch.Generator().manual_seed(len(case) + splits)
    pages = max(max(lengths) // PAGE + 1, splits)
    num_pages = len(lengths) * pages + 2
    shape = (num_pages, 1, PAGE, D) if layout == "NHPD" else (num_pages, PAGE, 1, D)
    latent = torch.randn(*shape, generator=gen).to(dtype)
    table = torch.randperm(num_pages, generator=gen)[: len(lengths) * pages].view(-1, pages).int()
    for b, n in enumerate(lengths):  # every row past the end of a sequence: NaN
        flat = latent[table[b].long()]
        flat.view(-1, D)[n:] = float("nan")
        latent[table[b].long()] = flat
    q = torch.randn(len(lengths), heads, 1, D, generator=gen).to(dtype)
    sink = torch.randn(heads, generator=gen) * 2 if with_sink else None
    want = _reference(q, latent, table, lengths, sink, layout)

    cache = latent.cuda()
    q_gpu = q.cuda()
    if not supported(cache.device, PAGE, D, DV):
        pytest.skip("the MLA kernels need Triton")
    hopper = usable(q_gpu, cache, cache[..., :DV], layout)
    if kernel == "hopper" and not hopper:
        pytest.skip("the warp-specialised kernel needs an sm_90 GPU and Gluon")
    out = torch.full((len(lengths), heads, 1, DV), float("nan"), dtype=dtype, device="cuda")
    mla_decode(
        q_gpu,
        cache,
        cache[..., :DV],
        table.cuda(),
        torch.tensor(lengths, dtype=torch.int32, device="cuda"),
        out,
        head_dim_v=DV,
        scale=SCALE,
        kv_layout=layout,
        splits=splits,
        chunk_pages=-(-pages // splits),
        sink=None if sink is None else sink.cuda(),
        tuning={"num_warps": 8} if kernel == "triton" else None,
    )
    got = out.cpu().double()
    assert torch.isfinite(got).all(), f"{int((~torch.isfinite(got)).sum())} non-finite values"
    assert rel_err(got, want) < 1e-2
    assert got.abs().sum() > 0  # not the zeros of a launch that never ran
