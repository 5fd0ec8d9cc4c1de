"""The torch-style forms: ``cudnn_attn.sdpa`` against torch's own, and the ``Attention`` module."""

from __future__ import annotations

import oracle
import pytest
import torch
from conftest import randn, rel_err

import cudnn_attn
from cudnn_attn.nn import Attention
from cudnn_attn.ops.reference import dropout
from cudnn_attn.runtime import prepared

TOL = 8e-3  # bf16 outputs


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _torch_sdpa(q, k, v, **kw):
    return torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"is_causal": True},
        {"scale": 0.3},
        {"enable_gqa": True},
        {"mask": "bool"},
        {"mask": "float"},
        {"mask": "2d"},
    ],
    ids=["plain", "causal", "scale", "gqa", "bool-mask", "float-mask", "2d-mask"],
)
def test_sdpa_matches_torch_forward_and_backward(kw):
    kw = dict(kw)
    gen = torch.Generator().manual_seed(0)
    h_kv = 2 if kw.get("enable_gqa") else 4
    q = randn(2, 4, 24, 32, generator=gen)
    k, v = randn(2, h_kv, 32, 32, generator=gen), randn(2, h_kv, 32, 32, generator=gen)
    mask = kw.pop("mask", None)
    if mask == "bool":
        kw["attn_mask"] = torch.rand(2, 1, 24, 32, generator=gen) > 0.3
    elif mask == "float":
        kw["attn_mask"] = randn(1, 4, 24, 32, generator=gen)
    elif mask == "2d":
        kw["attn_mask"] = randn(24, 32, generator=gen)
    ours, theirs = _leaves(q, k, v), _leaves(q, k, v)
    out = cudnn_attn.sdpa(*ours, **kw)
    theirs64 = [t.double().detach().requires_grad_() for t in theirs]
    mask64 = (
        {"attn_mask": kw["attn_mask"].double() if kw["attn_mask"].dtype != torch.bool else kw["attn_mask"]}
        if "attn_mask" in kw
        else {}
    )
    ref = torch.nn.functional.scaled_dot_product_attention(*theirs64, **{**kw, **mask64})
    assert rel_err(out, ref) < TOL
    d_o = randn(*out.shape, generator=gen)
    out.backward(d_o)
    ref.backward(d_o.double())
    for a, b in zip(ours, theirs64):
        assert rel_err(a.grad, b.grad) < 2 * TOL


def test_sdpa_without_grad_generates_no_stats_and_caches_graphs():
    q = randn(1, 2, 16, 32)
    cudnn_attn.functional._clear_graphs()
    # The graph path on the CPU is the reference backend's (plain "auto" calls run on torch's kernel).
    with torch.no_grad(), cudnn_attn.backend("reference"):
        a = cudnn_attn.sdpa(q, q, q)
        b = cudnn_attn.sdpa(q.clone(), q.clone(), q.clone())  # other aliasing, the same problem: one run
    assert torch.allclose(a, b) and len(prepared.held()) == 1
    assert not prepared.held()[0].problem.generates_stats


def test_sdpa_three_dim_inputs_and_errors():
    q = randn(4, 16, 32)
    assert rel_err(cudnn_attn.sdpa(q, q, q), _torch_sdpa(q, q, q)) < TOL
    with pytest.raises(cudnn_attn.ValidationError, match="enable_gqa"):
        cudnn_attn.sdpa(randn(1, 4, 8, 32), randn(1, 2, 8, 32), randn(1, 2, 8, 32))
    # torch 2.13 applies is_causal and attn_mask together (issue 42): so does the drop-in.
    mask = torch.rand(16, 16, generator=torch.Generator().manual_seed(0)) > 0.3
    both = cudnn_attn.sdpa(q, q, q, attn_mask=mask, is_causal=True)
    assert rel_err(both, _torch_sdpa(q, q, q, attn_mask=mask & torch.ones(16, 16, dtype=torch.bool).tril())) < TOL


