"""Score modifiers and ``softcap=`` on cuDNN: the frontend's own modifiers (soft-capping, causal,
arrow and document masks, padding by lengths) against float64 oracles; the torch form against
the reference backend on the same GPU inputs; Gemma-2 through the registration against eager."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import TOLERANCE, rel_err
from score_mod_cases import run_forward, run_softcap_training

import cudnn_attn

pytestmark = pytest.mark.gpu
FP16 = TOLERANCE[torch.float16] * 2  # fp16 outputs against a float64 oracle
BF16 = TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("kind", ["softcap", "causal", "softcap_causal", "arrow", "document", "per_head"])
def test_frontend_style_modifiers_run_on_cudnn(kind):
    out, expected = run_forward(kind, "cuda", s=256, d=128)
    assert torch.isfinite(out).all()
    assert rel_err(out, expected) < FP16


def test_per_batch_modifier_tensors_are_refused_on_cudnn():
    """cuDNN 9.19 gave wrong keys for a [B, 1, 1, 1] lengths tensor inside score_mod (H100; through
    the bare frontend too, which the frontend's own test_sdpa_with_flexible_graph does not check):
    refused by name; the reference backend runs it (tests/test_score_mod.py). Per-head tensors
    are read right (the per_head case above)."""
    with pytest.raises(cudnn_attn.UnsupportedError, match="vary by batch"):
        run_forward("padding", "cuda", s=256, d=128)


def test_softcap_forward_and_backward_on_cudnn():
    ours, expected = run_softcap_training("cuda", s=256, d=128)
    for name, a, e in zip(("O", "dQ", "dK", "dV"), ours, expected):
        assert rel_err(a, e) < (FP16 if name == "O" else 3e-2), name


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_torch_form_softcap_matches_the_reference_backend(causal, with_sinks):
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 8, 384, 64, generator=g)
    k, v = (torch.randn(2, 2, 384, 64, generator=g) for _ in range(2))
    sinks = torch.randn(8, generator=g) if with_sinks else None
    d_out = torch.randn(2, 8, 384, 64, generator=g)
    results = []
    for device, dtype in (("cuda", torch.bfloat16), ("cpu", torch.float32)):
        leaves = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
        sink = sinks.to(device).requires_grad_() if sinks is not None else None
        out = cudnn_attn.sdpa(*leaves, is_causal=causal, enable_gqa=True, softcap=20.0, sinks=sink)
        out.backward(d_out.to(device, dtype))
        results.append((out, *(t.grad for t in leaves), *([sink.grad] if sink is not None else [])))
    for name, a, e in zip(("O", "dQ", "dK", "dV", "dSink"), *results):
        assert rel_err(a.float().cpu(), e) < (BF16 if name == "O" else 3e-2), name


@pytest.mark.parametrize("padding", ["none", "left"])
def test_gemma2_through_the_registration_matches_eager(padding):
    from test_transformers_integration import batch, gemma2_models

    ref, ours = gemma2_models(4, "cuda")
    ref, ours = ref.to(torch.bfloat16), ours.to(torch.bfloat16)
    ids, mask = batch(padding, "cuda")
    real = mask.bool()
    with torch.no_grad():
        expected, actual = ref(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    assert rel_err(actual[real], expected[real]) < BF16


@pytest.mark.parametrize("window", [None, 63], ids=["causal", "window"])
def test_varlen_softcap_matches_the_reference_backend(window):
    """Packed sequences with soft-capping on cuDNN (a score modifier over ragged THD tensors, the
    causal mask and window inside it), forward and backward, against the reference on CPU."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    lengths = [100, 257, 1, 190]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total = sum(lengths)
    q = torch.randn(total, 8, 64, device="cuda", generator=gen).bfloat16().requires_grad_()
    k, v = (torch.randn(total, 2, 64, device="cuda", generator=gen).bfloat16().requires_grad_() for _ in range(2))
    options = dict(
        is_causal=True, enable_gqa=True, softcap=20.0, window_size=(window, 0) if window is not None else (-1, -1)
    )
    out = cudnn_attn.varlen_sdpa(q, k, v, cu, cu, 257, 257, **options)
    d_out = torch.randn(out.shape, device="cuda", generator=gen).bfloat16()
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    cpu = [t.detach().cpu().float().requires_grad_() for t in (q, k, v)]
    ref = cudnn_attn.varlen_sdpa(*cpu, cu.cpu(), cu.cpu(), 257, 257, **options)
    expected = torch.autograd.grad(ref, cpu, d_out.cpu().float())
    assert rel_err(out.float().cpu(), ref) < BF16
    for name, a, e in zip(("dQ", "dK", "dV"), grads, expected):
        assert rel_err(a.float().cpu(), e) < 3e-2, name


@pytest.mark.parametrize("terms", ["sinks", "softcap", "window"])
def test_dropout_with_score_terms_matches_the_reference_given_cudnns_mask(terms):
    """Attention dropout beside sinks, soft-capping or a window on cuDNN, forward and backward,
    against the reference backend fed cuDNN's own dropout mask (the reference's RNG is its own)."""
    from cudnn_attn.core.constructors import backward_problem, forward_problem
    from cudnn_attn.core.mask import Causal, ScoreOptions
    from cudnn_attn.core.problem import TensorSpec
    from cudnn_attn.core.softcap import softcap_modifier
    from cudnn_attn.ops import get_backend

    b, h, h_kv, s, d, p = 2, 8, 2, 256, 64, 0.2
    gen = torch.Generator(device="cuda").manual_seed(13)
    q = torch.randn(b, h, s, d, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(b, h_kv, s, d, device="cuda", generator=gen).bfloat16() for _ in range(2))
    d_o = torch.randn(b, h, s, d, device="cuda", generator=gen).bfloat16()
    options = ScoreOptions(
        attn_scale=d**-0.5, causal=Causal.TOP_LEFT, dropout_p=p, sliding_window=64 if terms == "window" else None
    )
    extra: dict = {}
    inputs: dict = {"q": q, "k": k, "v": v, "dropout_seed": 1234, "dropout_offset": 7}
    if terms == "softcap":
        extra["score_mod"], options = softcap_modifier(20.0, options, s, s)
    if terms == "sinks":
        inputs["sink_token"] = torch.randn(1, h, 1, 1, device="cuda", generator=gen)
        extra["sink_token"] = TensorSpec.of(inputs["sink_token"])
    spec = TensorSpec.of
    problem = forward_problem(spec(q), spec(k), spec(v), options, stats=True, **extra)
    rng_dump = torch.full((b, h, s, s), float("nan"), device="cuda")
    o, stats = torch.full_like(q, float("nan")), torch.full((b, h, s, 1), float("nan"), device="cuda")
    get_backend("cudnn").build(problem, rng_dump=True)(inputs, {"o": o, "stats": stats}, rng_dump=rng_dump)
    torch.cuda.synchronize()
    keep = rng_dump.bool()
    rows, cols = torch.arange(s, device="cuda")[:, None], torch.arange(s, device="cuda")[None, :]
    visible = (cols <= rows) & ((cols > rows - 64) if terms == "window" else True)  # tiles cuDNN skips: never dumped
    assert abs(keep[..., visible].float().mean().item() - (1 - p)) < 0.02
    o_ref, s_ref = torch.empty_like(o), torch.empty_like(stats)
    get_backend("reference").build(problem)(inputs, {"o": o_ref, "stats": s_ref}, dropout_keep=keep)
    assert rel_err(o, o_ref) < BF16
    back = backward_problem(spec(q), spec(k), spec(v), spec(o_ref), spec(d_o), spec(s_ref), options, **extra)
    back_inputs = {**inputs, "o": o_ref, "grad_o": d_o, "stats": s_ref}
    got = {role: torch.full_like(t, float("nan")) for role, t in (("grad_q", q), ("grad_k", k), ("grad_v", v))}
    want = {role: torch.empty_like(t) for role, t in got.items()}
    if terms == "sinks":  # run without cuDNN's sink (whose dSink came back scaled by 1 - p), dSink derived
        got["grad_sink"] = torch.full_like(inputs["sink_token"], float("nan"))
        want["grad_sink"] = torch.empty_like(inputs["sink_token"])
    get_backend("cudnn").build(back)(back_inputs, got)
    get_backend("reference").build(back)(back_inputs, want, dropout_keep=keep)
    for role in got:
        assert rel_err(got[role], want[role]) < 3e-2, role


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("compiled", [False, True])
def test_causal_softcap_split_matches_the_reference_backend(layout, compiled, monkeypatch):
    from cudnn_attn.core.mask import Causal, ScoreOptions
    from cudnn_attn.functional import softcap_split

    monkeypatch.setattr(softcap_split, "MIN_WORK", 0)  # split this small shape too

    s = 4 * softcap_split.MIN_BLOCK  # two levels: two rectangles and a diagonal of four blocks
    g = torch.Generator().manual_seed(21)
    shapes = ((2, 8, s, 64), (2, 2, s, 64), (2, 2, s, 64), (2, 8, s, 64))
    q, k, v, d_out = (torch.randn(*shape, generator=g) * (2 if i < 2 else 1) for i, shape in enumerate(shapes))

    def laid_out(t):
        return t.transpose(1, 2).contiguous().transpose(1, 2) if layout == "bshd" else t.contiguous()

    def call(*tensors):
        return cudnn_attn.sdpa(*tensors, is_causal=True, enable_gqa=True, softcap=30.0)

    results = []
    for device, dtype in (("cuda", torch.bfloat16), ("cpu", torch.float32)):
        leaves = [laid_out(t.to(device, dtype)).requires_grad_() for t in (q, k, v)]
        if device == "cuda":
            options = ScoreOptions(attn_scale=64**-0.5, causal=Causal.TOP_LEFT)
            assert softcap_split.causal_split(30.0, options, *leaves[:2], None, None) is not None
        run = torch.compile(call, fullgraph=True) if compiled and device == "cuda" else call
        out = run(*leaves)
        out.backward(d_out.to(device, dtype))
        results.append((out, *(t.grad for t in leaves)))
    for name, a, e in zip(("O", "dQ", "dK", "dV"), *results):
        assert rel_err(a.float().cpu(), e) < (BF16 if name == "O" else 3e-2), name


_SOFTCAP_AND_EXIT = """
import gc
import weakref
import torch
import cudnn_attn
from cudnn_attn.ops.cudnn import lowering
from cudnn_attn.runtime import lifecycle
made = []
built = lowering.callbacks
def tracked(mod, inputs):  # the callbacks the C++ graphs hold: alive while a graph is
    modifier = built(mod, inputs)
    made.append(weakref.ref(modifier.forward))
    return modifier
lowering.callbacks = tracked
q, k, v, d_o = (torch.randn(1, 8, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
for _ in range(2):
    lq, lk, lv = (x.clone().requires_grad_() for x in (q, k, v))
    out = cudnn_attn.sdpa(lq, lk, lv, is_causal=True, softcap=30.0)
    torch.autograd.grad(out, [lq, lk, lv], d_o)
torch.cuda.synchronize()
del out, lq, lk, lv
lifecycle.release_plans()  # every plan dropped, as at exit
gc.collect()
print(len(made), sum(ref() is not None for ref in made))
"""


def test_score_modifier_graphs_are_freed_with_their_plans():
    """The frontend's callbacks close a cycle through C++ (graph -> callback -> the graph's
    lowering function -> graph); the frontend graph's end breaks it, so the C++ graphs (and the
    callbacks they hold) go with their plans, and nothing is left for nanobind to report as
    leaked at exit (it was: 40 instances after soft-capping forward and backward). No plan
    store: a stored plan loads without calling the callbacks, so it would hide the cycle."""
    env = {**os.environ, "CUDNN_ATTN_CACHE_DIR": ""}
    done = subprocess.run(
        [sys.executable, "-c", _SOFTCAP_AND_EXIT], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr
    made, alive = map(int, done.stdout.split())
    assert made >= 2 and alive == 0, (made, alive)  # a forward and a backward graph, both freed
    assert "leaked" not in done.stderr, done.stderr


_ONE_MODIFIER_TWO_GRAPHS = """
import cudnn, torch
from cudnn_attn.core.score_mod import softcap
from cudnn_attn.ops.cudnn.score_mod import callbacks

modifier = callbacks(softcap(20.0), [])
try:
    for _ in range(2):
        q, k, v = (torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        g = cudnn.pygraph(
            io_data_type=cudnn.data_type.BFLOAT16,
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
        )
        tq, tk, tv = g.tensor_like(q), g.tensor_like(k), g.tensor_like(v)
        to, _ = g.sdpa(q=tq, k=tk, v=tv, attn_scale=0.125, generate_stats=False, score_mod=modifier.forward)
        to.set_output(True).set_dim(list(q.shape)).set_stride(list(q.stride()))
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        out = torch.full_like(q, float("nan"))
        workspace = torch.empty(g.get_workspace_size(), device="cuda", dtype=torch.uint8)
        g.execute({tq: q, tk: k, tv: v, to: out}, workspace)
        torch.cuda.synchronize()
        s = (q.double() @ k.double().transpose(-1, -2)) * 0.125
        expected = torch.softmax(20.0 * torch.tanh(s / 20.0), -1) @ v.double()
        print((out.double() - expected).norm().item() / expected.norm().item())
        del g, tq, tk, tv, to
finally:
    modifier.release()
"""


def test_one_modifier_lowered_into_two_graphs_builds_each_its_own_nodes():
    """The callbacks keep a table of the nodes they built, so that a bprop reads the forward's;
    a second lowering (here a second graph; the frontend also lowers a graph again after a
    rejected lowering) must build its own, never reuse the nodes of another C++ graph (a
    shared table crashed the second graph's build). In a process of its own: a crash must not
    take the test run with it. Both graphs exact, nothing leaked at exit."""
    done = subprocess.run([sys.executable, "-c", _ONE_MODIFIER_TWO_GRAPHS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    errors = [float(line) for line in done.stdout.split()]
    assert len(errors) == 2 and all(error < BF16 for error in errors), errors
    assert "leaked" not in done.stderr, done.stderr
