"""Graph fidelity (issue 42): every mistake is answered with the library's own error.

A backward fed its own forward's O and Stats must form the scores as that forward did;
``cudnn_attn.graph`` is the frontend's ``graph(handle)`` in every process state; a score modifier
reading more graph tensors than are bound is refused at build; a damaged or edited serialized
graph is refused at ``deserialize``; a tensor that does not fit its override is named with the
override's geometry. All on the CPU (reference backend), results against float64 torch.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import rel_err

import cudnn_attn
import cudnn_attn as cudnn
from cudnn_attn.frontend.serialized import MAGIC

H, D = 2, 8


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---- item 3: a backward must repeat its forward's score options ---------------------------------------


def _pair(forward: dict, backward: dict, s_q: int = 16, s_kv: int = 16) -> None:
    q = randn(2, H, s_q, D, seed=1)
    k, v = randn(2, H, s_kv, D, seed=2), randn(2, H, s_kv, D, seed=3)
    with cudnn_attn.Graph() as g:
        o, st = g.sdpa(q, k, v, generate_stats=True, **forward)
        g.sdpa_backward(q, k, v, o, torch.randn_like(q), st, **backward)


def test_a_backward_with_another_mask_than_its_forward_is_refused_naming_the_option():
    with pytest.raises(
        cudnn.ValidationError, match=r"o and stats: from sdpa, .*use_causal_mask True there, False here"
    ):
        _pair(dict(use_causal_mask=True), {})


@pytest.mark.parametrize(
    "forward, backward, named",
    [
        (dict(attn_scale=0.3), dict(attn_scale=0.5), "attn_scale 0.3 there, 0.5 here"),
        (dict(use_causal_mask=True), dict(use_causal_mask=True, sliding_window_length=4), "sliding_window_length"),
        (dict(use_alibi_mask=True), {}, "use_alibi_mask True there, False here"),
        (dict(dropout=(0.1, 1, 2)), {}, "dropout 0.1 there, 0 here"),
        (dict(use_causal_mask=True), dict(use_causal_mask_bottom_right=True), "diagonal_alignment"),
        # int seeds and offsets are known at build: another one draws another mask (dV was 83% off)
        (
            dict(dropout=0.3, dropout_seed=1, dropout_offset=0),
            dict(dropout=0.3, dropout_seed=2, dropout_offset=0),
            "dropout_seed 1 there, 2 here",
        ),
        (
            dict(dropout=0.3, dropout_seed=1, dropout_offset=0),
            dict(dropout=0.3, dropout_seed=1, dropout_offset=5),
            "dropout_offset 0 there, 5 here",
        ),
    ],
    ids=["scale", "window", "alibi", "dropout", "alignment-with-s_q-below-s_kv", "dropout-seed", "dropout-offset"],
)
def test_each_option_that_changes_the_probabilities_is_compared(forward, backward, named):
    with pytest.raises(cudnn.ValidationError, match=named):
        _pair(forward, backward, s_q=8)


@pytest.mark.parametrize(
    "forward, backward",
    [
        (dict(use_causal_mask=True), dict(use_causal_mask_bottom_right=True)),  # one diagonal where S_q == S_kv
        ({}, dict(attn_scale=D**-0.5)),  # the default scale written out
        (dict(use_causal_mask=True), dict(use_causal_mask=True, use_deterministic_algorithm=True)),
    ],
    ids=["alignment-equal-lengths", "default-scale-spelled", "deterministic"],
)
def test_options_that_leave_the_probabilities_alone_are_not_compared(forward, backward):
    _pair(forward, backward)


def test_a_matching_backward_computes_the_gradients_of_its_forward():
    x, d_o = randn(2, H, 16, D, seed=4), randn(2, H, 16, D, seed=5)
    with cudnn_attn.Graph() as g:
        o, st = g.sdpa(x, x, x, generate_stats=True, use_causal_mask=True)
        g.sdpa_backward(x, x, x, o, d_o, st, use_causal_mask=True)
    got = g(x, d_o)
    leaf = x.double().requires_grad_()
    want = torch.nn.functional.scaled_dot_product_attention(leaf, leaf, leaf, is_causal=True)
    (grad,) = torch.autograd.grad(want, leaf, d_o.double())
    assert rel_err(got[2] + got[3] + got[4], grad) < 1e-4  # x is q, k and v: its gradient is their sum


# ---- item 5: cudnn_attn.graph is the frontend's graph(handle) in every process state --------------------


GRAPH_BLOCK = """
    handle = cudnn.create_handle()
    with cudnn.graph(handle, io_data_type=cudnn.data_type.FLOAT) as (g, extra):
        x = g.tensor(name="x", dim=(1, 2, 8, 8), stride=(128, 64, 8, 1), uid=1, device="cpu")
        o, _ = g.sdpa(q=x, k=x, v=x, generate_stats=False)
        o.set_output(True).set_uid(2)
    g.build()
    print(type(cudnn.graph).__name__, extra, g.is_built)
