"""``cudnn_attn.sdpa_fp8``: FP8 attention for fp16/bf16 callers, current scaling done for them,
on the reference backend: accuracy against float64, gradients, argument errors."""

from __future__ import annotations

import pytest
import torch
from conftest import randn, rel_err

import cudnn_attn
from cudnn_attn.errors import UnsupportedError, ValidationError


def _float64(q, k, v, **kw):
    return torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_output_within_fp8_error_in_the_inputs_dtype(causal, dtype):
    # Five quantisations (Q, K, V, P, O) of about 3% rms each: 5.0-6.2% over 20 seeds at this size.
    gen = torch.Generator().manual_seed(0)
    q, k, v = (randn(2, 4, 64, 32, dtype=dtype, generator=gen) for _ in range(3))
    out = cudnn_attn.sdpa_fp8(q, k, v, is_causal=causal)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, _float64(q, k, v, is_causal=causal)) < 0.065


def test_gqa_unbatched_and_outliers():
    q = randn(8, 32, 16)
    k, v = randn(2, 32, 16), randn(2, 32, 16)
    v[0, 3] *= 50.0  # an outlier sets V's scale: the rest loses precision, never saturates
    out = cudnn_attn.sdpa_fp8(q, k, v, enable_gqa=True)
    assert out.shape == q.shape and torch.isfinite(out).all()
    assert rel_err(out, _float64(q, k, v, enable_gqa=True)) < 0.1


def test_gradients_come_from_the_16_bit_inputs():
    q, k, v = (randn(2, 4, 32, 32).requires_grad_() for _ in range(3))
    d_out = randn(2, 4, 32, 32)
    cudnn_attn.sdpa_fp8(q, k, v, is_causal=True).backward(d_out)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    cudnn_attn.sdpa(*leaves, is_causal=True).backward(d_out)
    for ours, theirs in zip((q, k, v), leaves):
        assert torch.equal(ours.grad, theirs.grad)


def test_a_retained_graph_gives_the_same_gradients_twice():
    q, k, v = (randn(2, 4, 32, 32).requires_grad_() for _ in range(3))
    d_out = randn(2, 4, 32, 32)
    out = cudnn_attn.sdpa_fp8(q, k, v, is_causal=True)
    first = torch.autograd.grad(out, (q, k, v), d_out, retain_graph=True)
    for a, b in zip(first, torch.autograd.grad(out, (q, k, v), d_out)):
        assert torch.equal(a, b)


def test_all_zero_inputs_give_zeros_not_nan():
    q, k, v = (torch.zeros(1, 2, 16, 16, dtype=torch.bfloat16) for _ in range(3))
    assert torch.equal(cudnn_attn.sdpa_fp8(q, k, v), torch.zeros_like(q))


def test_arguments_it_cannot_take_are_named():
    q, k, v = (randn(1, 2, 16, 16) for _ in range(3))
    with pytest.raises(UnsupportedError, match="attn_mask"):
        cudnn_attn.sdpa_fp8(q, k, v, attn_mask=torch.ones(16, 16, dtype=torch.bool))
    with pytest.raises(ValidationError, match=r"backward: 'fp8' needs scaling=cudnn_attn.Fp8Scaling\(\)"):
        cudnn_attn.sdpa_fp8(q, k, v, backward="fp8")
    with pytest.raises(ValidationError, match="backward: 'int8'"):
        cudnn_attn.sdpa_fp8(q, k, v, backward="int8")
    with pytest.raises(ValidationError, match="query: dtype float32"):
        cudnn_attn.sdpa_fp8(q.float(), k.float(), v.float())


# q's and k's shapes (v: k's with head dim 16), and what the error says: an empty tensor has
# no amax to scale by; the others are found by the graph, which names its own q, k, v.
BAD_SHAPES = {
    "empty": (((1, 4, 0, 16), (1, 1, 0, 16)), "query: shape \\[1, 4, 0, 16\\] has an empty dimension"),
    "head-dim": (((1, 2, 8, 32), (1, 2, 8, 48)), "key: head dim 48 differs from query's 32"),
    "heads": (((1, 2, 8, 16), (1, 3, 8, 16)), "key: 3 heads"),
}


