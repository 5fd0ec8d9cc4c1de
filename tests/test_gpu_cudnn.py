"""cuDNN against the reference backend on the GPU: every feature of the grid, fresh random
inputs, outputs poisoned with NaN before each run, compared by relative error."""

from __future__ import annotations

import json
import os

import pytest
import torch
from cases import FEATURE_GRID, MASK_GRID, backward_graph, extra_inputs, forward_graph, make_inputs, valid_rows
from conftest import poisoned, rel_err

import cudnn_attn

pytestmark = pytest.mark.gpu

FWD_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
BWD_TOL = {torch.float16: 6e-3, torch.bfloat16: 3e-2}
STATS_TOL = 1e-3


def record(kind: str, case_id: str, dtype: torch.dtype, err: float) -> None:
    """Append to the error log named by CUDNN_ATTN_ERROR_LOG (the suite's worst-error report)."""
    path = os.environ.get("CUDNN_ATTN_ERROR_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"kind": kind, "case": case_id, "dtype": str(dtype), "rel_err": err}) + "\n")


def _rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x.masked_fill(~rows.to(x.device), 0)


def check(kind, case, actual, expected, tol, rows=None):
    err = rel_err(_rows(actual, rows), _rows(expected, rows))
    record(kind, case.id, case.dtype, err)
    assert err < tol, f"{kind}: rel_err {err:.3e} >= {tol}"


@pytest.mark.parametrize("case", FEATURE_GRID + MASK_GRID, ids=lambda c: c.id)
def test_cudnn_matches_reference(case):
    t = make_inputs(case, "cuda", seed=hash(case.id) % 1000)
    extra = extra_inputs(case, t)
    ref = forward_graph(case, t, "reference")
    o_ref, s_ref = ref(t["q"], t["k"], t["v"], *extra)
    fast = forward_graph(case, t, "cudnn")
    assert fast.nodes[0].backend == "cudnn"
    out = (poisoned(fast.outputs[0]), poisoned(fast.outputs[1]))
    o, s = fast(t["q"], t["k"], t["v"], *extra, out=out)
    torch.cuda.synchronize()
    rows = valid_rows(case)
    check("forward", case, o, o_ref, FWD_TOL[case.dtype], rows)
    check("stats", case, s, s_ref, STATS_TOL, rows)
    if not case.backward:
        return
    ref_b = backward_graph(case, t, o_ref, s_ref, "reference")
    expected = ref_b(t["q"], t["k"], t["v"], o_ref, t["d_o"], s_ref, *extra)
    fast_b = backward_graph(case, t, o_ref, s_ref, "cudnn")
    outs = tuple(poisoned(h) for h in fast_b.outputs)
    actual = fast_b(t["q"], t["k"], t["v"], o_ref, t["d_o"], s_ref, *extra, out=outs)
    torch.cuda.synchronize()
    kv_rows = None
    if case.padding:
        kv_rows = torch.arange(case.s_kv).view(1, 1, -1, 1) < torch.tensor(case.padding[1]).view(-1, 1, 1, 1)
    for name, a, e, r in zip(("dQ", "dK", "dV"), actual, expected, (rows, kv_rows, kv_rows)):
        check(name, case, a, e, BWD_TOL[case.dtype], r)


def test_unsupported_backward_shape_is_refused_before_cudnn():
    q = torch.randn(1, 2, 1, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(cudnn_attn.UnsupportedError, match="S_q = S_kv = 1"):
        with cudnn_attn.Graph() as g:
            g.sdpa_backward(q, q, q, q, q, torch.zeros(1, 2, 1, 1, device="cuda"))


def test_auto_backend_uses_cudnn_and_caches_the_plan():
    cache = cudnn_attn.PlanCache()
    q = torch.randn(2, 4, 64, 64, device="cuda", dtype=torch.float16)
    for _ in range(3):
        with cudnn_attn.Graph(cache=cache) as g:
            g.sdpa(q, q, q)
        assert g.nodes[0].backend == "cudnn"
    assert cache.stats()["builds"] == 1 and cache.stats()["hits"] == 2