def test_sdpa_dropout_follows_torch_manual_seed_and_backward_reuses_the_mask():
    q, k, v = (randn(1, 2, 16, 32) for _ in range(3))
    torch.manual_seed(1)
    a = cudnn_attn.sdpa(q, k, v, dropout_p=0.3)
    torch.manual_seed(1)
    b = cudnn_attn.sdpa(q, k, v, dropout_p=0.3)
    c = cudnn_attn.sdpa(q, k, v, dropout_p=0.3)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # The backward uses the forward's mask: rebuild that mask from the same seed and compare
    # every gradient with autograd through the independent oracle. The library's own dropout
    # runs on its graphs: on the CPU, the reference backend's (plain "auto" calls run on torch's kernel).
    leaves = _leaves(q, k, v)
    torch.manual_seed(2)
    with cudnn_attn.backend("reference"):
        out = cudnn_attn.sdpa(*leaves, dropout_p=0.3)
    torch.manual_seed(2)
    seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64))
    keep = dropout.keep_mask(seed, 0, (1, 2, 16, 16), 0.3, "cpu")
    d_o = randn(*out.shape)
    out.backward(d_o)
    expected_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = oracle.attention_autograd(*expected_leaves, scale=32**-0.5, keep=keep, p=0.3)
    expected.backward(d_o.double())
    assert rel_err(out, expected) < TOL
    for actual, reference in zip(leaves, expected_leaves):
        assert rel_err(actual.grad, reference.grad) < 2 * TOL


def test_attention_module_matches_plain_torch_and_trains():
    torch.manual_seed(0)
    module = Attention(64, 4, num_kv_heads=2, causal=True, dtype=torch.bfloat16)
    x = randn(2, 16, 64)
    y = module(x)
    b, s, _ = x.shape
    qkv = module.qkv(x).view(b, s, 8, 16)
    q, k, v = (t.transpose(1, 2) for t in qkv.split([4, 2, 2], dim=2))
    o = _torch_sdpa(q, k, v, is_causal=True, enable_gqa=True).to(torch.bfloat16)
    expected = module.out(o.transpose(1, 2).reshape(b, s, 64))
    assert rel_err(y, expected) < 2 * TOL
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    target = randn(2, 16, 64)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = (module(x).float() - target.float()).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_attention_module_with_sinks_window_and_softcap_matches_plain_torch():
    """gpt-oss's and Gemma-2's layer terms in the module: learned sinks (a parameter with
    gradients), a causal window of ``window`` tokens, soft-capping; against a float64 oracle."""
    torch.manual_seed(1)
    module = Attention(64, 4, num_kv_heads=2, causal=True, sinks=True, window=5, softcap=2.0)
    with torch.no_grad():
        module.sinks.normal_()
    x = torch.randn(2, 12, 64)
    y = module(x)
    b, s, _ = x.shape
    q, k, v = (t.transpose(1, 2).double() for t in module.qkv(x).view(b, s, 8, 16).split([4, 2, 2], dim=2))
    k, v = (t.repeat_interleave(2, 1) for t in (k, v))
    scores = 2.0 * torch.tanh(q @ k.transpose(-1, -2) * 16**-0.5 / 2.0)
    rows, cols = torch.arange(s)[:, None], torch.arange(s)[None, :]
    scores = scores.masked_fill((cols > rows) | (cols <= rows - 5), float("-inf"))
    sink = module.sinks.double().view(1, 4, 1, 1).expand(b, 4, s, 1)
    o = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1] @ v
    expected = module.out(o.float().transpose(1, 2).reshape(b, s, 64))
    assert rel_err(y, expected) < 1e-5
    y.sum().backward()
    assert module.sinks.grad is not None and module.sinks.grad.abs().sum() > 0
    assert "sinks=True, window=5, softcap=2.0" in repr(module)
    for bad, match in (
        (dict(window=4), "window: a sliding window needs causal=True"),
        (dict(causal=True, window=0), "window: 0"),
        (dict(causal=True, fp8=True, sinks=True), "fp8: True with sinks"),
    ):
        with pytest.raises(cudnn_attn.ValidationError, match=match):
            Attention(64, 4, **bad)


