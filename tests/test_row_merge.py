"""``merge_rows`` and ``add_rows``: a block's rows merged (or added) into running float32 rows.

On the CPU, the torch path against the formula in float64; on CUDA (marked ``gpu``), the
Triton kernels against the torch path on the same inputs: rows picked by index and by a run,
packed ``[T, H, D]`` views, rows with no visible key (-inf, NaN in their O), the first block.
"""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err

from cudnn_attn.kernels import row_merge
from cudnn_attn.kernels.row_merge import add_rows, as_rows, merge_rows

B, H, S, M = 2, 3, 11, 5
F32_TOL = 1e-5


def block(d, dtype, gen, device):
    """A block of M rows: O and LSE, some rows with no visible key (LSE -inf, O NaN)."""
    o = torch.randn(B, H, M, d, generator=gen)
    lse = torch.randn(B, H, M, generator=gen) * 4
    empty = torch.rand(B, H, M, generator=gen) < 0.25
    empty[0, 1, 2] = True
    o = o.masked_fill(empty.unsqueeze(-1), float("nan"))
    return o.to(dtype).to(device), lse.masked_fill(empty, float("-inf")).to(device)


def running(d, gen, device):
    out = torch.randn(B, H, S, d, generator=gen)
    lse = (torch.randn(B, H, S, generator=gen) * 4).masked_fill(torch.rand(B, H, S, generator=gen) < 0.2, -torch.inf)
    return out.to(device), lse.to(device)


def expected_merge(out, lse, o, o_lse, at):
    """The merge in float64, as the module's docstring writes it."""
    out, lse = out.double().clone(), lse.double().clone()
    old_o, old_l = out[:, :, at], lse[:, :, at]
    new = torch.logaddexp(old_l, o_lse.double())
    base = torch.where(torch.isneginf(new), 0.0, new).unsqueeze(-1)
    w_old, w_new = torch.exp(old_l.unsqueeze(-1) - base), torch.exp(o_lse.double().unsqueeze(-1) - base)
    merged = torch.where(w_old > 0, old_o * w_old, 0.0) + torch.where(w_new > 0, o.double() * w_new, 0.0)
    out[:, :, at], lse[:, :, at] = merged, new
    return out, lse


ROWS = {"index": torch.tensor([9, 0, 4, 7, 2]), "run": 3}


@pytest.mark.parametrize("rows", sorted(ROWS))
def test_merge_rows_on_the_cpu_is_the_formula(rows):
    gen = torch.Generator().manual_seed(0)
    out, lse = running(16, gen, "cpu")
    o, o_lse = block(16, torch.bfloat16, gen, "cpu")
    at = ROWS[rows] if rows == "index" else slice(3, 3 + M)
    want_o, want_l = expected_merge(out, lse, o, o_lse, at)
    merge_rows(out, lse, o, o_lse, ROWS[rows])
    assert not out.isnan().any()
    assert rel_err(out, want_o) < F32_TOL
    finite = torch.isfinite(want_l)
    assert torch.equal(torch.isfinite(lse), finite) and rel_err(lse[finite], want_l[finite]) < F32_TOL


def test_add_rows_on_the_cpu_adds_and_first_writes():
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(B, H, S, 8, generator=gen)
    grad = torch.randn(B, H, M, 8, generator=gen).to(torch.bfloat16)
    index = ROWS["index"]
    want = target.clone()
    want[:, :, index] += grad.float()
    add_rows(target, grad, index)
    assert torch.equal(target, want)
    add_rows(target, grad, 2, first=True)
    assert torch.equal(target[:, :, 2 : 2 + M], grad.float())


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 192])
@pytest.mark.parametrize("rows", sorted(ROWS))
@pytest.mark.parametrize("first", [False, True])
def test_the_kernels_match_the_torch_path(d, rows, first):
    if row_merge._kernels() is None:
        pytest.skip("Triton is not installed: the torch path runs on CUDA too")
    gen = torch.Generator().manual_seed(d)
    out, lse = running(d, gen, "cuda")
    o, o_lse = block(d, torch.bfloat16, gen, "cuda")
    at = ROWS[rows].cuda() if rows == "index" else ROWS[rows]
    want_o, want_l = out.clone(), lse.clone()
    row_merge._merge_torch(want_o, want_l, o, o_lse, at, first)
    merge_rows(out, lse, o, o_lse, at, first=first)
    torch.cuda.synchronize()
    same = ~want_o.isnan()
    assert torch.equal(same, ~out.isnan())  # NaN only where a first block's empty row wrote it
    assert rel_err(out[same], want_o[same]) < F32_TOL
    finite = torch.isfinite(want_l)
    assert torch.equal(torch.isfinite(lse), finite) and rel_err(lse[finite], want_l[finite]) < F32_TOL

    target, grad = out.nan_to_num(), torch.randn(B, H, M, d, generator=gen).to(torch.bfloat16).cuda()
    want = target.clone()
    at_cpu = at.cpu() if isinstance(at, torch.Tensor) else slice(at, at + M)
    want[:, :, at_cpu] = grad.float() + (0 if first else want[:, :, at_cpu])
    add_rows(target, grad, at, first=first)
    assert torch.equal(target, want)


@pytest.mark.gpu
def test_packed_views_merge_in_place():
    """A packed ``[T, H, D]`` running output through ``as_rows``, rows picked by index."""
    if row_merge._kernels() is None:
        pytest.skip("Triton is not installed")
    gen = torch.Generator().manual_seed(5)
    t, h, d = 37, 4, 128
    out = torch.randn(t, h, d, generator=gen).cuda()
    lse = torch.randn(t, h, 1, generator=gen).cuda()
    index = torch.randperm(t, generator=gen)[:13].cuda()
    o = torch.randn(13, h, d, generator=gen).to(torch.bfloat16).cuda()
    o_lse = torch.randn(13, h, 1, generator=gen).cuda()
    want_o, want_l = expected_merge(as_rows(out), as_rows(lse)[..., 0], as_rows(o), as_rows(o_lse)[..., 0], index)
    merge_rows(as_rows(out), as_rows(lse)[..., 0], as_rows(o), as_rows(o_lse)[..., 0], index)
    assert rel_err(as_rows(out), want_o) < F32_TOL and rel_err(as_rows(lse)[..., 0], want_l) < F32_TOL