"""


@pytest.mark.parametrize(
    "before",
    ["", "cudnn.Graph", "cudnn.graph; cudnn.Graph", "cudnn.sdpa", "cudnn.pygraph", "import cudnn_attn.graph"],
    ids=["fresh", "Graph-first", "graph-then-Graph", "sdpa-first", "pygraph-first", "submodule-imported"],
)
def test_graph_is_the_frontends_context_manager_in_a_fresh_process(before):
    script = "import cudnn_attn as cudnn\n" + before + "\n" + textwrap.dedent(GRAPH_BLOCK)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["function", "[]", "True"]


def test_the_graph_module_stays_importable_beside_the_function():
    script = textwrap.dedent("""
        import sys
        from cudnn_attn import graph
        from cudnn_attn.graph import Graph, pygraph
        import cudnn_attn.graph
        import cudnn_attn
        module = sys.modules["cudnn_attn.graph"]
        print(graph is module.graph is cudnn_attn.graph, Graph is cudnn_attn.Graph, pygraph is module.pygraph)
        print(type(cudnn_attn.nn).__name__)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "True", "module"]


# ---- item 7: score modifiers past the input limit; damaged serialized graphs --------------------------


def test_a_score_modifier_reading_nine_graph_tensors_is_refused_at_build():
    q = randn(1, H, 16, D, seed=6)
    inputs = [randn(1, 1, 1, 1, seed=10 + i) for i in range(9)]

    def mod(graph, scores):
        for t in inputs:
            scores = graph.add(a=scores, b=t)
        return scores

    with pytest.raises(cudnn.ValidationError, match=r"score_mod: reads 9 graph tensors; at most 8 are supported"):
        with cudnn_attn.Graph() as g:
            g.sdpa(q, q, q, score_mod=mod)


B, S = 2, 8
DIMS = (B, H, S, D)


def _rich_graph():
    """Forward and backward in one graph: a score modifier reading a graph tensor, sinks and
    their gradient (a caller-made output), outputs by uid."""
    g = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q, k, v = (g.tensor(name=n, dim=DIMS, uid=i, device="cpu") for i, n in enumerate("qkv", 1))
    cap = g.tensor(name="cap", dim=(1, 1, 1, 1), uid=20, device="cpu")
    sink = g.tensor(name="sink", dim=(1, H, 1, 1), uid=21, device="cpu")

    def softcap(graph, scores):
        return graph.mul(a=graph.tanh(input=graph.div(a=scores, b=cap)), b=cap)

    def softcap_bprop(graph, grad):
        return graph.mul(a=grad, b=0.5)

    mask = dict(use_causal_mask=True, attn_scale=0.3, score_mod=softcap, sink_token=sink)
    o, st = g.sdpa(q=q, k=k, v=v, generate_stats=True, **mask)
    o.set_output(True).set_uid(10)
    st.set_output(True).set_uid(11)
    d_o = g.tensor(name="dO", dim=DIMS, uid=12, device="cpu")
    d_sink = g.tensor(name="dsink", dim=(1, H, 1, 1), uid=22, device="cpu")
    grads = g.sdpa_backward(
        q=q, k=k, v=v, o=o, dO=d_o, stats=st, score_mod_bprop=softcap_bprop, dSink_token=d_sink, **mask
    )
    for uid, t in enumerate(grads, 13):
        t.set_output(True).set_uid(uid)
    g.build()
    return g


PACK = {
    **{u: randn(*DIMS, seed=u) for u in (1, 2, 3, 12)},
    20: torch.full((1, 1, 1, 1), 5.0),
    21: randn(1, H, 1, 1, seed=21),
}
OUT_SHAPES = {10: DIMS, 11: (B, H, S, 1), 13: DIMS, 14: DIMS, 15: DIMS, 22: (1, H, 1, 1)}


