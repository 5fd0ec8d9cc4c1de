"""``PagedAttention`` on cuDNN against the reference backend on the same step: splits (empty
chunks included), packing and the causal tail; a whole step captured in a CUDA graph and
replayed after new plans; plan and run without a host sync."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err

import cudnn_attn

pytestmark = pytest.mark.gpu

HQ, HKV, D, PAGE = 32, 8, 128, 64


def _step(lengths, pages_per_seq, s_q=1, seed=0, layout="NHPD"):
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    num_pages = batch * pages_per_seq + 5
    table = torch.randperm(num_pages, generator=gen)[: batch * pages_per_seq].view(batch, pages_per_seq).int()
    shape = (num_pages, HKV, PAGE, D) if layout == "NHPD" else (num_pages, PAGE, HKV, D)
    k_cache, v_cache = (torch.randn(*shape, generator=gen).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(batch, HQ, s_q, D, generator=gen).to(torch.bfloat16)
    return q, k_cache, v_cache, table, torch.tensor(lengths, dtype=torch.int32)


def _both(step, **options):
    """The same step on cuDNN and on the reference backend (CPU)."""
    q, k_cache, v_cache, table, lengths = step
    results = []
    for device in ("cuda", "cpu"):
        attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device=device, **options)
        attn.plan(table.to(device), lengths.to(device))
        results.append((attn.run(q.to(device), k_cache.to(device), v_cache.to(device)), attn.schedule))
    return results


CASES = {
    "decode-auto": dict(lengths=[3000, 40, 4096, 1], pages=64),
    "decode-b1-long": dict(lengths=[30000], pages=512),
    "decode-split8-empty-chunks": dict(lengths=[100, 2000, 65], pages=32, splits=8),
    "decode-unpacked-split": dict(lengths=[700, 4000], pages=64, splits=4, pack=False),
    "decode-packed-unsplit-long": dict(lengths=[32768, 20000], pages=512, splits=1, pack=True),
    "decode-packed-2-splits-long": dict(lengths=[32768], pages=512, splits=2, pack=True),
    "decode-nphd": dict(lengths=[500, 1000], pages=16, layout="NPHD", splits=2),
    "mtp-4": dict(lengths=[4000, 130, 64], pages=64, s_q=4),
    "mtp-8-split": dict(lengths=[8192, 8100, 1000, 9], pages=128, s_q=8, splits=4),
    "mtp-16": dict(lengths=[2048, 17], pages=32, s_q=16),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_cudnn_matches_the_reference(case):
    spec = dict(CASES[case])
    step = _step(spec.pop("lengths"), spec.pop("pages"), s_q=spec.pop("s_q", 1), seed=len(case),
                 layout=spec.get("layout", "NHPD"))  # fmt: skip
    layout = spec.pop("layout", "NHPD")
    (got, schedule), (want, _) = _both(step, kv_layout=layout, **spec)
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < 1.5e-2, schedule


def test_a_captured_step_replays_after_new_plans():
    """Two layers captured once; each later step is plan() then replay(), and matches eager runs."""
    layers = 2
    max_batch, pages = 4, 32
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device="cuda", max_batch=max_batch,
                                     max_pages_per_seq=pages, cuda_graph=True)  # fmt: skip
    first = _step([100] * max_batch, pages, seed=1)
    q = first[0].cuda()
    caches = [(first[1].cuda() * (i + 1), first[2].cuda().roll(i, 0)) for i in range(layers)]
    outs = [torch.empty_like(q) for _ in range(layers)]
    attn.plan(first[3].cuda(), first[4].cuda())
    for (k, v), out in zip(caches, outs):  # warm up: graphs built, step derived once
        attn.run(q, k, v, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for (k, v), out in zip(caches, outs):
            attn.run(q, k, v, out=out)
    eager = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device="cuda", max_batch=max_batch,
                                      max_pages_per_seq=pages, splits=attn.schedule.splits)  # fmt: skip
    for seed, lengths in enumerate(([2048, 5, 777, 1300], [64, 64, 2000, 1]), start=2):
        step = _step(lengths, pages, seed=seed)
        q.copy_(step[0])
        attn.plan(step[3].cuda(), step[4].cuda())
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        eager.plan(step[3].cuda(), step[4].cuda())
        for (k, v), out in zip(caches, outs):
            assert torch.equal(out, eager.run(q, k, v))


def test_plan_and_run_make_no_host_sync():
    q, k_cache, v_cache, table, lengths = (t.cuda() for t in _step([1000, 3000], 64, s_q=4, seed=9))
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, device="cuda")
    attn.plan(table, lengths)
    attn.run(q, k_cache, v_cache)  # builds the graphs (their first build checks values)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        attn.plan(table, lengths)
        attn.run(q, k_cache, v_cache)
        attn.run(q, k_cache, v_cache)
    finally:
        torch.cuda.set_sync_debug_mode("default")
