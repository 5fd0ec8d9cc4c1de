"""What torch's SDPA accepts every day, accepted and read as torch reads it (CPU, reference backend):
its CausalBias objects, autocast, float32 and float64, tensor subclasses; plus the frontend's
``tensor_like`` of a graph tensor."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import rel_err
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import cudnn_attn
from cudnn_attn.errors import ValidationError

F = torch.nn.functional.scaled_dot_product_attention


def _qkv(l, s, dtype=torch.bfloat16, heads=2, d=16, grad=False, seed=0):  # noqa: E741
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, l, d, generator=gen).to(dtype)
    k = torch.randn(1, heads, s, d, generator=gen).to(dtype)
    v = torch.randn(1, heads, s, d, generator=gen).to(dtype)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


# ---- CausalBias --------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [causal_lower_right, causal_upper_left], ids=["lower_right", "upper_left"])
@pytest.mark.parametrize("l,s", [(4, 9), (9, 9), (33, 80)])
def test_causal_bias_objects_mean_what_they_mean_to_torch(make, l, s):  # noqa: E741
    # Main at 7433bcf read the subclass's storage as an additive mask: rel. error 0.4-1.9, varying per run.
    q, k, v = _qkv(l, s)
    mask = make(l, s)
    expected = F(q.float(), k.float(), v.float(), attn_mask=mask)
    for _ in range(2):  # the first call prepares the signature, the second takes the eager fast path
        assert rel_err(cudnn_attn.sdpa(q, k, v, attn_mask=mask).float(), expected) < 2e-2


def test_a_lower_right_causal_bias_is_the_bottom_right_causal_mask_with_gradients():
    q, k, v = _qkv(5, 12, grad=True)
    ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out = cudnn_attn.sdpa(q, k, v, attn_mask=causal_lower_right(5, 12))
    expected = F(*ref, attn_mask=causal_lower_right(5, 12))
    d_out = torch.randn_like(expected)
    grads = torch.autograd.grad(out, (q, k, v), d_out.to(out.dtype))
    expected_grads = torch.autograd.grad(expected, ref, d_out)
    assert rel_err(out.float(), expected) < 2e-2
    for g, e in zip(grads, expected_grads):
        assert rel_err(g.float(), e) < 3e-2


def test_what_cudnn_bottom_right_mask_lacks_runs_on_torch_kernel_identically():
    # cuDNN's bottom-right mask takes no dropout and needs L <= S: torch's own kernel runs those
    # (its math kernel on the CPU), so the result is torch's to the bit (same generator state).
    q, k, v = _qkv(6, 10, dtype=torch.float32)
    for l, s, p in ((6, 10, 0.3), (10, 6, 0.0)):  # noqa: E741
        q, k, v = _qkv(l, s, dtype=torch.float32)
        mask = causal_lower_right(l, s)
        torch.manual_seed(7)
        ours = cudnn_attn.sdpa(q, k, v, attn_mask=mask, dropout_p=p)
        torch.manual_seed(7)
        with sdpa_kernel(SDPBackend.MATH):
            theirs = F(q, k, v, attn_mask=mask, dropout_p=p)
        assert torch.equal(ours.nan_to_num(), theirs.nan_to_num())


def test_causal_bias_misuse_is_refused_naming_the_argument():
    q, k, v = _qkv(4, 9)
    with pytest.raises(ValidationError, match="is_causal"):
        cudnn_attn.sdpa(q, k, v, attn_mask=causal_lower_right(4, 9), is_causal=True)
    with pytest.raises(ValidationError, match=r"attn_mask: CausalBias for L=4, S=8 but query and key have L=4, S=9"):
        cudnn_attn.sdpa(q, k, v, attn_mask=causal_lower_right(4, 8))


class _Scaled(torch.Tensor):
    """A tensor subclass whose values are not its storage (as with many wrapper subclasses)."""


def test_other_tensor_subclasses_are_refused_by_name_and_parameters_accepted():
    q, k, v = _qkv(4, 9)
    odd = torch.zeros(4, 9).as_subclass(_Scaled)
    with pytest.raises(ValidationError, match=r"attn_mask: a _Scaled \(a torch.Tensor subclass"):
        cudnn_attn.sdpa(q, k, v, attn_mask=odd)
    with pytest.raises(ValidationError, match=r"query: a _Scaled"):
        cudnn_attn.sdpa(q.as_subclass(_Scaled), k, v)
    bias = torch.nn.Parameter(torch.randn(4, 9, dtype=torch.bfloat16))
    expected = F(q.float(), k.float(), v.float(), attn_mask=bias.detach().float())
    assert rel_err(cudnn_attn.sdpa(q, k, v, attn_mask=bias).float(), expected) < 2e-2


# ---- autocast ----------------------------------------------------------------------------------


@pytest.mark.parametrize("given", [torch.float32, torch.float16])
def test_autocast_casts_inputs_to_its_dtype_as_torch_does(given):
    # Main at 7433bcf refused float32 under autocast ("query: dtype float32").
    q, k, v = _qkv(8, 8, dtype=given)
    mask = torch.randn(8, 8, dtype=given)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F(q, k, v, attn_mask=mask)
        for _ in range(2):
            out = cudnn_attn.sdpa(q, k, v, attn_mask=mask)
            assert out.dtype == expected.dtype == torch.bfloat16
            assert rel_err(out.float(), expected.float()) < 2e-2


def test_autocast_leaves_float64_alone_as_torch_does():
    q, k, v = _qkv(8, 8, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cudnn_attn.sdpa(q, k, v).dtype == F(q, k, v).dtype == torch.float64


# ---- float32 and float64 -----------------------------------------------------------------------


def test_float32_runs_and_differentiates_like_torch():
    # Main at 7433bcf refused it: "query: dtype float32".
    q, k, v = _qkv(24, 40, dtype=torch.float32, grad=True)
    out = cudnn_attn.sdpa(q, k, v, is_causal=True)
    expected = F(q, k, v, is_causal=True)
    assert out.dtype == torch.float32
    assert rel_err(out, expected) < 1e-5
    d_out = torch.randn_like(out)
    for g, e in zip(torch.autograd.grad(out, (q, k, v), d_out), torch.autograd.grad(expected, (q, k, v), d_out)):
        assert rel_err(g, e) < 1e-5


def test_float32_graph_runs_on_the_reference_backend():
    q, k, v = _qkv(16, 16, dtype=torch.float32)
    with cudnn_attn.Graph() as g:
        g.sdpa(q, k, v, use_causal_mask=True, generate_stats=True)
    o, stats = g(q, k, v)
    assert o.dtype == torch.float32 and stats.dtype == torch.float32
    assert rel_err(o, F(q, k, v, is_causal=True)) < 1e-5


def test_float64_runs_on_torch_kernel_and_says_so(caplog):
    q, k, v = _qkv(8, 8, dtype=torch.float64, grad=True)
    with caplog.at_level(logging.INFO, logger="cudnn_attn"):
        out = cudnn_attn.sdpa(q, k, v)
        cudnn_attn.sdpa(q, k, v)
    with sdpa_kernel(SDPBackend.MATH):
        assert torch.equal(out, F(q, k, v))
    said = [r.getMessage() for r in caplog.records if "float64" in r.getMessage()]
    assert len(said) <= 1  # once per reason, not per call
    assert torch.autograd.grad(out.sum(), q)[0].dtype == torch.float64


def test_float64_with_a_negative_scale_is_right():
    # torch 2.13's CPU flash kernel gives NaN here (found by the fuzz campaign): its math kernel runs.
    q, k, v = _qkv(8, 11, dtype=torch.float64)
    out = cudnn_attn.sdpa(q, k, v, is_causal=True, scale=-0.5)
    s = (q @ k.transpose(-1, -2)) * -0.5
    s = s.masked_fill(~torch.ones(8, 11, dtype=torch.bool).tril(), float("-inf"))
    assert rel_err(out, s.softmax(-1) @ v) < 1e-12


def test_mixed_dtypes_are_refused_naming_query():
    q, k, v = _qkv(8, 8, dtype=torch.float32)
    with pytest.raises(ValidationError, match="query: dtype float32 but key is bfloat16"):
        cudnn_attn.sdpa(q, k.bfloat16(), v.bfloat16())


def test_attention_layer_with_default_float32_parameters_trains():
    # Main at 7433bcf: "query: dtype float32" from a layer built with default arguments.
    torch.manual_seed(0)
    layer = cudnn_attn.nn.Attention(64, 4, num_kv_heads=2, causal=True)
    x = torch.randn(2, 10, 64)
    y = layer(x)
    y.square().mean().backward()
    assert y.dtype == torch.float32 and layer.qkv.weight.grad is not None


def test_attention_layer_errors_speak_of_its_own_arguments():
    layer = cudnn_attn.nn.Attention(64, 4)
    with pytest.raises(ValidationError) as caught:
        layer(torch.randn(2, 10, 64), attn_mask=torch.zeros(3, 3))
    assert str(caught.value).startswith("Attention: attn_mask: shape [3, 3]")
    assert not any(line.startswith(("query", "key", "value")) for line in caught.value.problems)


# ---- tensor_like -------------------------------------------------------------------------------


def test_tensor_like_takes_a_graph_tensor():
    # Main at 7433bcf: "template: TensorHandle; expected a torch tensor or a DLPack array".
    q, k, v = _qkv(8, 8)
    with cudnn_attn.Graph() as g:
        q_in = g.tensor_like(q, name="q")
        k_in = g.tensor_like(q_in, name="k")
        v_in = g.tensor_like(k_in, name="v")
        o, _ = g.sdpa(q_in, k_in, v_in)
        o.set_output(True)
    assert (k_in.get_dim(), k_in.get_stride(), k_in.get_data_type()) == (list(q.shape), list(q.stride()), q.dtype)
    out = g(q, k, v)  # a graph of one output returns it alone
    assert rel_err(out.float(), F(q.float(), k.float(), v.float())) < 2e-2


def test_tensor_like_of_an_output_needs_its_geometry():
    q, k, v = _qkv(8, 8)
    with cudnn_attn.Graph() as g:
        o, _ = g.sdpa(q, k, v)
        with pytest.raises(ValidationError, match="template: graph tensor 'O' has no geometry yet"):
            g.tensor_like(o)
        o.set_dim([1, 2, 8, 16]).set_data_type(cudnn_attn.data_type.BFLOAT16)
        like = g.tensor_like(o)
    assert like.get_dim() == [1, 2, 8, 16] and like.get_stride() == [256, 128, 16, 1]


# ---- float32 on cuDNN: what its composite path lacks, refused before it runs ----------------------


def test_float32_rules_refuse_what_cudnn_lacks_or_gets_wrong():
    from test_capabilities import backward, forward, reasons, spec

    def f32(p):
        return p.replace(**{r: spec(*getattr(p, r).shape, dtype=torch.float32) for r in ("q", "k", "v", "o")})

    assert reasons(f32(forward())) == ""
    assert reasons(f32(forward(h_kv=2, s_q=128))) == ""
    assert "no float32 backward" in reasons(
        backward().replace(
            **{
                r: spec(*getattr(backward(), r).shape, dtype=torch.float32)
                for r in ("q", "k", "v", "o", "grad_o", "grad_q", "grad_k", "grad_v")
            }
        )
    )
    assert "head_dim d_v=256 in float32" in reasons(f32(forward(d=256)))
    assert "decode" in reasons(f32(forward(h_kv=2, s_q=1)))
    assert "dropout in float32" in reasons(f32(forward(dropout_p=0.1)))


def test_info_says_where_sdpa_runs_each_kind_of_call():
    from cudnn_attn.cli import info
    from cudnn_attn.ops.torch import reasons as torch_kernel

    on_gpu = torch_kernel.choices(on_gpu=True)
    assert on_gpu["float16/bfloat16"] == "cuDNN"
    assert on_gpu["float32"].startswith("torch's kernel (torch's float32 kernel measured")
    assert on_gpu["float32 with gradients"] == "torch's kernel (cuDNN has no float32 backward)"
    assert torch_kernel.choices(on_gpu=False)["float32"].startswith("torch's kernel (torch's CPU kernel computes")
    report = info.collect()
    assert report["sdpa_runs"]["float64"].startswith("torch's kernel")
    assert "cudnn_attn.sdpa runs:" in info.as_text(report)
