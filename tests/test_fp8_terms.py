"""FP8 attention with attention sinks (``sink_token`` / ``dSink_token`` on ``sdpa_fp8`` and
``sdpa_fp8_backward``) and a score modifier (``fn``, sdpa_fp8's name for ``score_mod``), on the
reference backend against float64 attention of the dequantised inputs. The same cases run on
cuDNN in ``test_gpu_fp8_terms.py``."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from fp8_terms_cases import CAP, backward_case, dequantised, forward_case, oracle, softcap_fn

import cudnn_attn as cudnn


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("h_kv", [4, 2], ids=["mha", "gqa"])
def test_fp8_forward_with_sinks_is_within_fp8_error(causal, h_kv):
    case = forward_case("cpu", h_kv=h_kv, causal=causal, sink=True)
    with cudnn.Graph() as g:
        g.sdpa_fp8(*case.args, generate_stats=True, use_causal_mask=causal, sink_token=case.sink)
    o8, stats, amax_s, amax_o = g(*case.args, case.sink)
    want_o, want_lse = oracle(*dequantised(case), sink=case.sink.double(), causal=causal)
    assert rel_err(o8.double() / case.scale_o.double(), want_o) < 0.06
    assert rel_err(stats, want_lse) < 1e-5  # S is exact in float32 from the fp8 values
    no_sink, _ = oracle(*dequantised(case), sink=None, causal=causal)
    assert rel_err(no_sink, want_o) > 0.2  # the sink takes a share the check would see
    assert float(amax_o) == pytest.approx(float((want_o.abs()).max()), rel=0.06)


def test_fp8_backward_with_dsink_is_within_fp8_error():
    case = backward_case("cpu")
    d_sink = torch.full_like(case.sink, float("nan"))
    with cudnn.Graph() as g:
        g.sdpa_fp8_backward(*case.args, use_causal_mask=True, sink_token=case.sink, dSink_token=d_sink)
    got = g(*case.args, case.sink)  # the caller's d_sink is written in place, not returned
    assert [h.name for h in g.outputs] == ["dQ", "dK", "dV", "Amax_dQ", "Amax_dK", "Amax_dV", "Amax_dP"]
    assert len(got) == 7
    for grad8, scale, want in zip(got[:3], case.grad_scales, case.want_grads):
        assert rel_err(grad8.double() / scale.double(), want) < 0.12
    assert rel_err(d_sink, case.want_d_sink) < 0.08


def test_fp8_forward_with_a_soft_capping_fn_is_within_fp8_error():
    case = forward_case("cpu", causal=False, sink=False, spread=8.0)  # scores well past the cap
    with cudnn.Graph() as g:
        cap = g.tensor(
            name="cap", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], is_pass_by_value=True, data_type=torch.float32
        )
        g.sdpa_fp8(*case.args, fn=softcap_fn(cap))
    (o8, *_) = g(*case.args, torch.full((1, 1, 1, 1), CAP))
    want, _ = oracle(*dequantised(case), sink=None, causal=False, softcap=CAP)
    uncapped, _ = oracle(*dequantised(case), sink=None, causal=False)
    assert rel_err(o8.double() / case.scale_o.double(), want) < 0.06
    assert rel_err(uncapped, want) > 0.2


def test_fp8_terms_are_refused_by_name_where_wrong():
    case = forward_case("cpu", sink=True)
    q, k, v = case.args[:3]
    fn = lambda graph, s: s  # noqa: E731
    with cudnn.Graph() as g:  # a valid build first: a wrong recording must not adopt it
        g.sdpa_fp8(*case.args, fn=fn)
    with pytest.raises(cudnn.ValidationError, match="fn: given beside score_mod"):
        with cudnn.Graph() as g:
            g.sdpa_fp8(*case.args, fn=fn, score_mod=fn)
    with pytest.raises(cudnn.ValidationError, match="fn: not a keyword of sdpa; sdpa_fp8's name for a score modifier"):
        with cudnn.Graph() as g:
            g.sdpa(q.float(), k.float(), v.float(), fn=lambda graph, s: s)
    bcase = backward_case("cpu")
    with cudnn.Graph() as g:
        g.sdpa_fp8_backward(*bcase.args)
    with pytest.raises(cudnn.ValidationError, match="score_mod: not a keyword of sdpa_fp8_backward"):
        with cudnn.Graph() as g:
            g.sdpa_fp8_backward(*bcase.args, score_mod=fn)
    with pytest.raises(cudnn.ValidationError, match="dSink_token: given without sink_token"):
        with cudnn.Graph() as g:
            g.sdpa_fp8_backward(*bcase.args, dSink_token=torch.zeros_like(bcase.sink))
    with pytest.raises(cudnn.ValidationError, match=r"sink_token: .*expected float32 \[1, 4, 1, 1\]"):
        with cudnn.Graph() as g:
            g.sdpa_fp8(*case.args, sink_token=case.sink[:, :2])


def test_a_sink_folded_into_fp8_outputs_after_the_run_is_within_fp8_error():
    """What the cuDNN plan does on Hopper (its FP8 kernels take no sink): run without, then
    ``add_sink_fp8``. On the reference's sink-less outputs it must give the float64 attention
    with the sink, stats exactly, Amax_S an upper bound of the true one."""
    from cudnn_attn.core.sink_fold import add_sink_fp8

    case = forward_case("cpu", causal=True, sink=True, seed=7)
    with cudnn.Graph() as g:
        g.sdpa_fp8(*case.args, generate_stats=True, use_causal_mask=True)
    o8, stats, amax_s, amax_o = g(*case.args)
    outputs = {"o": o8, "stats": stats, "amax_s": amax_s, "amax_o": amax_o}
    sinkless_amax_s = float(amax_s)
    add_sink_fp8(outputs, case.scale_o, case.sink)
    want_o, want_lse = oracle(*dequantised(case), sink=case.sink.double(), causal=True)
    assert rel_err(o8.double() / case.scale_o.double(), want_o) < 0.06
    assert rel_err(stats, want_lse) < 1e-5
    assert float(amax_o) == pytest.approx(float(want_o.abs().max()), rel=0.06)
    k = dequantised(case)[1]
    s = dequantised(case)[0] @ k.transpose(-1, -2) * k.shape[-1] ** -0.5
    true_amax_s = float(torch.exp(s - want_lse).masked_fill(~torch.ones_like(s, dtype=torch.bool).tril(), 0).max())
    assert true_amax_s <= float(amax_s) * (1 + 1e-6) and float(amax_s) <= sinkless_amax_s