def test_a_mask_replaces_a_windowed_layers_causal_mask_as_the_documented_torch_equivalent():
    """A window layer given attn_mask stayed causal (its window's right bound of 0): a
    bidirectional block came out causal, 0.73 away from the layer's documented torch form."""
    torch.manual_seed(2)
    module = Attention(32, 4, causal=True, window=3)
    x = torch.randn(2, 6, 32)
    mask = torch.ones(6, 6, dtype=torch.bool)
    b, s, _ = x.shape
    q, k, v = (t.transpose(1, 2) for t in module.qkv(x).view(b, s, 12, 8).split([4, 4, 4], dim=2))
    o = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), mask)
    expected = module.out(o.float().transpose(1, 2).reshape(b, s, 32))
    assert rel_err(module(x, attn_mask=mask), expected) < 1e-5
    rows, cols = torch.arange(s)[:, None], torch.arange(s)[None, :]
    band = (cols <= rows) & (cols > rows - 3)  # without a mask: causal, 3 tokens
    o = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), band)
    assert rel_err(module(x), module.out(o.float().transpose(1, 2).reshape(b, s, 32))) < 1e-5


def test_an_fp8_attention_module_names_what_it_cannot_attend_from_in_its_own_terms():
    """These were sdpa_fp8's errors about query/key/value (the layer's x), on every forward of a
    float32 layer that construction had let through."""
    with pytest.raises(cudnn_attn.ValidationError, match="Attention: dtype: torch.float32; fp8=True attends"):
        Attention(64, 4, causal=True, fp8=True, dtype=torch.float32)
    layer = Attention(64, 4, causal=True, fp8=True)  # float32 parameters, to be cast later
    with pytest.raises(cudnn_attn.ValidationError, match="Attention: x: dtype float32; fp8=True attends"):
        layer(torch.randn(2, 16, 64))
    layer = layer.to(torch.bfloat16)
    mask = torch.ones(16, 16, dtype=torch.bool)
    with pytest.raises(cudnn_attn.UnsupportedError, match="Attention: attn_mask: fp8=True attention takes no mask"):
        layer(torch.randn(2, 16, 64, dtype=torch.bfloat16), attn_mask=mask)


def test_attention_module_rejects_bad_head_counts():
    with pytest.raises(cudnn_attn.ValidationError, match="num_kv_heads"):
        Attention(64, 4, num_kv_heads=3)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(causal="false"), "causal: 'false'; expected True or False"),  # a string was truthy: causal
        (dict(bias="no"), "bias: 'no'"),
        (dict(dtype=torch.int32), "dtype: torch.int32; expected a floating torch dtype"),
        (dict(dtype="float16"), "dtype: 'float16'"),
        (dict(device="nonsense"), "device: 'nonsense'; not a torch device"),
    ],
    ids=["causal", "bias", "int-dtype", "string-dtype", "device"],
)
def test_attention_module_names_bad_flags_dtypes_and_devices(kw, message):
    with pytest.raises(cudnn_attn.ValidationError, match=message):
        Attention(16, 4, **kw)


def test_attention_call_names_an_is_causal_that_is_not_a_flag():
    layer = Attention(16, 4)
    with pytest.raises(cudnn_attn.ValidationError, match="is_causal: 'no'"):
        layer(torch.randn(1, 5, 16), is_causal="no")


def test_sdpa_compiles_as_one_op_without_graph_breaks():
    torch.manual_seed(0)
    module = Attention(64, 4, causal=True, dtype=torch.bfloat16)
    x = randn(2, 16, 64)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)  # fullgraph: a break would raise
    y = compiled(x)
    assert rel_err(y, module(x)) < 1e-6
    y.float().sum().backward()
    assert module.qkv.weight.grad is not None