def _run(g) -> dict[int, torch.Tensor]:
    out = {u: torch.full(shape, float("nan")) for u, shape in OUT_SHAPES.items()}
    g.execute({**PACK, **out})
    return out


@pytest.fixture(scope="module")
def serialized():
    g = _rich_graph()
    return g.serialize(as_bytes=True), _run(g)


def test_a_serialized_graph_with_a_caller_made_output_runs_again_by_the_same_uids(serialized):
    data, want = serialized
    restored = cudnn.pygraph()
    restored.deserialize(data)
    got = _run(restored)
    assert all(torch.equal(got[u], want[u]) for u in want) and not want[22].isnan().any()


def _reseal(raw: bytes) -> bytes:
    """``raw`` with its checksum made right again: an edit, not damage."""
    body = raw[len(MAGIC) + 32 :]
    return MAGIC + hashlib.sha256(body).digest() + body


def _outcome(data: bytes, want: dict[int, torch.Tensor], edited: bool) -> str:
    """ "refused" (ValidationError at deserialize) or "ran" (the same results where only damaged)."""
    restored = cudnn.pygraph()
    try:
        restored.deserialize(data)
    except cudnn.ValidationError:
        return "refused"
    try:
        got = _run(restored)
    except (cudnn.ShapeMismatchError, cudnn.ValidationError):
        assert edited, "a damaged blob that deserialized must run as before"
        return "ran"  # an edited name or uid: the pack names no tensor of the edited graph
    if not edited:
        assert all(torch.equal(got[u], want[u]) for u in want)
    return "ran"


def test_random_byte_flips_are_refused_at_deserialize_or_harmless(serialized):
    data, want = serialized
    rng = random.Random(20261128)
    outcomes: dict[str, int] = {}
    for trial in range(300):
        raw = bytearray(data)
        edited = trial % 2 == 1  # odd trials: flips inside the header and plans, the checksum made right again
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(MAGIC) + 32 if edited else 0, len(raw))
            raw[at] ^= 1 << rng.randrange(8)
        blob = _reseal(bytes(raw)) if edited else bytes(raw)
        result = _outcome(blob, want, edited)
        outcomes[result] = outcomes.get(result, 0) + 1
    assert outcomes["refused"] > 250, outcomes


EDITS = {
    "problem {}": lambda h: h["nodes"][0].__setitem__("problem", {}),
    "runtime null": lambda h: h["nodes"][0].__setitem__("runtime", None),
    "no nodes": lambda h: h.__setitem__("nodes", []),
    "header not an object": lambda h: h.clear(),
    "a tensor left out": lambda h: h["nodes"][0]["tensors"].pop("k"),
    "uid a string": lambda h: h["nodes"][0]["tensors"]["k"].__setitem__("uid", "2"),
    # one uid for two input roles of one geometry is a graph (q = k); for an input and an output, damage
    "uid twice": lambda h: h["nodes"][0]["tensors"]["k"].__setitem__("uid", h["nodes"][0]["tensors"]["o"]["uid"]),
    "output on an input's uid": lambda h: h["nodes"][1]["tensors"]["grad_q"].__setitem__("uid", 1),
    "forward read as backward": lambda h: h["nodes"][0]["problem"].__setitem__("op", "sdpa_backward"),
    "unknown op": lambda h: h["nodes"][0]["problem"].__setitem__("op", "sdpx"),
    "shape a string": lambda h: h["nodes"][0]["problem"]["q"].__setitem__("shape", "abc"),
    "shape with a float": lambda h: h["nodes"][0]["problem"]["q"].__setitem__("shape", [2, 2, 8.5, 8]),
    "q longer than o": lambda h: h["nodes"][0]["problem"]["q"].__setitem__("shape", [2, 2, 16, 8]),
    "not a dtype": lambda h: h["nodes"][0]["problem"]["q"].__setitem__("dtype", "torch.nn"),
    "unknown modifier op": lambda h: h["nodes"][0]["problem"]["score_mod"]["forward"].__setitem__("op", "frobnicate"),
    "modifier op without arguments": lambda h: h["nodes"][0]["problem"]["score_mod"]["forward"].__setitem__("args", []),
    "options a string": lambda h: h["nodes"][0]["problem"].__setitem__("options", "x"),
    "unknown causal": lambda h: h["nodes"][0]["problem"]["options"].__setitem__("causal", "diag"),
    "scale a string": lambda h: h["nodes"][0]["problem"]["options"].__setitem__("attn_scale", "0.3"),
    "dropout without a seed": lambda h: h["nodes"][0]["problem"]["options"].__setitem__("dropout_p", 0.5),
    "an unknown problem field": lambda h: h["nodes"][0]["problem"].__setitem__("zzz", 1),
    "a cuDNN plan on the CPU": lambda h: h["nodes"][0].__setitem__("backend", "cudnn"),
    "backend auto": lambda h: h["nodes"][0].__setitem__("backend", "auto"),
    "plan bytes past the end": lambda h: h["nodes"][0].__setitem__("plan_bytes", 3),
    "node name a number": lambda h: h["nodes"][0].__setitem__("name", 3),
    "a seed without dropout": lambda h: h["nodes"][0].__setitem__("runtime", {"dropout_seed": 1}),
    "a role the op lacks": lambda h: h["nodes"][0]["tensors"].__setitem__(
        "bogus", {"uid": 99, "name": "z", "output": False, "by_value": False}
    ),
}


