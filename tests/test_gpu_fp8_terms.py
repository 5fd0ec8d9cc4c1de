"""FP8 attention with sinks and a soft-capping ``fn`` on cuDNN, against the reference backend's
emulation of the same op on the same inputs and against float64 attention of the dequantised
inputs (the cases of ``fp8_terms_cases.py``; the CPU side is ``test_fp8_terms.py``).

cuDNN quantises P per block of keys in its online softmax, the emulation after the whole row, so
FP8 outputs agree within a few FP8 steps (as in ``test_gpu_fp8.py``); stats closely."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from fp8_terms_cases import CAP, backward_case, dequantised, forward_case, oracle, softcap_fn
from test_gpu_fp8 import _graphs as _both  # the same recording on cuDNN and on the reference
from test_gpu_fp8 import _poisoned

import cudnn_attn

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("h_kv", [4, 2], ids=["mha", "gqa"])
def test_fp8_forward_with_sinks_on_cudnn(causal, h_kv):
    case = forward_case("cuda", h_kv=h_kv, causal=causal, sink=True)
    fast, ref = _both(
        lambda g: g.sdpa_fp8(*case.args, generate_stats=True, use_causal_mask=causal, sink_token=case.sink)
    )
    o8, stats, _, amax_o = fast(*case.args, case.sink, out=tuple(_poisoned(h) for h in fast.outputs))
    o_ref, stats_ref, _, amax_o_ref = ref(*case.args, case.sink)
    want_o, want_lse = oracle(*dequantised(case), sink=case.sink.double(), causal=causal)
    torch.cuda.synchronize()
    scale = case.scale_o.double()
    assert rel_err(o8.double() / scale, o_ref.double() / scale) < 0.08
    assert rel_err(o8.double() / scale, want_o) < 0.06
    assert rel_err(stats, stats_ref) < 1e-4 and rel_err(stats, want_lse) < 1e-4
    assert rel_err(amax_o, amax_o_ref) < 0.05


def test_fp8_backward_with_dsink_on_cudnn():
    case = backward_case("cuda")
    d_sink, d_sink_ref = (torch.full_like(case.sink, float("nan")) for _ in range(2))
    receivers = iter((d_sink, d_sink_ref))  # the caller's tensors, written in place by each run
    fast, ref = _both(
        lambda g: g.sdpa_fp8_backward(
            *case.args, use_causal_mask=True, sink_token=case.sink, dSink_token=next(receivers)
        )
    )
    got = fast(*case.args, case.sink, out=tuple(_poisoned(h) for h in fast.outputs))
    expected = ref(*case.args, case.sink)
    torch.cuda.synchronize()
    for name, a, b, scale, want in zip(("dQ", "dK", "dV"), got, expected, case.grad_scales, case.want_grads):
        assert rel_err(a.float(), b.float()) < 0.1, name
        assert rel_err(a.double() / scale.double(), want) < 0.12, name
    assert rel_err(d_sink, d_sink_ref) < 1e-3  # both from the same O, dO and stats, in float32
    assert rel_err(d_sink, case.want_d_sink) < 0.08


def test_an_fp8_fn_is_refused_by_cudnn_and_run_by_the_reference_on_the_gpu():
    """cuDNN 9.19 builds sdpa_fp8 with a soft-capping fn on an H100 but its O is wrong (rel err 12.5
    against the emulation when it was let through): refused by name; the reference runs it."""
    case = forward_case("cuda", causal=False, sink=False, spread=8.0)
    cap = torch.full((1, 1, 1, 1), CAP)

    def record(g):
        handle = g.tensor(
            name="cap", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], is_pass_by_value=True, data_type=torch.float32
        )
        g.sdpa_fp8(*case.args, fn=softcap_fn(handle))

    with pytest.raises(cudnn_attn.UnsupportedError, match="fn .a score modifier. on FP8 attention: cuDNN 9.19"):
        with cudnn_attn.Graph(backend="cudnn", cache=cudnn_attn.PlanCache()) as g:
            record(g)
    with cudnn_attn.Graph(backend="reference", cache=cudnn_attn.PlanCache()) as g:
        record(g)
    (o8, *_) = g(*case.args, cap)
    want, _ = oracle(*dequantised(case), sink=None, causal=False, softcap=CAP)
    assert rel_err(o8.double() / case.scale_o.double(), want) < 0.06
