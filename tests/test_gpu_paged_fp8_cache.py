"""``PagedAttention`` over FP8 K/V caches on the GPU (the Triton decode kernel reads them in 8
bits; chunked prefill reads a dequantised copy of the step's pages through cuDNN) against the
reference backend on the same FP8 caches and scales; a captured FP8 step."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from test_gpu_paged_attention import HKV, HQ, PAGE, D, _step

import cudnn_attn
from cudnn_attn.errors import UnsupportedError

pytestmark = pytest.mark.gpu


def _fp8(step, kv_dtype):
    """The step with its caches stored in ``kv_dtype`` under per-cache scales, and the scales."""
    q, k_cache, v_cache, table, lengths = step
    scales = [float(c.float().abs().max()) / torch.finfo(kv_dtype).max for c in (k_cache, v_cache)]
    k8, v8 = ((c.float() / s).to(kv_dtype) for c, s in zip((k_cache, v_cache), scales))
    return (q, k8, v8, table, lengths), scales


def _run(device, step, scales, kv_dtype, q_lens=None, sinks=None, page=PAGE, **options):
    q, k8, v8, table, lengths = step
    attn = cudnn_attn.PagedAttention(
        HQ, HKV, D, page, dtype=torch.bfloat16, kv_dtype=kv_dtype, device=device, **options
    )
    attn.plan(table.to(device), lengths.to(device), q_lens=q_lens)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=device)
    extra = {"sinks": sinks.to(device)} if sinks is not None else {}
    attn.run(q.to(device), k8.to(device), v8.to(device), out=out, k_scale=scales[0], v_scale=scales[1], **extra)
    return out, attn.schedule


DECODES = {
    "e4m3-auto": dict(lengths=[3000, 40, 4096, 1], pages=64),
    "e4m3-b1-long": dict(lengths=[30000], pages=512),
    "e5m2-split-empty": dict(lengths=[0, 1, 64, 65, 3000], pages=64, kv_dtype=torch.float8_e5m2),
    "e4m3-nphd-one-chunk": dict(lengths=[700, 4000], pages=64, layout="NPHD", splits=1),
    "e4m3-mtp-4": dict(lengths=[4000, 130, 64, 4], pages=64, s_q=4),
    "e4m3-mtp-8-sinks": dict(lengths=[8192, 1000, 9], pages=128, s_q=8, sinks=True),
    # pages of 16 and 32: 64 tokens a step over 4 or 2 pages, chunks that end inside a step
    "e4m3-page16-odd-split": dict(lengths=[3000, 17, 0, 130], pages=200, page=16, splits=7),
    "e5m2-page32-nphd": dict(lengths=[2100, 33], pages=70, page=32, layout="NPHD", kv_dtype=torch.float8_e5m2),
    "e4m3-page16-mtp-4": dict(lengths=[1000, 4], pages=64, page=16, s_q=4, sinks=True),
}


@pytest.mark.parametrize("case", DECODES, ids=list(DECODES))
def test_fp8_decode_on_the_gpu_matches_the_reference(case):
    spec = dict(DECODES[case])
    kv_dtype = spec.pop("kv_dtype", torch.float8_e4m3fn)
    layout = spec.pop("layout", "NHPD")
    page = spec.get("page", PAGE)
    step, scales = _fp8(
        _step(spec.pop("lengths"), spec.pop("pages"), s_q=spec.pop("s_q", 1), seed=len(case), layout=layout, page=page),
        kv_dtype,
    )
    sinks = torch.randn(HQ, generator=torch.Generator().manual_seed(3)) * 2 if spec.pop("sinks", False) else None
    got, schedule = _run("cuda", step, scales, kv_dtype, sinks=sinks, kv_layout=layout, **spec)
    want, _ = _run("cpu", step, scales, kv_dtype, sinks=sinks, kv_layout=layout, **spec)
    assert schedule.kernel == "triton"  # eager too: only the Triton kernel reads FP8 caches
    assert torch.isfinite(got).all() and rel_err(got, want) < 1.5e-2, schedule


def test_fp8_chunked_prefill_on_the_gpu_matches_the_reference():
    q_lens, kv_lens = [400, 170, 1, 0], [400, 1600, 33, 0]
    _, k, v, table, lengths = _step(kv_lens, 32, seed=11)
    q = torch.randn(sum(q_lens) + 3, HQ, D, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    step, scales = _fp8((q, k, v, table, lengths), torch.float8_e4m3fn)
    q_lens_t = torch.tensor(q_lens, dtype=torch.int32)
    got, _ = _run("cuda", step, scales, torch.float8_e4m3fn, q_lens=q_lens_t.cuda())
    want, _ = _run("cpu", step, scales, torch.float8_e4m3fn, q_lens=q_lens_t)
    total = sum(q_lens)
    assert rel_err(got[:total], want[:total]) < 1.5e-2 and got[total:].abs().sum() == 0


def test_a_captured_fp8_step_replays_after_new_plans():
    max_batch, pages = 4, 32
    attn = cudnn_attn.PagedAttention(
        HQ,
        HKV,
        D,
        PAGE,
        dtype=torch.bfloat16,
        kv_dtype=torch.float8_e4m3fn,
        device="cuda",
        max_batch=max_batch,
        max_pages_per_seq=pages,
        cuda_graph=True,
    )
    first, scales = _fp8(_step([100] * max_batch, pages, seed=1), torch.float8_e4m3fn)
    q, k8, v8 = (t.cuda() for t in first[:3])
    out = torch.empty_like(q)
    attn.plan(first[3].cuda(), first[4].cuda())
    attn.run(q, k8, v8, out=out, k_scale=scales[0], v_scale=scales[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(q, k8, v8, out=out, k_scale=scales[0], v_scale=scales[1])
    step = _step([2048, 5, 777, 1300], pages, seed=2)
    q.copy_(step[0])
    attn.plan(step[3].cuda(), step[4].cuda())
    out.fill_(float("nan"))
    graph.replay()
    want, _ = _run("cpu", (step[0], *first[1:3], step[3], step[4]), scales, torch.float8_e4m3fn)
    assert rel_err(out, want) < 1.5e-2


def test_fp8_caches_on_a_forced_cudnn_decode_are_refused_by_name():
    step, scales = _fp8(_step([100, 200], 4, seed=4), torch.float8_e4m3fn)
    with pytest.raises(UnsupportedError, match="k_cache: torch.float8_e4m3fn caches decode through the Triton"):
        _run("cuda", step, scales, torch.float8_e4m3fn, decode_kernel="cudnn")


FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("s_q", [1, 4], ids=["one-token", "mtp-4"])
@pytest.mark.parametrize("q_scale", [2.0**17, 2.0**-24], ids=["q-past-float16s-range", "q-under-float16s-normals"])
def test_fp8_decode_reads_queries_of_any_bfloat16_magnitude(q_scale, s_q, kv_format):
    """bf16 queries far above float16's largest value, or far below its smallest normal one, with
    the softmax scale bringing the scores back to their usual size, over FP8 caches: the kernel's
    dots (in float16 for several query tokens) must neither overflow such queries nor flush them
    (the reference backend computes in float32)."""
    q, k, v, table, lengths = _step([3000, 700], 64, s_q=s_q, seed=21)
    q = (q.float() * q_scale).to(torch.bfloat16)
    step, scales = _fp8((q, k, v, table, lengths), FORMATS[kv_format])
    scale = D**-0.5 / q_scale
    got, schedule = _run("cuda", step, scales, FORMATS[kv_format], scale=scale)
    want, _ = _run("cpu", step, scales, FORMATS[kv_format], scale=scale)
    assert schedule.kernel == "triton"
    assert torch.isfinite(got).all() and rel_err(got, want) < 1.5e-2, schedule


def test_fp8_multi_token_decode_scales_each_query_row_on_its_own():
    """One query head holds a value 2^60 times its others' size, in a dimension where every key is
    0 (so its scores are ordinary): the float16 dots bring each query row into range by its own
    power of two, so the other heads of its GQA group keep their values (one power for the whole
    tile would flush them to zero and give them uniform attention)."""
    q, k, v, table, lengths = _step([3000, 700], 64, s_q=4, seed=22)
    k[..., 5] = 0
    q[:, 0, :, 5] = 2.0**60
    step, scales = _fp8((q, k, v, table, lengths), torch.float8_e4m3fn)
    got, schedule = _run("cuda", step, scales, torch.float8_e4m3fn)
    want, _ = _run("cpu", step, scales, torch.float8_e4m3fn)
    assert schedule.kernel == "triton"
    others = slice(1, None)  # head 0's own row keeps only the 2^60 (its other values flushed)
    assert torch.isfinite(got).all() and rel_err(got[:, others], want[:, others]) < 1.5e-2, schedule
