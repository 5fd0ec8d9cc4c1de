"""FP8 attention at the edges of float32 and of its own scales, on the reference backend (the
CUDA casts share the arithmetic): non-finite and tiny amaxes take TransformerEngine's scales,
a delayed-scaling history records no inf or NaN and no call that failed, O is dequantised into
the dtype asked for in one rounding, a zero descale gives zeros."""

from __future__ import annotations

import pytest
import torch
from conftest import randn, rel_err

import cudnn_attn
from cudnn_attn.errors import UnsupportedError, ValidationError


def _inputs(seed: int, factor: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(randn(1, 2, 32, 16, generator=gen) * factor for _ in range(3))


def _oracle(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())


@pytest.mark.parametrize("poison", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_one_non_finite_call_leaves_the_next_calls_scaled_by_the_finite_history(poison):
    """After one inf, the next `history` calls were all NaN (scale 0); after a NaN they ran at
    scale 1, so small activations came out near 0 (error ~1)."""
    q, k, v = _inputs(1, factor=1e-2)
    scaling = cudnn_attn.Fp8Scaling(history=3)
    cudnn_attn.sdpa_fp8(q, k, v, scaling=scaling)
    bad = v.clone()
    bad[0, 0, 0, 0] = poison
    cudnn_attn.sdpa_fp8(q, k, bad, scaling=scaling)
    assert torch.isfinite(scaling.amaxes).all()
    for _ in range(3):
        out = cudnn_attn.sdpa_fp8(q, k, v, scaling=scaling)
        assert rel_err(out, _oracle(q, k, v)) < 0.08  # as a clean history gives


def test_current_scaling_with_one_inf_saturates_it_and_stays_finite_elsewhere():
    """An inf in q gave scale 0: every element of every batch and head became NaN."""
    q, k, v = _inputs(2)
    q = q.clone()
    q[0, 0, 0, 0] = float("inf")
    out = cudnn_attn.sdpa_fp8(q, k, v)
    assert torch.isfinite(out).all()
    assert rel_err(out[:, 1], _oracle(q[:, 1:], k[:, 1:], v[:, 1:])[:, 0]) < 0.2  # scale 1 there: coarser


def test_tiny_magnitudes_keep_float32s_largest_scale_not_nan():
    """448 / 1e-37 overflowed to an inf scale: 0 * inf = NaN everywhere."""
    q, k, v = _inputs(3)
    out = cudnn_attn.sdpa_fp8(q, k, (v.float() * 1e-37).bfloat16())
    assert torch.isfinite(out).all() and out.abs().max() > 0
    x = torch.tensor([0.0, 1e-37, -2e-37])
    back = cudnn_attn.Fp8Tensor.quantise(x).dequantise(torch.float32)
    assert torch.isfinite(back).all() and back[0] == 0 and rel_err(back, x) < 0.1


def test_out_dtype_is_one_rounding_of_the_fp8_output():
    """bf16 inputs with out_dtype=float32 came back rounded to bf16 first: not the FP8 O that
    the same data give through Fp8Tensor, against the docs' bit-for-bit promise."""
    q, k, v = _inputs(4)
    with torch.no_grad():
        o8 = cudnn_attn.sdpa_fp8(q, k, v, out_dtype=torch.float8_e4m3fn)
        wide = cudnn_attn.sdpa_fp8(q, k, v, out_dtype=torch.float32)
    assert torch.equal(wide, o8.data.float() * o8.descale)
    assert not torch.equal(wide, wide.bfloat16().float())
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = cudnn_attn.sdpa_fp8(*leaves, out_dtype=torch.float32)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert out.dtype == torch.float32 and all(g.dtype == torch.bfloat16 for g in grads)


def test_a_zero_descale_or_scale_gives_zeros_not_nan():
    q8, k8, v8 = (cudnn_attn.Fp8Tensor.quantise(x) for x in _inputs(5))
    silent = cudnn_attn.Fp8Tensor(v8.data, torch.tensor(0.0))  # V's real values: all 0
    out = cudnn_attn.sdpa_fp8(q8, k8, silent, out_dtype=torch.float32)
    assert torch.equal(out, torch.zeros_like(out))
    zeroed = cudnn_attn.Fp8Tensor.quantise(torch.randn(8), scale=torch.tensor(0.0))
    assert torch.equal(zeroed.dequantise(torch.float32), torch.zeros(8))


def test_a_refused_call_leaves_the_history_as_it_was():
    """Its amax was recorded before the refusal: later calls were scaled for a tensor never attended."""
    q, k, v = _inputs(6)
    scaling, clean = cudnn_attn.Fp8Scaling(history=4), cudnn_attn.Fp8Scaling(history=4)
    for s in (scaling, clean):
        cudnn_attn.sdpa_fp8(q, k, v, scaling=s)
    with cudnn_attn.backend("cudnn"), pytest.raises(UnsupportedError):
        cudnn_attn.sdpa_fp8(q, k, v * 1e4, scaling=scaling)  # CPU tensors: cuDNN refuses them
    assert scaling.calls == clean.calls == 1 and torch.equal(scaling.amaxes, clean.amaxes)
    assert torch.equal(cudnn_attn.sdpa_fp8(q, k, v, scaling=scaling), cudnn_attn.sdpa_fp8(q, k, v, scaling=clean))
    first = cudnn_attn.Fp8Scaling()
    with cudnn_attn.backend("cudnn"), pytest.raises(UnsupportedError):
        cudnn_attn.sdpa_fp8(q, k, v, scaling=first)
    assert first.calls == 0 and first.amaxes is None  # a failed first call leaves no history


def test_an_fp8_layer_takes_an_empty_batch_or_sequence():
    layer = cudnn_attn.nn.Attention(64, 4, fp8=True, dtype=torch.bfloat16)
    for shape in ((2, 0, 64), (0, 5, 64)):
        assert layer(torch.zeros(shape, dtype=torch.bfloat16)).shape == shape


@pytest.mark.parametrize(
    "x, scale, message",
    [
        ([1.0, 2.0], None, "x: list; expected a torch tensor"),
        (torch.zeros(4, dtype=torch.complex64), None, "x: dtype complex64"),
        (torch.empty(0), None, "x: shape \\[0\\] is empty"),
        (torch.ones(4), 2.0, "scale: 2.0; expected a float tensor of one element"),
        (torch.ones(4), torch.tensor([1.0, 2.0]), "scale: .*expected a float tensor of one element"),
        (torch.ones(4), torch.tensor(2, dtype=torch.int32), "scale: .*expected a float tensor"),
    ],
    ids=["list", "complex", "empty", "float-scale", "two-scales", "int-scale"],
)
def test_bad_quantise_arguments_are_named(x, scale, message):
    with pytest.raises(ValidationError, match=f"Fp8Tensor.quantise: {message}"):
        cudnn_attn.Fp8Tensor.quantise(x, scale=scale)


def test_sdpa_fp8_names_nested_and_raw_fp8_inputs():
    """A nested tensor was an AttributeError deep in the problem's strides; raw float8 tensors
    were told float16..float64 are expected, then float32 was refused."""
    nested = torch.nested.nested_tensor(
        [torch.randn(5, 2, 16, dtype=torch.bfloat16), torch.randn(7, 2, 16, dtype=torch.bfloat16)], layout=torch.jagged
    ).transpose(1, 2)
    with pytest.raises(UnsupportedError, match="query: a nested tensor; sdpa_fp8 takes dense"):
        cudnn_attn.sdpa_fp8(nested, nested, nested)
    raw = torch.randn(1, 2, 8, 16).to(torch.float8_e4m3fn)
    with pytest.raises(ValidationError, match="key: a raw FP8 tensor; .* or cudnn_attn.Fp8Tensor"):
        cudnn_attn.sdpa_fp8(raw.to(torch.bfloat16), raw, raw)


def test_a_graph_fp8_scale_problem_is_named_once():
    """The backward's scales repeat some of the forward's: a bad descale_q was listed twice, and a
    float given for it was also called missing."""
    q8 = torch.randn(1, 2, 8, 16).to(torch.float8_e4m3fn)
    one = torch.ones(1, 1, 1, 1)
    for descale_q, message in ((torch.ones(1), "descale_q: dtype float32, shape \\[1\\]"), (1.0, "descale_q: float")):
        with pytest.raises(ValidationError) as refused:
            with cudnn_attn.Graph() as g:
                g.sdpa_fp8(q8, q8, q8, descale_q, one, one, one, one, one)
        assert len([line for line in refused.value.problems if line.startswith("descale_q")]) == 1, refused.value
        assert refused.match(message)
