"""The Graph API at edges a user hit on the CPU: a torch tensor scale read by value (a rebuilt
graph reused the first graph's), outputs that cannot be written (a read-only NumPy memory map
crashed the process; a leaf that requires grad raised torch's RuntimeError)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import cudnn_attn
from cudnn_attn.errors import ShapeMismatchError


def _attention(q, k, v, scale):
    return torch.softmax(q.double() @ k.double().transpose(-1, -2) * scale, -1) @ v.double()


def test_each_graph_with_a_torch_tensor_scale_attends_with_its_own_scale():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 16, generator=gen) for _ in range(3))
    for scale in (0.1, 0.9, 0.1):
        with cudnn_attn.Graph() as g:
            g.sdpa(q, k, v, attn_scale=torch.tensor(scale))
        out = g(q, k, v)
        out = out[0] if isinstance(out, tuple) else out
        assert (out.double() - _attention(q, k, v, scale)).abs().max() < 1e-5, scale


def test_an_output_that_cannot_be_written_is_refused_naming_it(tmp_path):
    q = torch.randn(1, 2, 16, 16)
    with cudnn_attn.Graph() as g:
        g.sdpa(q, q, q)
    path = tmp_path / "o.bin"
    np.zeros((1, 2, 16, 16), np.float32).tofile(path)
    read_only = np.memmap(path, np.float32, mode="r", shape=(1, 2, 16, 16))
    with pytest.raises(ShapeMismatchError, match="out\\[O\\]: a read-only array"):
        g(q, out=read_only)
    with pytest.raises(ShapeMismatchError, match="out\\[O\\]: a leaf tensor that requires grad"):
        g(q, out=torch.zeros(1, 2, 16, 16, requires_grad=True))
    writable = np.zeros((1, 2, 16, 16), np.float32)
    g(q, out=writable)
    assert np.abs(writable).sum() > 0


def test_a_frontend_graph_refuses_a_read_only_output_in_its_variant_pack(tmp_path):
    import cudnn_attn as cudnn

    tensors = [torch.randn(1, 2, 16, 16, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    path = tmp_path / "o.bin"
    np.zeros((1, 2, 16, 16), np.float32).tofile(path)
    read_only = np.memmap(path, np.float32, mode="r", shape=(1, 2, 16, 16))
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q, k, v = (graph.tensor_like(t) for t in tensors)
    o, _ = graph.sdpa(q=q, k=k, v=v, is_inference=True)
    o.set_output(True)
    graph.build([cudnn.heur_mode.A])
    with pytest.raises(ShapeMismatchError, match="a read-only array"):
        graph.execute({q: tensors[0], k: tensors[1], v: tensors[2], o: read_only}, None)


def test_a_ragged_tensor_bound_with_fewer_rows_than_its_offsets_place_is_refused_naming_it():
    """The frontend's ragged (THD) form: q's memory held 4 of 16 tokens and the run read the
    missing rows as zeros (and dropped output rows past an output's end) without a word."""
    import cudnn_attn as cudnn
    from cudnn_attn.errors import ValidationError

    b, h, s, d = 2, 2, 16, 16
    lengths = torch.tensor([8, 8], dtype=torch.int32).view(b, 1, 1, 1)
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.HALF)
    offsets = graph.tensor(dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
    strides = [s * h * d, d, h * d, 1]
    q, k, v = (graph.tensor(dim=[b, h, s, d], stride=strides, ragged_offset=offsets) for _ in range(3))
    seq_q, seq_kv = (
        graph.tensor(dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32) for _ in range(2)
    )
    o, _ = graph.sdpa(q=q, k=k, v=v, is_inference=True, use_padding_mask=True, seq_len_q=seq_q, seq_len_kv=seq_kv)
    o.set_output(True).set_ragged_offset(offsets)
    graph.build([cudnn.heur_mode.A])
    starts = torch.tensor([0, 8 * h * d, 16 * h * d], dtype=torch.int32).view(-1, 1, 1, 1)
    x = torch.randn(16, h, d, generator=torch.Generator().manual_seed(0)).half()
    pack = {k: x, v: x, offsets: starts, seq_q: lengths, seq_kv: lengths}
    with pytest.raises(
        ValidationError, match="offsets \\[0, 256\\] place a sequence outside q \\(128 elements bound\\)"
    ):
        graph.execute({**pack, q: x[:4].clone(), o: torch.zeros(16, h, d, dtype=torch.half)}, None)
    with pytest.raises(ValidationError, match="place a sequence outside o"):
        graph.execute({**pack, q: x, o: torch.zeros(12, h, d, dtype=torch.half)}, None)
    out = torch.zeros(16, h, d, dtype=torch.half)
    graph.execute({**pack, q: x, o: out}, None)  # the whole memory: runs
    assert out[8:].abs().sum() > 0


def test_settings_of_the_wrong_type_are_refused_and_numpy_scales_taken():
    """bool("false") turned tuning on; PlanCache(path=5) was a TypeError; a NumPy float scale was
    refused while a 0-d tensor was taken."""
    from cudnn_attn.cache import PlanCache
    from cudnn_attn.errors import ValidationError

    with pytest.raises(ValidationError, match="Graph: autotune: 'false'; expected True, False or None"):
        cudnn_attn.Graph(autotune="false")
    with pytest.raises(ValidationError, match="set_autotune: enabled: 'no'"):
        cudnn_attn.set_autotune("no")
    with pytest.raises(ValidationError, match="PlanCache: path: 5; expected a directory path"):
        PlanCache(path=5)
    q = torch.randn(1, 2, 16, 16, generator=torch.Generator().manual_seed(3))
    with cudnn_attn.Graph() as g:
        g.sdpa(q, q, q, attn_scale=np.float32(0.25))
    out = g(q)
    assert (out.double() - _attention(q, q, q, 0.25)).abs().max() < 1e-5


def test_a_store_directory_under_an_unknown_home_leaves_graphs_running(tmp_path):
    """'~nosuchuser/x' (or a container user without a home) made every Graph raise RuntimeError."""
    import os
    import subprocess
    import sys

    script = "import torch, cudnn_attn\nq = torch.randn(1, 2, 16, 16)\nwith cudnn_attn.Graph() as g: g.sdpa(q, q, q)\nprint(tuple(g(q).shape))"
    env = {**os.environ, "CUDNN_ATTN_CACHE_DIR": "~nosuchuser-of-this-host/plans"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(1, 2, 16, 16)"
    assert not any(tmp_path.iterdir())  # no literal "./~..." store made under the working directory


def test_an_output_that_requires_grad_is_taken_outside_grad_mode():
    """torch's out= takes a leaf that requires grad under no_grad or inference_mode; so do these."""
    q = torch.randn(1, 2, 16, 16, generator=torch.Generator().manual_seed(5))
    with cudnn_attn.Graph() as g:
        g.sdpa(q, q, q)
    out = torch.zeros(1, 2, 16, 16, requires_grad=True)
    with torch.no_grad():
        g(q, out=out)
    assert (out.detach().double() - _attention(q, q, q, 16**-0.5)).abs().max() < 1e-5


def test_a_tensor_given_twice_in_a_variant_pack_is_refused():
    """By its handle and by its uid: the last binding won, silently (attention ran on K, K, V)."""
    import cudnn_attn as cudnn

    tensors = [torch.randn(1, 2, 16, 16, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT)
    q, k, v = (graph.tensor_like(t) for t in tensors)
    o, _ = graph.sdpa(q=q, k=k, v=v, is_inference=True, attn_scale=16**-0.5)
    o.set_output(True)
    graph.build([cudnn.heur_mode.A])
    out = torch.empty_like(tensors[0])
    with pytest.raises(ShapeMismatchError, match=f"uid {q.get_uid()}\\): given twice in the variant pack"):
        graph.execute({q: tensors[0], q.get_uid(): tensors[1], k: tensors[1], v: tensors[2], o: out}, None)
    graph.execute({q: tensors[0], k: tensors[1], v: tensors[2], o: out}, None)
    assert (out.double() - _attention(*tensors, 16**-0.5)).abs().max() < 1e-5


@pytest.mark.parametrize("bad", [torch.tensor(True), torch.tensor(1 + 0j)], ids=["bool", "complex"])
def test_a_refused_tensor_scale_is_refused_whatever_the_cache_built_before(bad):
    """A tensor scale was keyed by its float value alone: after a tensor(1.0) graph, a bool or
    complex one adopted that build instead of being refused."""
    q = torch.randn(1, 2, 8, 16)
    cache = cudnn_attn.PlanCache()
    with cudnn_attn.Graph(cache=cache) as g:
        g.sdpa(q, q, q, attn_scale=torch.tensor(1.0))
    with pytest.raises(cudnn_attn.ValidationError, match="attn_scale"):
        with cudnn_attn.Graph(cache=cache) as g:
            g.sdpa(q, q, q, attn_scale=bad)


def test_score_mod_constants_of_other_signs_of_zero_build_apart():
    """0.0 == -0.0, so two modifiers clipping at 1/0.0 (+inf: nothing) and 1/-0.0 (-inf: every
    score) shared one build: the second ran the first's."""
    q, k, v = (torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))

    def run(c0, cache):
        def clip(g, s):
            return g.min(input0=s, input1=g.reciprocal(input=g.tensor_scalar(c0)))

        with cudnn_attn.Graph(cache=cache) as g:
            g.sdpa(q, k, v, score_mod=clip)
        return g(q, k, v)

    shared = cudnn_attn.PlanCache()
    run(0.0, shared)
    assert torch.equal(run(-0.0, shared), run(-0.0, cudnn_attn.PlanCache()))


@pytest.mark.parametrize("stream", ["foo", object(), -5], ids=["string", "object", "negative"])
def test_a_stream_no_gpu_could_run_on_is_refused_on_every_backend(stream):
    """It ran on the CPU and would fail inside the cuDNN path (int("foo")) on a GPU."""
    q = torch.randn(1, 2, 8, 16)
    with cudnn_attn.Graph() as g:
        g.sdpa(q, q, q)
    with pytest.raises(cudnn_attn.ValidationError, match="stream: .*expected None, a CUDA stream"):
        g(q, stream=stream)
    assert g(q, stream=types.SimpleNamespace(cuda_stream=0)).shape == q.shape  # any object holding a pointer


def test_an_output_sharing_memory_with_an_input_or_another_output_is_refused():
    """``out=`` tensors were never compared with the inputs or each other: node 1's O written
    into q's memory made node 2 read it as q (0.45 off), and dQ and dK given one buffer lost dQ.
    A packed dQKV's views interleave in one buffer without sharing an element, and stay taken."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(1, 2, 8, 16, generator=gen) for _ in range(4))
    with cudnn_attn.Graph() as chain:
        o1, _ = chain.sdpa(q, k, v)
        chain.sdpa(q, o1, v)
    with pytest.raises(cudnn_attn.ValidationError, match=r"out\[O\]: shares memory with q"):
        chain(q, k, v, out=(q, torch.empty_like(q)))
    with cudnn_attn.Graph() as one:
        one.sdpa(q, k, v)
    with pytest.raises(cudnn_attn.ValidationError, match="shares memory with v"):
        one(q, k, v, out=v[:, :, :, :])  # a view of v, the one-output fast path
    with cudnn_attn.Graph() as train:
        o, stats = train.sdpa(q, k, v, generate_stats=True)
        train.sdpa_backward(q, k, v, o, do, stats)
    grad = torch.empty_like(q)
    given = (torch.empty_like(q), torch.empty(1, 2, 8, 1), grad, grad, torch.empty_like(v))
    with pytest.raises(cudnn_attn.ValidationError, match=r"dK\]: shares memory with out\[sdpa_backward::dQ\]"):
        train(q, k, v, do, out=given)
    expected = train(q, k, v, do)
    fresh = (torch.empty_like(q), torch.empty(1, 2, 8, 1), *(torch.empty_like(q) for _ in range(3)))
    assert all(torch.equal(a, b) for a, b in zip(train(q, k, v, do, out=fresh), expected))


def test_interleaved_views_of_one_buffer_share_no_element():
    from cudnn_attn.core.shared_memory import share_elements

    q, k, v = torch.empty(2, 8, 3, 4, 16).unbind(2)  # a packed QKV's views
    assert not share_elements(q, k) and not share_elements(k, v) and share_elements(q, q[:, :1])
    x = torch.empty(4, 6)
    assert not share_elements(x[:, ::2], x[:, 1::2]) and share_elements(x[:, ::2], x[:, ::3])
    assert not share_elements(q, q.clone())


def test_a_built_graph_keeps_none_of_its_keyword_templates_alive():
    """The plan cache kept each recorded graph's bias, lengths and sinks templates (q, k and v
    were released): on a GPU, a graph recorded per shape pinned its first [B, H, S, S] bias."""
    import gc
    import weakref

    q = torch.randn(1, 2, 64, 16)
    bias, lens, sinks = torch.randn(1, 1, 64, 64), torch.tensor([5], dtype=torch.int32), torch.zeros(1, 2, 1, 1)
    alive = [weakref.ref(t) for t in (bias, lens, sinks)]
    with cudnn_attn.Graph() as g:
        g.sdpa(q, q, q, bias=bias, use_padding_mask=True, seq_len_q=lens, seq_len_kv=lens, sink_token=sinks)
    g(q, bias, lens, sinks)
    del g, bias, lens, sinks
    gc.collect()
    assert [ref() is None for ref in alive] == [True, True, True]


def test_a_nested_template_is_refused_by_name():
    """torch's AttributeError from its symbolic ints came through as the block closed."""
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    nested = torch.nested.nested_tensor([q[0]], layout=torch.jagged)
    with pytest.raises(cudnn_attn.ValidationError, match="q: a nested tensor"):
        with cudnn_attn.Graph() as g:
            g.sdpa(nested, k, v)


def test_an_unknown_keyword_of_a_graph_call_is_refused_by_name():
    q = torch.randn(1, 2, 8, 16)
    with cudnn_attn.Graph() as g:
        g.sdpa(q, q, q)
    with pytest.raises(cudnn_attn.ValidationError, match="foo: not a keyword of a graph's call"):
        g(q, q, q, foo=1)


def test_packed_gqa_gradients_and_outputs_cut_from_one_buffer_are_taken():
    """A GQA packed dQKV (dQ, dK, dV: views of one buffer with other head counts) and O and Stats
    cut from one arena share no element: the first aliasing check refused them."""
    from cudnn_attn.core.shared_memory import share_elements

    packed = torch.zeros(1, 8, 8, 16)  # [B, S, H_q + 2 H_kv, D]
    dq, dk, dv = (t.transpose(1, 2) for t in packed.split([4, 2, 2], dim=2))
    assert not share_elements(dq, dk) and not share_elements(dk, dv) and share_elements(dq, dq[:, :1])
    arena = torch.zeros(1000)
    o, stats = arena[:256].view(1, 2, 8, 16), arena[256:272].view(1, 2, 8, 1)
    assert not share_elements(o, stats)
    shifted = arena[8:264].view(1, 2, 8, 16)  # overlaps o from its ninth element on
    assert share_elements(o, shifted)
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    with cudnn_attn.Graph() as g:
        g.sdpa(q, k, v, generate_stats=True)
    out, lse = g(q, k, v, out=(o, stats))
    assert out.data_ptr() == o.data_ptr() and torch.equal(out, g(q, k, v)[0])
