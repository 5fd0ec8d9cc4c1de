"""``combine_rows``: every row's partials combined once (by log-sum-exp, or summed), and the
layout that says where each row's partials are (``distributed.partials``).

On the CPU, the torch path against the formula in float64; on CUDA (marked ``gpu``), the Triton
kernel against the torch path on the same inputs: rows with one, several or no partials, a
partial that saw no key (LSE -inf, NaN in its O), a sink.
"""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err

from cudnn_attn.distributed import packed_schedule
from cudnn_attn.distributed.documents import Documents
from cudnn_attn.distributed.partials import layout_of
from cudnn_attn.kernels.row_combine import combine_rows

T, H, P, K = 13, 3, 24, 3


def inputs(d, dtype, gen, device, sink=False):
    """P part rows (O in dtype, LSE float32) and a where table: row 4 has no partial; a few
    partials saw no key (LSE -inf, O NaN)."""
    parts = torch.randn(P, H, d, generator=gen)
    parts_lse = torch.randn(P, H, generator=gen) * 4
    empty = torch.rand(P, H, generator=gen) < 0.2
    parts = parts.masked_fill(empty.unsqueeze(-1), float("nan"))
    parts_lse = parts_lse.masked_fill(empty, float("-inf"))
    where = torch.full((T, K), -1, dtype=torch.int32)
    order = torch.randperm(P, generator=gen).to(torch.int32)
    counts = [1, 3, 2, 1, 0, 3, 2, 1, 2, 3, 2, 3, 1]
    at = 0
    for row, n in enumerate(counts):
        where[row, :n] = order[at : at + n]
        at += n
    s = torch.randn(H, generator=gen) if sink else None
    return parts.to(dtype).to(device), moved(parts_lse, device), where.to(device), moved(s, device)


def moved(t, device):
    return None if t is None else t.to(device)


def expected(parts, parts_lse, where, sink):
    """The combine in float64, row by row, as the module's docstring writes it."""
    out = torch.zeros(T, H, parts.shape[-1], dtype=torch.float64)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64)
    for row in range(T):
        picked = [int(i) for i in where[row] if i >= 0]
        for h in range(H):
            terms = [float(parts_lse[i, h]) for i in picked] + ([float(sink[h])] if sink is not None else [])
            top = max(terms, default=float("-inf"))
            if top == float("-inf"):
                continue
            total = sum(torch.exp(torch.tensor(t - top, dtype=torch.float64)) for t in terms)
            lse[row, h] = top + torch.log(total)
            for i in picked:
                w = torch.exp(torch.tensor(float(parts_lse[i, h]) - float(lse[row, h]), dtype=torch.float64))
                if w > 0:
                    out[row, h] += parts[i, h].double() * w
    return out, lse


@pytest.mark.parametrize("sink", [False, True])
def test_weighted_combine_on_the_cpu_is_the_formula(sink):
    gen = torch.Generator().manual_seed(1)
    parts, parts_lse, where, s = inputs(16, torch.bfloat16, gen, "cpu", sink)
    out = torch.empty(T, H, 16, dtype=torch.float32)
    lse = torch.empty(T, H)
    combine_rows(out, parts, where, lse, parts_lse, s)
    want_o, want_l = expected(parts, parts_lse, where.cpu(), s)
    assert not out.isnan().any()
    assert rel_err(out, want_o) < 1e-5
    finite = torch.isfinite(want_l)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite] - want_l[finite]).abs().max() < 1e-5
    if not sink:  # row 4 has no partial: O = 0, L = -inf
        assert out[4].abs().max() == 0 and torch.isneginf(lse[4]).all()


def test_unweighted_combine_sums_each_rows_partials():
    gen = torch.Generator().manual_seed(2)
    parts, _, where, _ = inputs(8, torch.bfloat16, gen, "cpu")
    parts = parts.nan_to_num(0.5)
    out = torch.empty(T, H, 8, dtype=torch.bfloat16)
    combine_rows(out, parts, where)
    want = torch.stack([parts[[int(i) for i in where[r] if i >= 0]].double().sum(0) for r in range(T)])
    assert rel_err(out, want) < 8e-3
    assert out[4].abs().max() == 0


def test_a_weighted_combine_takes_both_lse_tensors():
    parts, parts_lse, where, _ = inputs(8, torch.float32, torch.Generator().manual_seed(3), "cpu")
    with pytest.raises(ValueError, match="parts_lse"):
        combine_rows(torch.empty(T, H, 8), parts, where, None, parts_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 192])
@pytest.mark.parametrize("sink", [False, True])
def test_the_kernel_matches_the_torch_path(d, sink):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gen = torch.Generator().manual_seed(d)
    parts, parts_lse, where, s = inputs(d, torch.bfloat16, gen, "cuda", sink)
    outs = []
    for device in ("cuda", "cpu"):
        out = torch.full((T, H, d), float("nan"), dtype=torch.bfloat16, device=device)
        lse = torch.full((T, H), float("nan"), device=device)
        combine_rows(out, parts.to(device), where.to(device), lse, moved(parts_lse, device), moved(s, device))
        outs.append((out.float().cpu(), lse.cpu()))
    (o_gpu, l_gpu), (o_cpu, l_cpu) = outs
    assert not o_gpu.isnan().any() and not l_gpu.isnan().any()
    assert rel_err(o_gpu, o_cpu) < 8e-3
    finite = torch.isfinite(l_cpu)
    assert torch.equal(torch.isfinite(l_gpu), finite)
    assert (l_gpu[finite] - l_cpu[finite]).abs().max() < 1e-4
    summed = torch.full((T, H, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    grads = parts.nan_to_num(0.25)
    combine_rows(summed, grads, where)
    want = torch.empty(T, H, d, dtype=torch.bfloat16)
    combine_rows(want, grads.cpu(), where.cpu())
    assert rel_err(summed.float().cpu(), want.float()) < 8e-3


@pytest.mark.parametrize("world", [2, 3])
def test_the_ring_layout_places_every_rows_partials(world):
    """Each row's partials over the ring's calls, in order, are the rows the calls cover."""
    docs = Documents((8 * world, 4 * world, 12 * world), world, "zigzag")
    cpu = torch.device("cpu")
    for rank in range(world):
        steps = packed_schedule.ring_steps(docs, True, rank, None, cpu)
        calls = [call for step in steps for call in step]
        tokens = sum(docs.local_lengths)
        layout = layout_of(calls, tokens, cpu)
        covered: list[list[int]] = [[] for _ in range(tokens)]
        for call, start in zip(calls, layout.starts):
            for offset, row in enumerate(call.row_index().tolist()):
                covered[row].append(start + offset)
        assert layout.parts == sum(call.row_count for call in calls)
        for row, found in enumerate(covered):
            table = [int(i) for i in layout.where[row] if i >= 0]
            assert table == found and found  # every row sees its own diagonal at least