@pytest.mark.parametrize("edit", EDITS, ids=list(EDITS))
def test_header_edits_to_other_valid_json_are_refused_at_deserialize(serialized, edit):
    data, _ = serialized
    start = len(MAGIC) + 32
    size = int.from_bytes(data[start : start + 8], "little")
    header = copy.deepcopy(json.loads(data[start + 8 : start + 8 + size]))
    EDITS[edit](header)
    text = json.dumps(header).encode()
    body = len(text).to_bytes(8, "little") + text + data[start + 8 + size :]
    with pytest.raises(cudnn.ValidationError, match=r"data: "):
        cudnn.pygraph().deserialize(_reseal(MAGIC + bytes(32) + body))


def test_a_header_nested_past_any_graph_is_refused(serialized):
    text = b'{"name": "g", "nodes": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    body = len(text).to_bytes(8, "little") + text
    with pytest.raises(cudnn.ValidationError, match="truncated or damaged"):
        cudnn.pygraph().deserialize(_reseal(MAGIC + bytes(32) + body))


# ---- item 14: a tensor that does not fit its override is named with the override's geometry --------------


def _override_graph(s: int):
    g = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT, is_override_shape_enabled=True)
    dims, strides = (2, H, s, D), (H * s * D, s * D, D, 1)
    q, k, v = (g.tensor(name=n, dim=dims, stride=strides, uid=i, device="cpu") for i, n in enumerate("qkv", 1))
    o, _ = g.sdpa(q=q, k=k, v=v, attn_scale=0.25, generate_stats=False)
    o.set_output(True).set_uid(10)
    g.build()
    return g


def _override(s: int) -> dict:
    return dict(
        override_uids=[1, 2, 3, 10], override_shapes=[[2, H, s, D]] * 4, override_strides=[[H * s * D, s * D, D, 1]] * 4
    )


def test_a_tensor_smaller_than_its_override_is_named_with_its_shape_then_the_overrides():
    g = _override_graph(8)
    pack = {u: randn(2, H, 8, D, seed=u) for u in (1, 2, 3, 10)}
    with pytest.raises(cudnn.ShapeMismatchError) as raised:
        g.execute(pack, None, **_override(16))
    assert raised.value.problems == [
        f"{name}: shape [2, {H}, 8, {D}]; override_shapes[{uid}] gives [2, {H}, 16, {D}]"
        for name, uid in (("q", 1), ("k", 2), ("v", 3), ("O", 10))
    ]


@pytest.mark.parametrize("s", [16, 4], ids=["larger-than-built", "smaller-than-built"])
def test_an_override_runs_on_tensors_of_its_geometry(s):
    g = _override_graph(8)
    q, k, v = (randn(2, H, s, D, seed=30 + i) for i in range(3))
    out = torch.full_like(q, float("nan"))
    g.execute({1: q, 2: k, 3: v, 10: out}, None, **_override(s))
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=0.25)
    assert rel_err(out, want) < 1e-5
