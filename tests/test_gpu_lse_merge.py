"""``merge_partials`` on CUDA: the Triton kernel against the torch fallback on the same inputs,
with no host sync, and captured in a CUDA graph then replayed on new values."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err

from cudnn_attn.kernels import lse_merge
from cudnn_attn.kernels.lse_merge import merge_partials

pytestmark = pytest.mark.gpu

B, H, S = 3, 4, 7  # 84 rows: not a multiple of any tile
F32_TOL = 1e-5  # exp, log and the division differ between the two by a few float32 ulps


@pytest.fixture(autouse=True)
def triton_kernel():
    if lse_merge._kernels() is None:
        pytest.skip("Triton is not installed: merge_partials runs the torch fallback on CUDA")


def part(chunks, d, dtype, gen, bshd=False):
    """Random ``(o, stats)`` on CUDA: stats spread over ~20 nats, some chunks empty (-inf, with
    NaN in their O as an unwritten buffer would hold), and row (0, 1, 2) empty in every chunk."""
    o = torch.randn(B, chunks, H, S, d, generator=gen)
    stats = torch.randn(B, chunks, H, S, generator=gen) * 5 + 3
    empty = torch.rand(B, chunks, H, S, generator=gen) < 0.2
    empty[0, :, 1, 2] = True
    stats = stats.masked_fill(empty, float("-inf"))
    o = o.masked_fill(empty.unsqueeze(-1), float("nan")).to(dtype)
    if bshd:  # stored [B, S, N, H, D]
        o = o.permute(0, 3, 1, 2, 4).contiguous().permute(0, 2, 3, 1, 4)
    return o.cuda(), stats.cuda()


def buffers(d, dtype, strided):
    """NaN-filled ``out`` and ``lse``; ``strided``: views of BSHD / BSH buffers."""
    if strided:
        out = torch.empty(B, S, H, d, dtype=dtype, device="cuda").transpose(1, 2)
        lse = torch.empty(B, S, H, device="cuda").transpose(1, 2)
    else:
        out = torch.empty(B, H, S, d, dtype=dtype, device="cuda")
        lse = torch.empty(B, H, S, device="cuda")
    return out.fill_(float("nan")), lse.fill_(float("nan"))


def assert_same(actual, expected):
    """Equal up to float32 rounding: each element within F32_TOL of the fallback's (values are
    about 1) in float32, or one step of a 16-bit ``out``; -inf exactly where it has -inf."""
    sixteen_bit = actual.dtype != torch.float32
    err = rel_err(actual, expected)  # fails on NaN and on infinities that differ
    assert err < (1e-3 if sixteen_bit else F32_TOL), f"rel_err {err:.2e}"
    finite = torch.isfinite(expected)
    a, e = actual.float()[finite], expected.float()[finite]
    if sixteen_bit:
        bound = torch.finfo(actual.dtype).eps * e.abs() + 1e-5
        assert (a != e).float().mean() < 0.01, "more than rare rounding flips"
    else:
        bound = F32_TOL * (e.abs() + 1)
    excess = ((a - e).abs() - bound).max()
    assert excess <= 0, f"an element differs by {excess:.2e} more than allowed"


def fallback(parts, d, dtype, strided):
    out, lse = buffers(d, dtype, strided)
    lse_merge._merge_torch(parts, out, lse)
    return out, lse


CASES = {
    "bf16-d128-one-part": (torch.bfloat16, torch.bfloat16, 128, [8], False),
    "fp16-d64-body-tail": (torch.float16, torch.float16, 64, [5, 1], False),
    "bf16-d80-body-tail-bshd": (torch.bfloat16, torch.bfloat16, 80, [6, 1], True),
    "fp32-d256-body-tail": (torch.float32, torch.float32, 256, [3, 1], True),
    "bf16-to-fp32-d320": (torch.bfloat16, torch.float32, 320, [4, 1], False),  # two blocks of D per row
    "fp32-to-bf16-d16-empty-body": (torch.float32, torch.bfloat16, 16, [0, 1], True),
    # one part: read in one round of loads up to MAX_CHUNKS chunks, in blocks of them beyond
    "fp32-to-bf16-d512-one-part-128": (torch.float32, torch.bfloat16, 512, [128], False),
    "fp32-to-bf16-d512-one-part-200": (torch.float32, torch.bfloat16, 512, [200], False),
    "bf16-d64-one-part-1": (torch.bfloat16, torch.bfloat16, 64, [1], True),
}


@pytest.mark.parametrize("case", list(CASES), ids=lambda c: c)
def test_triton_matches_the_torch_fallback(case):
    o_dtype, out_dtype, d, chunks, strided = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    parts = [part(n, d, o_dtype, gen, bshd=strided and i == 0) for i, n in enumerate(chunks)]
    out, lse = buffers(d, out_dtype, strided)
    torch.cuda.set_sync_debug_mode("error")  # a host sync raises
    try:
        assert merge_partials(parts, out, lse) is out
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected_out, expected_lse = fallback(parts, d, out_dtype, strided)
    assert_same(out, expected_out)
    assert_same(lse, expected_lse)
    assert torch.equal(out[0, 1, 2], torch.zeros_like(out[0, 1, 2])) and lse[0, 1, 2] == float("-inf")


@pytest.mark.parametrize("count", [2, 3], ids=["kernel", "fallback"])
def test_captured_in_a_cuda_graph_and_replayed_on_new_values(count):
    """After one eager call (the kernel compiles), a capture replays on whatever the inputs hold."""
    d, gen = 128, torch.Generator().manual_seed(count)
    static = [part(n, d, torch.bfloat16, gen, bshd=i == 0) for i, n in enumerate([4, 1, 2][:count])]
    out, lse = buffers(d, torch.bfloat16, strided=True)
    merge_partials(static, out, lse)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        merge_partials(static, out, lse)
    for _ in range(3):
        fresh = [part(o.shape[1], d, torch.bfloat16, gen) for o, _ in static]
        for (o, stats), (new_o, new_stats) in zip(static, fresh):
            o.copy_(new_o)
            stats.copy_(new_stats)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        expected_out, expected_lse = fallback(fresh, d, torch.bfloat16, strided=False)
        assert_same(out, expected_out)
        assert_same(lse, expected_lse)