@pytest.mark.parametrize("bad", BAD_SHAPES, ids=list(BAD_SHAPES))
def test_shapes_it_cannot_take_are_named_as_its_own_arguments(bad):
    (q_shape, k_shape), message = BAD_SHAPES[bad]
    q, k, v = randn(*q_shape), randn(*k_shape), randn(*k_shape[:3], 16)
    with pytest.raises(ValidationError, match=message):
        cudnn_attn.sdpa_fp8(q, k, v, enable_gqa=True)


def test_attention_module_with_fp8():
    torch.manual_seed(0)
    layer = cudnn_attn.nn.Attention(64, 4, num_kv_heads=2, causal=True, fp8=True, dtype=torch.bfloat16)
    plain = cudnn_attn.nn.Attention(64, 4, num_kv_heads=2, causal=True, dtype=torch.bfloat16)
    plain.load_state_dict(layer.state_dict())
    x = randn(2, 32, 64).requires_grad_()
    y = layer(x)
    assert "fp8=True" in repr(layer) and rel_err(y, plain(x)) < 0.065
    y.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    with pytest.raises(ValidationError, match="dropout"):
        cudnn_attn.nn.Attention(64, 4, fp8=True, dropout=0.1)


def test_casts_are_the_emulations_quantisation():
    from cudnn_attn.kernels import fp8_cast
    from cudnn_attn.ops.reference import fp8 as reference_fp8

    x = randn(4, 33, 16) * 50
    scale = torch.tensor(7.5).reshape(1, 1, 1, 1)
    fp8 = fp8_cast.to_fp8(x, scale)
    assert torch.equal(fp8.float(), reference_fp8.quantise(x.float(), scale, torch.float8_e4m3fn).float())
    assert fp8.float().abs().max() == 448  # saturated, not NaN


# FP8 producers and consumers: Fp8Tensor in, Fp8Tensor out, no casts around the kernel.


def test_fp8_inputs_give_what_the_16_bit_path_quantises():
    # The 16-bit path quantises each input under its current scale: the same Fp8Tensors give
    # the same O, bit for bit, in FP8 and dequantised.
    q, k, v = (randn(2, 4, 64, 32, generator=torch.Generator().manual_seed(60 + i)) for i in range(3))
    fp8 = [cudnn_attn.Fp8Tensor.quantise(x) for x in (q, k, v)]
    out = cudnn_attn.sdpa_fp8(*fp8, is_causal=True)
    assert isinstance(out, cudnn_attn.Fp8Tensor) and out.data.dtype == torch.float8_e4m3fn
    assert out.data.shape == q.shape and out.descale.shape == () and torch.equal(out.descale, fp8[2].descale)
    expected = cudnn_attn.sdpa_fp8(q, k, v, is_causal=True)
    assert torch.equal(out.dequantise(torch.bfloat16), expected)
    assert torch.equal(cudnn_attn.sdpa_fp8(*fp8, is_causal=True, out_dtype=torch.bfloat16), expected)
    assert rel_err(out.dequantise(), _float64(q, k, v, is_causal=True)) < 0.065


def test_fp8_output_from_16_bit_inputs():
    q, k, v = (
        randn(2, 4, 48, 32, dtype=torch.float16, generator=torch.Generator().manual_seed(70 + i)) for i in range(3)
    )
    out = cudnn_attn.sdpa_fp8(q, k, v, out_dtype=torch.float8_e4m3fn)
    assert isinstance(out, cudnn_attn.Fp8Tensor)
    assert torch.equal(out.dequantise(torch.float16), cudnn_attn.sdpa_fp8(q, k, v))
    # Its descale is V's: |O| <= max|V| never saturates E4M3.
    assert float(out.descale) == pytest.approx(float(v.abs().max()) / 448.0, rel=1e-6)
    assert out.data.float().abs().max() <= 448.0
    wide = cudnn_attn.sdpa_fp8(q, k, v, out_dtype=torch.float32)
    assert wide.dtype == torch.float32 and torch.equal(wide.half(), cudnn_attn.sdpa_fp8(q, k, v))


