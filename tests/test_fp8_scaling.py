"""Delayed scaling (``Fp8Scaling``): scales from an amax history, this call's amax recorded
during the cast; the first call scales by its own amaxes. On the reference backend."""

from __future__ import annotations

import pytest
import torch
from conftest import randn, rel_err

import cudnn_attn
from cudnn_attn.errors import ValidationError
from cudnn_attn.fp8 import quantised


def _inputs(seed, factor=1.0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(randn(1, 2, 32, 16, generator=gen) * factor for _ in range(3))


def test_first_call_is_current_scaling_and_records_its_amaxes():
    scaling = cudnn_attn.Fp8Scaling(history=4)
    q, k, v = _inputs(0)
    delayed = cudnn_attn.sdpa_fp8(q, k, v, scaling=scaling)
    assert torch.equal(delayed, cudnn_attn.sdpa_fp8(q, k, v))
    assert torch.equal(scaling.amaxes[:, 0], torch.stack([x.abs().max().float() for x in (q, k, v)]))


def test_the_history_sets_the_scale_and_each_call_records_its_amax():
    scaling = cudnn_attn.Fp8Scaling(history=2)
    big, small = _inputs(1, factor=4.0), _inputs(2)
    scaling.quantise(big)  # call 0: the history holds the large amaxes
    casts = scaling.quantise(small)  # call 1: scaled by the large amaxes, not its own
    for (_, descale), x in zip(casts, big):
        assert torch.allclose(descale.reshape(()), x.abs().max().float() / 448)
    assert torch.equal(scaling.amaxes[:, 1], torch.stack([x.abs().max().float() for x in small]))
    scaling.quantise(small)  # call 2 overwrites slot 0: the large amaxes leave the window
    (_, descale), *_ = scaling.quantise(small)
    assert torch.allclose(descale.reshape(()), small[0].abs().max().float() / 448)


def test_a_tensor_that_outgrows_its_history_saturates_then_recovers():
    scaling = cudnn_attn.Fp8Scaling(history=1)
    scaling.quantise(_inputs(3))
    grown = _inputs(3, factor=10.0)
    (q8, _), *_ = scaling.quantise(grown)
    assert q8.float().abs().max() == 448 and torch.isfinite(q8.float()).all()  # clipped, never NaN
    (q8, descale), *_ = scaling.quantise(grown)  # the history now holds the grown amax
    expected, expected_descale = quantised(grown[0])
    assert torch.equal(q8.float(), expected.float()) and torch.equal(descale, expected_descale)


def test_steady_inputs_match_current_scaling():
    scaling = cudnn_attn.Fp8Scaling()
    q, k, v = _inputs(4)
    for _ in range(3):
        out = cudnn_attn.sdpa_fp8(q, k, v, is_causal=True, scaling=scaling)
    assert torch.equal(out, cudnn_attn.sdpa_fp8(q, k, v, is_causal=True))


def test_the_module_keeps_its_own_history():
    layer = cudnn_attn.nn.Attention(32, 2, fp8=True, dtype=torch.bfloat16)
    layer(randn(1, 8, 32))
    assert layer.fp8_scaling is not None and layer.fp8_scaling.calls == 1


def test_a_checkpoint_resumes_with_the_history_it_left_off_with():
    """The history was no part of state_dict: a model resumed from a checkpoint scaled by fresh
    amaxes, 5.4% away from the run it resumed."""
    torch.manual_seed(3)
    layer = cudnn_attn.nn.Attention(64, 4, fp8=True, causal=True, dtype=torch.bfloat16)
    for scale in (20.0, 5.0, 1.0):  # a history whose largest amax is not the next call's
        layer(randn(2, 16, 64).bfloat16() * scale)
    resumed = cudnn_attn.nn.Attention(64, 4, fp8=True, causal=True, dtype=torch.bfloat16)
    resumed.load_state_dict(layer.state_dict())
    x = randn(2, 16, 64, generator=torch.Generator().manual_seed(9))
    plain = cudnn_attn.nn.Attention(64, 4, causal=True, dtype=torch.bfloat16)
    plain.load_state_dict(layer.state_dict())  # a 16-bit layer takes an FP8 layer's weights, and back
    fresh = cudnn_attn.nn.Attention(64, 4, fp8=True, causal=True, dtype=torch.bfloat16)
    fresh.load_state_dict(plain.state_dict())
    assert resumed.fp8_scaling is not None and layer.fp8_scaling is not None
    assert resumed.fp8_scaling.calls == layer.fp8_scaling.calls == 3
    assert torch.equal(resumed(x), layer(x))
    assert not torch.equal(fresh(x), layer(x))  # the history is what made them equal
    assert "fp8_scaling._extra_state" in layer.state_dict()
    assert "fp8_scaling._extra_state" not in cudnn_attn.nn.Attention(64, 4).state_dict()
    with pytest.raises(ValidationError, match="a history of 16 calls; this one keeps 4"):
        cudnn_attn.Fp8Scaling(history=4).load_state_dict(layer.fp8_scaling.state_dict())


def test_the_history_saves_with_safetensors_and_loads_in_place(tmp_path):
    """A dict as extra state broke safetensors (Hugging Face's and accelerate's default format);
    loading into a history that exists writes its tensors in place (a captured graph reads them)."""
    safetensors = pytest.importorskip("safetensors.torch")
    layer = cudnn_attn.nn.Attention(64, 4, fp8=True, causal=True, dtype=torch.bfloat16)
    for scale in (8.0, 1.0):
        layer(randn(2, 16, 64, generator=torch.Generator().manual_seed(int(scale))) * scale)
    safetensors.save_file(layer.state_dict(), tmp_path / "layer.safetensors")
    resumed = cudnn_attn.nn.Attention(64, 4, fp8=True, causal=True, dtype=torch.bfloat16)
    resumed(randn(2, 16, 64, generator=torch.Generator().manual_seed(5)))  # a history of its own first
    held = resumed.fp8_scaling.amaxes
    resumed.load_state_dict(safetensors.load_file(tmp_path / "layer.safetensors"))
    assert resumed.fp8_scaling.amaxes is held and torch.equal(held, layer.fp8_scaling.amaxes)
    x = randn(2, 16, 64, generator=torch.Generator().manual_seed(9))
    assert torch.equal(resumed(x), layer(x))
    with pytest.raises(ValidationError, match="not an Fp8Scaling's history"):
        cudnn_attn.Fp8Scaling().set_extra_state({"history": 16})
    state = layer.fp8_scaling.get_extra_state()
    for bad, message in (
        (state.float(), "float32; an Fp8Scaling's history is float64"),
        (torch.cat([state[:1], torch.tensor([float("nan")], dtype=torch.float64), state[2:]]), "another layout"),
        (torch.cat([state[:6], torch.tensor([99.0], dtype=torch.float64), state[7:]]), "slot 99 outside"),
    ):
        with pytest.raises(ValidationError, match=message):
            cudnn_attn.Fp8Scaling().set_extra_state(bad)
    with torch.device("meta"):  # a model made on the meta device still states its history
        assert cudnn_attn.nn.Attention(64, 4, fp8=True).state_dict()["fp8_scaling._extra_state"].device.type == "cpu"


def test_bad_scaling_arguments_are_named():
    with pytest.raises(ValidationError, match="history"):
        cudnn_attn.Fp8Scaling(history=0)
    with pytest.raises(ValidationError, match="scaling"):
        cudnn_attn.sdpa_fp8(*_inputs(5), scaling="delayed")


def _bf16_gradients(q, k, v, d_out, **kw):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    return torch.autograd.grad(cudnn_attn.sdpa(*leaves, **kw), leaves, d_out)


@pytest.mark.parametrize("h_kv", [4, 2], ids=["mha", "gqa"])
def test_fp8_backward_uses_and_grows_the_gradient_history(h_kv):
    gen = torch.Generator().manual_seed(7)
    q = randn(2, 4, 64, 32, generator=gen).requires_grad_()
    k, v = (randn(2, h_kv, 64, 32, generator=gen).requires_grad_() for _ in range(2))
    d_out = randn(2, 4, 64, 32, generator=gen)
    scaling = cudnn_attn.Fp8Scaling(history=4)
    expected = _bf16_gradients(q, k, v, d_out, is_causal=True, enable_gqa=h_kv != 4)
    for call in range(3):
        out = cudnn_attn.sdpa_fp8(q, k, v, is_causal=True, enable_gqa=h_kv != 4, scaling=scaling, backward="fp8")
        grads = torch.autograd.grad(out, (q, k, v), d_out)
        for got, want in zip(grads, expected):
            assert got.shape == want.shape and got.dtype == want.dtype
            assert rel_err(got, want) < 0.1  # FP8 gradients: 5-7% here
            assert not torch.equal(got, want)  # not the bf16 backward in disguise
        # The first backward measures the amaxes (two extra runs, not recorded): one entry a backward.
        assert scaling.grad_calls == call + 1


@pytest.mark.parametrize("size", [1e-4, 1e-2, 1e4], ids=["small", "mean-loss", "large"])
def test_the_first_fp8_backward_is_within_fp8_error_whatever_the_gradients_size(size):
    """The first backward measures its amaxes before it has a history: dS was quantised at scale
    1 there, so small gradients (a mean loss's) flushed dQ and dK to zero and large ones saturated."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = (randn(1, 2, 16, 32, generator=gen).requires_grad_() for _ in range(3))
    d_out = randn(1, 2, 16, 32, generator=gen) * size
    expected = _bf16_gradients(q, k, v, d_out, is_causal=True)
    out = cudnn_attn.sdpa_fp8(q, k, v, is_causal=True, scaling=cudnn_attn.Fp8Scaling(), backward="fp8")
    for got, want in zip(torch.autograd.grad(out, (q, k, v), d_out), expected):
        assert rel_err(got, want) < 0.15  # FP8 gradients: 5-11% here


def test_fp8_backward_only_for_inputs_that_want_gradients():
    q, k, v = _inputs(8)
    q.requires_grad_()
    scaling = cudnn_attn.Fp8Scaling()
    cudnn_attn.sdpa_fp8(q, k, v, scaling=scaling, backward="fp8").sum().backward()
    assert q.grad is not None and k.grad is None and v.grad is None
    with torch.no_grad():  # no gradients wanted: the forward keeps nothing for a backward
        cudnn_attn.sdpa_fp8(q, k, v, scaling=scaling, backward="fp8")
    assert scaling.grad_calls == 1


def test_a_retained_fp8_backward_runs_again_with_the_same_gradients():
    """torch.autograd.grad(..., retain_graph=True) twice, as torch's own functions allow: the
    second backward reuses the first one's gradient scales, though the history has moved on
    with that backward's amaxes, and records nothing; the last backward frees what was saved."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = (randn(1, 2, 32, 16, generator=gen).requires_grad_() for _ in range(3))
    scaling = cudnn_attn.Fp8Scaling(history=1)
    out = cudnn_attn.sdpa_fp8(q, k, v, scaling=scaling, backward="fp8")
    torch.autograd.grad(out, (q, k, v), randn(1, 2, 32, 16, generator=gen) * 16)  # a step of larger gradients
    out = cudnn_attn.sdpa_fp8(q, k, v, scaling=scaling, backward="fp8")
    d_out = randn(1, 2, 32, 16, generator=gen)
    first = torch.autograd.grad(out, (q, k, v), d_out, retain_graph=True)  # scaled by the larger step's amaxes
    calls, history = scaling.grad_calls, scaling.grad_amaxes.clone()
    again = torch.autograd.grad(out, (q, k, v), d_out, retain_graph=True)
    last = torch.autograd.grad(out, (q, k, v), d_out)
    for a, b, c in zip(first, again, last):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert scaling.grad_calls == calls and torch.equal(scaling.grad_amaxes, history)
    with pytest.raises(RuntimeError, match="second time"):  # torch's own words for a freed graph
        torch.autograd.grad(out, (q, k, v), d_out)


def test_capturing_a_first_call_is_refused(monkeypatch):
    """The first call measures its amaxes before it has a history: it cannot be replayed."""
    from cudnn_attn import fp8_scaling
    from cudnn_attn.errors import UnsupportedError

    monkeypatch.setattr(fp8_scaling, "_capturing", lambda device: True)  # as inside torch.cuda.graph
    with pytest.raises(UnsupportedError, match="scaling: .*run one call before capture"):
        cudnn_attn.sdpa_fp8(*_inputs(9), scaling=cudnn_attn.Fp8Scaling())


def test_the_history_advances_on_the_device_without_host_counters():
    """The column the next call fills and the next scales are tensors, so a captured call
    advances them on every replay exactly as an eager call does."""
    scaling = cudnn_attn.Fp8Scaling(history=3)
    amaxes = []
    for seed in range(5):
        inputs = _inputs(10 + seed, factor=1.0 + seed)
        scaling.quantise(inputs)
        amaxes.append(torch.stack([x.abs().max().float() for x in inputs]))
    # Calls 3 and 4 overwrote columns 0 and 1; the next call fills column 2.
    assert torch.equal(scaling.amaxes, torch.stack([amaxes[3], amaxes[4], amaxes[2]], dim=1))
    assert scaling._slot.item() == 2
    (_, descale), *_ = scaling.quantise(_inputs(20))
    assert torch.equal(descale.reshape(()), 1.0 / (448.0 / amaxes[4][0]))
