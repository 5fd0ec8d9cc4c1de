"""``ops/dispatch.py``: one priority list per device, every backend's reasons in one error, a debug
line per backend passed over, and ``cudnn_attn.backend("torch")`` running torch's own kernel."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import randn

import cudnn_attn
from cudnn_attn.core.constructors import forward_problem
from cudnn_attn.core.mask import Causal, ScoreOptions
from cudnn_attn.core.problem import TensorSpec
from cudnn_attn.errors import UnsupportedError
from cudnn_attn.ops import dispatch
from cudnn_attn.ops.torch.call import Call
from cudnn_attn.ops.torch.kernel import TorchKernel
from cudnn_attn.runtime import prepared


def qkv(seed, shape=(1, 2, 24, 16), dtype=torch.float32, grad=False):
    gen = torch.Generator().manual_seed(seed)
    return tuple(randn(*shape, generator=gen, dtype=dtype).requires_grad_(grad) for _ in range(3))


def problem(device="cpu", s_q=16, s_kv=16, causal=Causal.NONE, stats=False):
    def spec(s):
        return TensorSpec.contiguous((1, 2, s, 16), torch.float16, device)

    return forward_problem(spec(s_q), spec(s_kv), spec(s_kv), ScoreOptions(attn_scale=0.25, causal=causal), stats=stats)


def call(q, k, v, train=False, dropout_p=0.0, causal=Causal.NONE, scale=None):
    return Call(q, k, v, None, dropout_p, causal, scale, False, train)


def test_a_problem_on_the_cpu_takes_the_first_backend_of_the_cpu_list():
    assert dispatch.select(problem("cpu")).name == dispatch.PRIORITY["cpu"][0] == "reference"


def test_a_problem_on_a_missing_gpu_lists_the_gpu_lists_reasons_and_what_would_work():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    with pytest.raises(UnsupportedError, match="no CUDA device is available") as caught:
        dispatch.select(problem("cuda:0"))
    assert "cudnn backend" in str(caught.value)
    assert any("CPU tensors" in a for a in caught.value.alternatives)


def test_when_no_backend_runs_a_problem_one_error_lists_every_backends_reasons(monkeypatch):
    # Bottom-right causal with more queries than keys: the reference refuses the rows without keys,
    # torch's kernel refuses the bottom-right mask itself.
    monkeypatch.setitem(dispatch.PRIORITY, "cpu", ("torch", "reference"))
    with pytest.raises(UnsupportedError) as caught:
        dispatch.select(problem("cpu", s_q=24, s_kv=16, causal=Causal.BOTTOM_RIGHT))
    lines = caught.value.problems
    assert any(line.startswith("torch: use_causal_mask_bottom_right") for line in lines), lines
    assert any(line.startswith("reference: use_causal_mask_bottom_right: S_q=24 > S_kv=16") for line in lines), lines
    assert "torch and reference backend" in str(caught.value)


def test_each_backend_passed_over_is_logged_once_at_debug(monkeypatch, caplog):
    monkeypatch.setitem(dispatch.PRIORITY, "cpu", ("torch", "reference"))
    asked = problem("cpu", s_q=8, s_kv=40, stats=True)  # stats: torch's kernel gives no log-sum-exp
    with caplog.at_level(logging.DEBUG, logger="cudnn_attn"):
        assert dispatch.select(asked).name == "reference"
        dispatch.select(asked)
    said = [r.getMessage() for r in caplog.records if "backend passed over" in r.getMessage()]
    assert len(said) == 1, said
    assert "torch backend passed over: generate_stats" in said[0] and asked.describe() in said[0]


def test_a_plain_cpu_call_leaves_the_reference_for_torchs_kernel_and_says_why(caplog):
    q, k, v = qkv(1)
    with caplog.at_level(logging.DEBUG, logger="cudnn_attn"):
        choice = dispatch.select_call(call(q, k, v), "auto")
    assert isinstance(choice.run, TorchKernel) and choice.backend is None and choice.as_graph
    said = [r.getMessage() for r in caplog.records if "reference backend passed over" in r.getMessage()]
    assert len(said) == 1 and "torch's CPU kernel" in said[0], said


def test_under_reference_a_plain_cpu_call_stays_on_the_reference_and_float64_leaves():
    q, k, v = qkv(2)
    assert dispatch.select_call(call(q, k, v), "reference").backend == "reference"
    q64, k64, v64 = (t.double() for t in (q, k, v))
    leaving = dispatch.select_call(call(q64, k64, v64), "reference")
    assert isinstance(leaving.run, TorchKernel) and leaving.run.why.startswith("float64")
    assert not leaving.as_graph  # what cuDNN lacks is not checked as a graph would check it


def test_under_cudnn_a_call_every_engine_refuses_lists_each_engines_reasons():
    q, k, v = (t.double() for t in qkv(3))
    with cudnn_attn.backend("cudnn"):
        with pytest.raises(UnsupportedError) as caught:
            cudnn_attn.sdpa(q, k, v, is_causal=True)
    lines = caught.value.problems
    assert any(line.startswith("torch_cudnn: no gradients") for line in lines), lines
    assert "cudnn: float64: cuDNN attention has no double-precision path" in lines, lines
    assert 'sdpa under cudnn_attn.backend("cudnn")' in str(caught.value)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_backend_torch_runs_sdpa_on_torchs_kernel(grad):
    q, k, v = qkv(4, shape=(2, 4, 40, 16), grad=grad)  # a geometry no other test uses
    mask = torch.rand(40, 40, generator=torch.Generator().manual_seed(5)) > 0.3
    before = {id(run) for run in prepared.held()}
    with cudnn_attn.backend("torch"):
        out = cudnn_attn.sdpa(q, k, v, attn_mask=mask, scale=0.3)
    assert {id(run) for run in prepared.held()} == before  # no graph was prepared
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    assert torch.equal(out, expected)
    if grad:
        got = torch.autograd.grad(out.sum(), (q, k, v))
        want = torch.autograd.grad(expected.sum(), (q, k, v))
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_backend_torch_runs_a_negative_scale_on_torchs_exact_math_kernel():
    # torch 2.13's CPU flash kernel gives NaN for a negative scale with a causal mask.
    q, k, v = qkv(6, shape=(1, 2, 8, 16))
    with cudnn_attn.backend("torch"):
        out = cudnn_attn.sdpa(q, k, v, is_causal=True, scale=-0.5)
    scores = (q.double() @ k.double().transpose(-1, -2) * -0.5).masked_fill(
        ~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf")
    )
    expected = scores.softmax(-1) @ v.double()
    assert (out.double() - expected).abs().max() < 1e-5


def test_backend_torch_runs_a_graphs_plain_forward_and_refuses_stats_by_name():
    q, k, v = qkv(7, dtype=torch.float16)
    with cudnn_attn.backend("torch"):
        with cudnn_attn.Graph() as g:
            g.sdpa(q, k, v, use_causal_mask=True, attn_scale=0.2, is_inference=True)
        with pytest.raises(UnsupportedError, match="generate_stats: torch's SDPA kernel returns no log-sum-exp"):
            with cudnn_attn.Graph() as refused:
                refused.sdpa(q, k, v, generate_stats=True)
    assert g.nodes[0].backend == "torch"
    assert torch.equal(g(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2))