def test_fp8_inputs_unbatched_with_gqa():
    q, k, v = (
        randn(8, 32, 16, generator=torch.Generator().manual_seed(80)),
        randn(2, 32, 16, generator=torch.Generator().manual_seed(81)),
        randn(2, 32, 16, generator=torch.Generator().manual_seed(82)),
    )
    fp8 = [cudnn_attn.Fp8Tensor.quantise(x) for x in (q, k, v)]
    out = cudnn_attn.sdpa_fp8(*fp8, enable_gqa=True, out_dtype=torch.bfloat16)
    assert out.shape == q.shape and rel_err(out, _float64(q, k, v, enable_gqa=True)) < 0.065


def test_fp8_tensor_quantise_under_a_given_scale_and_zeros():
    x = randn(4, 64, generator=torch.Generator().manual_seed(90))
    t = cudnn_attn.Fp8Tensor.quantise(x, scale=torch.tensor(2.0))
    assert float(t.descale) == 0.5 and rel_err(t.dequantise(), x) < 0.04
    assert torch.equal(t.data.float(), (x.float() * 2).clamp(-448, 448).to(torch.float8_e4m3fn).float())
    zero = cudnn_attn.Fp8Tensor.quantise(torch.zeros(3, 5))
    assert float(zero.descale) == 1.0 and torch.equal(zero.dequantise(torch.float32), torch.zeros(3, 5))


def test_what_fp8_inputs_and_outputs_cannot_take_is_named():
    q, k, v = (randn(1, 2, 16, 16, generator=torch.Generator().manual_seed(100 + i)) for i in range(3))
    fp8 = [cudnn_attn.Fp8Tensor.quantise(x) for x in (q, k, v)]
    with pytest.raises(ValidationError, match="key: a bfloat16 tensor beside an Fp8Tensor"):
        cudnn_attn.sdpa_fp8(fp8[0], k, fp8[2])
    with pytest.raises(ValidationError, match="scaling: the inputs are Fp8Tensor"):
        cudnn_attn.sdpa_fp8(*fp8, scaling=cudnn_attn.Fp8Scaling())
    with pytest.raises(ValidationError, match="query.descale: float32 of shape \\[2\\]"):
        cudnn_attn.sdpa_fp8(cudnn_attn.Fp8Tensor(fp8[0].data, torch.ones(2)), *fp8[1:])
    with pytest.raises(ValidationError, match="value.data: bfloat16; expected a float8_e4m3fn tensor"):
        cudnn_attn.sdpa_fp8(*fp8[:2], cudnn_attn.Fp8Tensor(v, fp8[2].descale))
    with pytest.raises(ValidationError, match="out_dtype: torch.int8"):
        cudnn_attn.sdpa_fp8(*fp8, out_dtype=torch.int8)
    with pytest.raises(UnsupportedError, match="attn_mask"):
        cudnn_attn.sdpa_fp8(*fp8, attn_mask=torch.ones(16, 16, dtype=torch.bool))
    with pytest.raises(ValidationError, match="sdpa_fp8: key: 4 heads"):
        cudnn_attn.sdpa_fp8(fp8[0], cudnn_attn.Fp8Tensor.quantise(randn(1, 4, 16, 16)), fp8[2])
    with pytest.raises(ValidationError, match="out_dtype: float8_e4m3fn output carries no gradient"):
        cudnn_attn.sdpa_fp8(q.requires_grad_(), k, v, out_dtype=torch.float8_e4m3fn)
    with torch.no_grad():
        assert isinstance(cudnn_attn.sdpa_fp8(q, k, v, out_dtype=torch.float8_e4m3fn), cudnn_attn.Fp8Tensor)
