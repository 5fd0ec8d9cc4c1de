"""The frontend's THD form (4-D tensors with the caller's ragged offsets) on cuDNN: each case
against the float64 oracle, against the reference backend on the same GPU, and against the real
cuDNN frontend on the same inputs. Outputs start as NaN; writes outside the rows show."""

from __future__ import annotations

import pytest
import ragged_cases
import torch
from conftest import TOLERANCE, rel_err

import cudnn_attn

pytestmark = pytest.mark.gpu

LENGTHS_Q, LENGTHS_KV = [5, 64, 33, 1], [40, 64, 7, 64]
FORWARD = {
    "packed": dict(ragged=("q", "k", "v", "o"), stats="dense"),
    "gapped-reversed": dict(ragged=("q", "k", "v", "o"), gap=3, reverse=True, stats="dense"),
    "ragged-stats": dict(ragged=("q", "k", "v", "o"), stats="ragged"),
    "packed-q-only": dict(ragged=("q",)),  # notebook 52's form
}
TOL = TOLERANCE[torch.float16]


def _modules():
    import cudnn

    return {
        "cudnn_attn": (cudnn_attn, {}),
        "reference": (cudnn_attn, {"backend": "reference"}),
        "frontend": (cudnn, {}),
    }


def _compare(runs: dict, names: tuple[str, ...]) -> None:
    ours = runs["cudnn_attn"]
    for name in names:
        assert rel_err(ours["result"][name], ours["expected"][name]) < (5e-3 if name.startswith("d") else TOL), name
        assert rel_err(runs["reference"]["result"][name], ours["expected"][name]) < 5e-3, f"reference {name}"
        if "frontend" in runs:
            assert rel_err(ours["result"][name], runs["frontend"]["result"][name]) < TOL, f"vs frontend {name}"
        t = ours["tensors"].get(name) if isinstance(ours["tensors"], dict) else None
        if isinstance(t, ragged_cases.Ragged):
            assert t.untouched(), f"{name}: written outside its sequences' rows"


@pytest.mark.parametrize("case", list(FORWARD), ids=list(FORWARD))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_with_ragged_offsets(case, causal):
    runs = {}
    for label, (mod, options) in _modules().items():
        try:
            runs[label] = ragged_cases.forward(
                mod,
                lengths_q=LENGTHS_Q,
                lengths_kv=LENGTHS_KV,
                s_q=64,
                s_kv=64,
                d=64,
                h=4,
                device="cuda",
                causal=causal,
                seed=11,
                **FORWARD[case],
                **options,
            )
        except mod.cudnnGraphNotSupportedError:
            assert label == "frontend", f"{label} refused a case"
    _compare(runs, ("o", "stats") if FORWARD[case].get("stats") else ("o",))


@pytest.mark.parametrize("gap, reverse", [(0, False), (2, True)], ids=["packed", "gapped-reversed"])
def test_backward_with_ragged_offsets(gap, reverse):
    runs = {
        label: ragged_cases.backward(
            mod,
            lengths_q=LENGTHS_Q,
            lengths_kv=LENGTHS_KV,
            s_q=64,
            s_kv=64,
            d=64,
            h=4,
            device="cuda",
            gap=gap,
            reverse=reverse,
            causal=True,
            seed=12,
            **options,
        )
        for label, (mod, options) in _modules().items()
    }
    _compare(runs, ("dQ", "dK", "dV"))


def test_packed_page_tables():
    runs = {
        label: ragged_cases.packed_page_tables(mod, device="cuda", seed=13, **options)
        for label, (mod, options) in _modules().items()
    }
    for label, run in runs.items():
        assert rel_err(run["result"], run["expected"]) < TOL, label
    assert rel_err(runs["cudnn_attn"]["result"], runs["frontend"]["result"]) < TOL
