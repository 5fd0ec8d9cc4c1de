"""What calls reuse on cuDNN: derived lengths and page tables across calls, layers and CUDA
graph replays, and builds adopted by repeated recordings. Every result is compared with the
reference backend on the inputs as they are at that call."""

from __future__ import annotations

import pytest
import torch
from cases import paged_cache
from conftest import poisoned, rel_err

import cudnn_attn
from cudnn_attn.core import derived as derived_inputs

pytestmark = pytest.mark.gpu

TOL = 1.6e-2  # bf16


def randn(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device="cuda", dtype=torch.bfloat16)


def _decode_inputs(b=3, h=8, h_kv=2, s_kv=256, d=128, page=32):
    q = randn(b, h, 1, d, seed=1)
    k_cache, table = paged_cache(randn(b, h_kv, s_kv, d, seed=2), page, "NPHD", 3)
    v_cache = randn(*k_cache.shape, seed=4)
    lengths = torch.tensor([256, 17, 160], dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, table, lengths


def _paged_graph(backend, q, k_cache, v_cache, table, lengths):
    with cudnn_attn.Graph(backend=backend, cache=cudnn_attn.PlanCache()) as g:
        g.sdpa_with_paged_cache(q, k_cache, v_cache, table, seq_len_kv=lengths)
    return g


def test_in_place_updates_of_lengths_and_tables_are_seen():
    """Decode steps that update lengths and the page table in place (as servers do) get
    results for the new values, never for the values an earlier call derived from."""
    q, k_cache, v_cache, table, lengths = _decode_inputs()
    fast = _paged_graph("cudnn", q, k_cache, v_cache, table, lengths)
    ref = _paged_graph("reference", q, k_cache, v_cache, table, lengths)
    previous = None
    for step in range(4):
        out = fast(q, k_cache, v_cache, table, lengths)
        expected = ref(q, k_cache, v_cache, table, lengths)
        assert rel_err(out, expected) < TOL
        if previous is not None:
            assert not torch.equal(out, previous)  # the update changed the result
        previous = out
        lengths.sub_(step + 3)  # the next step reads fewer tokens ...
        table[1].copy_(table[1].roll(1))  # ... and another page order for sequence 1 (through a view)


def test_layers_share_one_derivation_per_step():
    q, k_cache, v_cache, table, lengths = _decode_inputs()
    layers = [_paged_graph("cudnn", q, k_cache, v_cache, table, lengths) for _ in range(4)]
    ref = _paged_graph("reference", q, k_cache, v_cache, table, lengths)
    derived_inputs.clear()
    expected = ref(q, k_cache, v_cache, table, lengths)
    for layer in layers:
        assert rel_err(layer(q, k_cache, v_cache, table, lengths), expected) < TOL
    held = derived_inputs.size()
    assert 0 < held <= 3  # the clamped table and lengths, made once for four layers
    for layer in layers:
        layer(q, k_cache, v_cache, table, lengths)
    assert derived_inputs.size() == held


def test_cuda_graph_replays_read_the_lengths_of_each_replay():
    q, k_cache, v_cache, table, lengths = _decode_inputs()
    fast = _paged_graph("cudnn", q, k_cache, v_cache, table, lengths)
    ref = _paged_graph("reference", q, k_cache, v_cache, table, lengths)
    static_out = poisoned(fast.outputs[0])
    fast(q, k_cache, v_cache, table, lengths, out=static_out)  # derives (and keeps) outside the capture
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        fast(q, k_cache, v_cache, table, lengths, out=static_out)
    for new_lengths in ([100, 200, 3], [256, 1, 64]):
        lengths.copy_(torch.tensor(new_lengths, dtype=torch.int32))
        static_out.fill_(float("nan"))
        cuda_graph.replay()
        torch.cuda.synchronize()
        assert rel_err(static_out, ref(q, k_cache, v_cache, table, lengths)) < TOL


def test_thd_lengths_updated_in_place():
    h, d = 4, 64
    lengths = torch.tensor([37, 64, 1, 20], dtype=torch.int32, device="cuda")
    kv_lengths = lengths.clone()
    q, k, v = (randn(122, h, d, seed=i) for i in range(3))

    def build(backend):
        with cudnn_attn.Graph(backend=backend, cache=cudnn_attn.PlanCache()) as g:
            g.sdpa(q, k, v, seq_len_q=lengths, seq_len_kv=kv_lengths, max_seq_len_q=64, max_seq_len_kv=64)
        return g

    fast, ref = build("cudnn"), build("reference")
    for new_lengths in ([37, 64, 1, 20], [10, 50, 30, 32]):
        lengths.copy_(torch.tensor(new_lengths, dtype=torch.int32))
        kv_lengths.copy_(lengths.flip(0))
        out = fast(q, k, v, lengths, kv_lengths)
        expected = ref(q, k, v, lengths, kv_lengths)
        used = int(lengths.sum())
        assert rel_err(out[:used], expected[:used]) < TOL


def test_repeated_recordings_adopt_and_run_on_cudnn():
    cache = cudnn_attn.PlanCache()
    results = []
    for seed in (0, 1):
        q, k, v = (randn(2, 8, 128, 64, seed=seed * 3 + i) for i in range(3))
        with cudnn_attn.Graph(cache=cache) as g:
            g.sdpa(q, k, v, use_causal_mask=True)
        out = poisoned(g.outputs[0])
        g(q, k, v, out=out)
        expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        assert rel_err(out, expected) < TOL
        results.append(g)
    assert len(cache.recorded) == 1 and cache.stats()["builds"] == 1
    assert results[1].nodes[0].plan is results[0].nodes[0].plan
