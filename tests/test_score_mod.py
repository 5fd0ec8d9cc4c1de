"""Score modifiers (the frontend's ``score_mod`` / ``score_mod_bprop``) and ``softcap=`` on the
reference backend, against float64 oracles; what is refused, and how plans are keyed."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from score_mod_cases import run_forward, run_softcap_training, softcap_torch_oracle

import cudnn_attn as cudnn
from cudnn_attn.core import score_mod
from cudnn_attn.core.constructors import forward_problem
from cudnn_attn.core.mask import Causal, ScoreOptions
from cudnn_attn.core.problem import TensorSpec

TOL = 2e-3  # fp16 inputs and outputs


@pytest.mark.parametrize("kind", ["softcap", "causal", "softcap_causal", "arrow", "document", "padding", "per_head"])
def test_frontend_style_modifiers_match_the_oracle(kind):
    out, expected = run_forward(kind, "cpu")
    assert rel_err(out, expected) < TOL


def test_softcap_forward_and_backward_with_the_frontends_bprop():
    ours, expected = run_softcap_training("cpu")
    for name, a, e in zip(("O", "dQ", "dK", "dV"), ours, expected):
        assert rel_err(a, e) < TOL, name


TERMS = {  # (cap, causal, sinks, window's left bound)
    "softcap": (3.0, False, False, None),
    "softcap-causal": (3.0, True, False, None),
    "softcap-sinks": (3.0, False, True, None),
    "softcap-causal-sinks": (3.0, True, True, None),
    "window": (None, True, False, 5),  # FlashAttention's window_size=(5, 0): gpt-oss's, Mistral's
    "window-sinks": (None, True, True, 5),
    "window-sinks-softcap": (3.0, True, True, 5),
}


@pytest.mark.parametrize("terms", TERMS, ids=list(TERMS))
def test_torch_form_score_terms_match_the_oracle(terms):
    """``sdpa(softcap=, sinks=, window_size=)`` alone and together, forward and backward, GQA."""
    cap, causal, with_sinks, left = TERMS[terms]
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 20, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 20, 16, generator=g, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, generator=g, requires_grad=True) if with_sinks else None
    window = (left, 0) if left is not None else (-1, -1)
    out = cudnn.sdpa(q, k, v, is_causal=causal, enable_gqa=True, softcap=cap, sinks=sinks, window_size=window)
    expected, leaves = softcap_torch_oracle(q, k, v, cap, causal, sinks, left=left)
    assert rel_err(out, expected) < 1e-5
    d_out = torch.randn(out.shape, generator=g)
    out.backward(d_out)
    expected.backward(d_out.double())
    for name, ours, leaf in zip("qkvs", (q, k, v, sinks), leaves):
        assert rel_err(ours.grad, leaf.grad) < 1e-5, name


def test_bad_windows_are_refused_by_name():
    q = torch.randn(1, 2, 8, 16)
    for window, match in (
        ((5,), "expected .left, right."),
        ((-2, 0, 1), "expected .left, right."),
        ((4, 2), "right bound 2 with a causal mask"),
    ):
        with pytest.raises(cudnn.ValidationError, match=match):
            cudnn.sdpa(q, q, q, is_causal=True, window_size=window)


def test_torch_form_softcap_is_not_a_no_op():
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) * 4 for _ in range(3))
    assert rel_err(cudnn.sdpa(q, k, v, softcap=1.0), cudnn.sdpa(q, k, v)) > 1e-2


def test_bad_softcap_and_modifiers_are_refused_by_name():
    q = torch.randn(1, 2, 8, 16)
    for cap in (0.0, -1.0, float("inf"), True, "30"):
        with pytest.raises(cudnn.ValidationError, match="softcap"):
            cudnn.sdpa(q, q, q, softcap=cap)

    def build(**mask):
        with cudnn.Graph() as g:
            g.sdpa(q=q, k=q, v=q, **mask)
        return g

    with pytest.raises(cudnn.ValidationError, match="score_mod: int; expected a callable"):
        build(score_mod=3)
    with pytest.raises(cudnn.UnsupportedError, match="graph.matmul: not an op a score modifier may use"):
        build(score_mod=lambda g, s: g.matmul(s, s))
    with pytest.raises(cudnn.ValidationError, match="score_mod: returned NoneType"):
        build(score_mod=lambda g, s: None)
    with pytest.raises(cudnn.ValidationError, match="score_mod_bprop: not a keyword of sdpa"):
        build(score_mod=lambda g, s: s, score_mod_bprop=lambda g, d: d)
    with pytest.raises(cudnn.ValidationError, match="tanh: missing input"):
        build(score_mod=lambda g, s: g.tanh())
    wide = torch.zeros(1, 1, 8, 9)
    with pytest.raises(cudnn.ValidationError, match="score_mod input 0"):
        build(score_mod=lambda g, s: g.add(a=s, b=wide))


def test_a_bprop_must_read_its_gradient():
    q = torch.randn(1, 2, 8, 16)
    o, lse = cudnn.sdpa(q, q, q), torch.zeros(1, 2, 8, 1)
    with pytest.raises(cudnn.ValidationError, match="does not read its gradient"):
        with cudnn.Graph() as g:
            g.sdpa_backward(
                q,
                q,
                q,
                o,
                o,
                lse,
                score_mod=lambda gr, s: s,
                score_mod_bprop=lambda gr, d: gr.neg(input=gr.exp(input=gr.tensor_scalar(1.0))),
            )


def test_plans_are_keyed_by_the_modifier():
    spec = TensorSpec.contiguous((1, 2, 8, 16), torch.float16, "cuda:0")
    problems = [
        forward_problem(spec, spec, spec, ScoreOptions(attn_scale=0.25), score_mod=score_mod.softcap(cap))
        for cap in (30.0, 30.0, 50.0)
    ]
    assert problems[0] == problems[1] and hash(problems[0]) == hash(problems[1])
    assert problems[0] != problems[2]
    assert "softcap30" in problems[0].describe()


def test_cudnn_refuses_its_own_masks_beside_a_modifier():
    from cudnn_attn.ops.cudnn.capabilities import Platform, unsupported_reasons

    spec = TensorSpec.contiguous((1, 2, 64, 64), torch.float16, "cuda:0")
    causal = forward_problem(
        spec, spec, spec, ScoreOptions(attn_scale=0.125, causal=Causal.TOP_LEFT), score_mod=score_mod.softcap(30.0)
    )
    hopper = Platform("NVIDIA H100", (9, 0), 91900, "1.32.0")
    assert any("write the mask inside score_mod" in r for r in unsupported_reasons(causal, hopper))
    plain = forward_problem(spec, spec, spec, ScoreOptions(attn_scale=0.125), score_mod=score_mod.softcap(30.0))
    assert not unsupported_reasons(plain, hopper)
    old = Platform("NVIDIA A100", (8, 0), 90500, "1.32.0")
    assert any("cuDNN >= 9.6" in r for r in unsupported_reasons(plain, old))


def test_lowered_modifier_graphs_validate_in_the_frontend():
    pytest.importorskip("cudnn")
    from cudnn_attn.ops.cudnn.lowering import lower

    spec = TensorSpec.contiguous((2, 4, 128, 64), torch.bfloat16, "cuda:0")
    mod = score_mod.softcap(30.0, score_mod.band_mask(causal=True, window=32, offset=0))
    p = forward_problem(spec, spec, spec, ScoreOptions(attn_scale=0.125), stats=True, score_mod=mod)
    graph = lower(p).graph
    graph.validate()
    graph.build_operation_graph()


@pytest.mark.parametrize("left, with_sinks", [(None, False), (3, True)], ids=["causal", "window-sinks"])
def test_varlen_softcap_matches_each_sequence_alone(left, with_sinks):
    """Gemma-2's padded batches without a dense mask: ``varlen_sdpa(softcap=)``, the causal mask
    (and window) inside the modifier, per sequence, forward and backward."""
    g = torch.Generator().manual_seed(8)
    lengths = [5, 12, 1, 9]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = sum(lengths)
    q = torch.randn(total, 4, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(total, 2, 16, generator=g, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, generator=g, requires_grad=True) if with_sinks else None
    window = (left, 0) if left is not None else (-1, -1)
    out = cudnn.varlen_sdpa(
        q,
        k,
        v,
        cu,
        cu,
        max(lengths),
        max(lengths),
        is_causal=True,
        enable_gqa=True,
        window_size=window,
        sinks=sinks,
        softcap=3.0,
    )
    d_out = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, [q, k, v] + ([sinks] if with_sinks else []), d_out)
    for i in range(len(lengths)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        per = [t[rows].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        expected, leaves = softcap_torch_oracle(*per, 3.0, True, sinks, left=left)
        assert rel_err(out[rows], expected[0].transpose(0, 1)) < 1e-5, i
        want = torch.autograd.grad(expected, leaves[:3], d_out[rows].transpose(0, 1).unsqueeze(0).double())
        for name, a, e in zip("qkv", grads, want):
            assert rel_err(a[rows], e[0].transpose(0, 1)) < 1e-5, (i, name)
    # Equal lengths: each sequence's bottom-right diagonal (read per sequence) is its top-left one.
    bottom_right = cudnn.varlen.varlen_attention(
        q, k, v, cu, cu, 12, 12, causal="bottom_right", enable_gqa=True, softcap=3.0
    )
    top_left = cudnn.varlen.varlen_attention(q, k, v, cu, cu, 12, 12, causal="top_left", enable_gqa=True, softcap=3.0)
    assert rel_err(bottom_right, top_left) < 1e-6


def test_dropout_with_sinks_softcap_and_a_window_matches_the_oracle():
    """Training with attention dropout through the score-terms path: a fresh seed per call from
    torch's generator (``torch.manual_seed`` repeats it), the backward reusing the forward's
    mask; against the float64 oracle with that mask rebuilt."""
    from cudnn_attn.ops.reference import dropout

    g = torch.Generator().manual_seed(12)
    q = torch.randn(1, 4, 16, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, 16, 16, generator=g, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, generator=g, requires_grad=True)
    options = dict(enable_gqa=True, is_causal=True, softcap=3.0, window_size=(5, 0), dropout_p=0.3)
    torch.manual_seed(3)
    out = cudnn.sdpa(q, k, v, sinks=sinks, **options)
    torch.manual_seed(3)
    again = cudnn.sdpa(q, k, v, sinks=sinks, **options)
    assert torch.equal(out, again) and not torch.equal(out, cudnn.sdpa(q, k, v, sinks=sinks, **options))
    torch.manual_seed(3)
    seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64))
    keep = dropout.keep_mask(seed, 0, (1, 4, 16, 16), 0.3, "cpu")
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    kk, vv = (t.repeat_interleave(2, 1) for t in leaves[1:3])
    s = 3.0 * torch.tanh(leaves[0] @ kk.transpose(-1, -2) * 16**-0.5 / 3.0)
    rows, cols = torch.arange(16)[:, None], torch.arange(16)[None, :]
    s = s.masked_fill((cols > rows) | (cols < rows - 5), float("-inf"))
    p = torch.softmax(torch.cat([s, leaves[3].view(1, 4, 1, 1).expand(1, 4, 16, 1)], -1), -1)[..., :-1]
    expected = (p * keep / 0.7) @ vv
    assert rel_err(out, expected) < 1e-5
    d_out = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v, sinks), d_out)
    want = torch.autograd.grad(expected, leaves, d_out.double())
    for name, a, e in zip("qkvs", grads, want):
        assert rel_err(a, e) < 1e-5, name


def test_the_frontend_hands_callbacks_the_lowering_function_they_key_on():
    """The score modifier's callbacks keep their built nodes per lowering, keyed by the
    function the frontend's callback shim carries (and release the C++ graph through it): a
    frontend whose shim no longer carries it would fall back to one shared table."""
    from cudnn._pygraph import _CallbackGraphShim

    from cudnn_attn.ops.cudnn import frontend_internals

    def lower(tensor):
        return tensor

    assert frontend_internals.callback_lowering(_CallbackGraphShim(object(), lower)) is lower
    assert frontend_internals.callback_lowering(object()) is None
