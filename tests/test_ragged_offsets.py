"""The frontend's THD form on the reference backend: 4-D tensors whose sequences the caller
places with ragged offsets (``set_ragged_offset``), packed, gapped, reordered or mixed with
padded tensors; ragged Stats; packed page tables; the errors for offsets that cannot work."""

from __future__ import annotations

import pytest
import ragged_cases
import torch
from conftest import TOLERANCE, rel_err

import cudnn_attn as cudnn

LENGTHS_Q, LENGTHS_KV = [5, 16, 9], [12, 16, 3]


@pytest.mark.parametrize(
    "ragged, gap, reverse, stats",
    [
        (("q", "k", "v", "o"), 0, False, "dense"),  # the frontend's test_mhas THD case
        (("q", "k", "v", "o"), 3, True, "ragged"),  # gaps between sequences, stored last first, ragged Stats
        (("q",), 0, False, None),  # notebook 52: a packed q, padded k, v and O
        (("k", "v", "o"), 2, False, "dense"),
    ],
    ids=["packed", "gapped-reversed-ragged-stats", "packed-q-only", "gapped-kv-o"],
)
def test_forward_with_ragged_offsets_matches_dense_attention(ragged, gap, reverse, stats):
    run = ragged_cases.forward(
        cudnn,
        lengths_q=LENGTHS_Q,
        lengths_kv=LENGTHS_KV,
        ragged=ragged,
        gap=gap,
        reverse=reverse,
        stats=stats,
        causal=True,
        seed=1,
    )
    assert rel_err(run["result"]["o"], run["expected"]["o"]) < TOLERANCE[torch.float16]
    if stats is not None:
        assert rel_err(run["result"]["stats"], run["expected"]["stats"]) < 1e-5
    for role in ("o", "stats"):
        t = run["tensors"].get(role)
        if isinstance(t, ragged_cases.Ragged):
            assert t.untouched(), f"{role}: written outside its sequences' rows"


def test_backward_with_ragged_offsets_matches_autograd():
    run = ragged_cases.backward(
        cudnn, lengths_q=LENGTHS_Q, lengths_kv=LENGTHS_KV, gap=2, reverse=True, causal=True, seed=2
    )
    for name in ("dQ", "dK", "dV"):
        assert rel_err(run["result"][name], run["expected"][name]) < 5e-3, name
        assert run["tensors"][name].untouched(), f"{name}: written outside its sequences' rows"


def test_packed_page_tables_read_each_sequence_from_its_offset():
    """Notebook 53's form: page tables packed back to back, [B, 1, pages, 1] with ragged offsets;
    the entries no sequence needs hold -1 (never read)."""
    run = ragged_cases.packed_page_tables(cudnn, seed=3)
    assert rel_err(run["result"], run["expected"]) < TOLERANCE[torch.float16]


def test_a_rebuilt_ragged_graph_adopts_its_build_and_reads_the_new_offsets():
    """Frontend code rebuilds its graph per call: the second build is a cache hit, and it must read
    the offsets of its own call; a recording that differs only in its offsets is not adopted."""
    cache = cudnn.PlanCache()
    kw = dict(lengths_q=LENGTHS_Q, lengths_kv=LENGTHS_KV, stats="dense", cache=cache)
    first = ragged_cases.forward(cudnn, seed=4, **kw)
    second = ragged_cases.forward(cudnn, gap=1, seed=5, **kw)  # other offsets, the same geometry
    assert len(cache.recorded) == 1 and cache.stats()["builds"] == 1
    other = ragged_cases.forward(cudnn, ragged=("q", "k", "v"), seed=6, **kw)  # O without offsets
    assert len(cache.recorded) == 2
    for run in (first, second, other):
        assert rel_err(run["result"]["o"], run["expected"]["o"]) < TOLERANCE[torch.float16]


def _graph_with(offsets: torch.Tensor, *, q: torch.Tensor | None = None, padding: bool = True):
    b, h, s, d = 2, 2, 8, 16
    q = q if q is not None else torch.randn(b, h, s, d).half()
    lengths = torch.tensor([3, 8], dtype=torch.int32).view(-1, 1, 1, 1)
    g = cudnn.pygraph(io_data_type=cudnn.data_type.HALF)
    tq = g.tensor_like(q)
    tq.set_ragged_offset(g.tensor_like(offsets))
    kw = dict(use_padding_mask=True, seq_len_q=g.tensor_like(lengths), seq_len_kv=g.tensor_like(lengths))
    g.sdpa(
        q=tq,
        k=g.tensor_like(torch.randn(b, h, s, d).half()),
        v=g.tensor_like(torch.randn(b, h, s, d).half()),
        is_inference=True,
        **(kw if padding else {}),
    )
    return g


@pytest.mark.parametrize(
    "offsets, padding, message",
    [
        (torch.zeros(3, 1, 1, 1, dtype=torch.float32), True, "q.ragged_offset: dtype float32; must be int32 or int64"),
        (torch.zeros(2, 1, 1, 1, dtype=torch.int64), True, r"q.ragged_offset: shape \[2, 1, 1, 1\]; expected \[3, 1"),
        (torch.zeros(3, 1, 1, 1, dtype=torch.int64), False, "q.ragged_offset: needs use_padding_mask=True"),
        (torch.tensor([0, 9999, 0], dtype=torch.int64).view(-1, 1, 1, 1), True, r"offsets \[9999\] out of range"),
    ],
    ids=["dtype", "count", "no-padding", "out-of-range"],
)
def test_malformed_ragged_offsets_are_refused_by_name(offsets, padding, message):
    with pytest.raises(cudnn.ValidationError, match=message):
        _graph_with(offsets, padding=padding).build()


def test_ragged_offsets_on_a_packed_thd_tensor_or_a_paged_cache_are_refused():
    lengths = torch.tensor([3, 8], dtype=torch.int32)
    offsets = torch.zeros(3, 1, 1, 1, dtype=torch.int64)
    g = cudnn.pygraph(io_data_type=cudnn.data_type.HALF)
    q, k, v = (g.tensor_like(torch.randn(11, 2, 16).half()) for _ in range(3))
    q.set_ragged_offset(g.tensor_like(offsets))
    g.sdpa(
        q=q,
        k=k,
        v=v,
        is_inference=True,
        use_padding_mask=True,
        seq_len_q=g.tensor_like(lengths),
        seq_len_kv=g.tensor_like(lengths),
    )
    with pytest.raises(cudnn.ValidationError, match="q has rank 3; ragged offsets address a 4-D tensor"):
        g.build()
    g = cudnn.pygraph(io_data_type=cudnn.data_type.HALF)
    cache = g.tensor_like(torch.randn(4, 2, 8, 16).half())
    cache.set_ragged_offset(g.tensor_like(offsets))
    table = g.tensor_like(torch.zeros(2, 1, 2, 1, dtype=torch.int32))
    g.sdpa(
        q=g.tensor_like(torch.randn(2, 2, 1, 16).half()),
        k=cache,
        v=g.tensor_like(torch.randn(4, 2, 8, 16).half()),
        is_inference=True,
        use_padding_mask=True,
        seq_len_q=g.tensor_like(lengths),
        seq_len_kv=g.tensor_like(lengths),
        paged_attention_k_table=table,
        paged_attention_v_table=table,
    )
    with pytest.raises(cudnn.ValidationError, match="k is a paged cache, addressed through its page table"):
        g.build()


def test_ragged_offsets_on_a_tensor_that_takes_none_are_refused():
    q, bias = torch.randn(2, 2, 8, 16).half(), torch.randn(1, 2, 8, 8).half()
    g = cudnn.pygraph(io_data_type=cudnn.data_type.HALF)
    tb = g.tensor_like(bias)
    tb.set_ragged_offset(g.tensor_like(torch.zeros(3, 1, 1, 1, dtype=torch.int64)))
    g.sdpa(q=g.tensor_like(q), k=g.tensor_like(q.clone()), v=g.tensor_like(q.clone()), bias=tb, is_inference=True)
    with pytest.raises(cudnn.ValidationError, match="attn_bias: has ragged offsets .* only q, k, v, o, dO"):
        g.build()


def test_graph_tensor_takes_ragged_offset_as_the_frontend_does():
    g = cudnn.pygraph(io_data_type=cudnn.data_type.HALF)
    offsets = g.tensor([3, 1, 1, 1], data_type=torch.int64, device="cpu")
    q = g.tensor([2, 2, 8, 16], [256, 16, 32, 1], device="cpu", ragged_offset=offsets)
    assert q.get_ragged_offset() is offsets


def test_a_recording_that_differs_only_in_whether_o_has_offsets_is_built_again():
    """The same tensors made, the same calls: only ``o.set_ragged_offset`` differs. The second
    must not adopt the first build (its O would then be written at the offsets)."""
    b, h, s, d = 2, 2, 8, 16
    lengths = torch.tensor([3, 8], dtype=torch.int32).view(-1, 1, 1, 1)
    offsets = torch.tensor([0, 3 * h * d, 11 * h * d], dtype=torch.int64).view(-1, 1, 1, 1)
    bshd = (s * h * d, d, h * d, 1)
    q, k, v = (torch.randn(b * s * h * d).as_strided((b, h, s, d), bshd) for _ in range(3))
    cache = cudnn.PlanCache()
    outs = []
    for o_ragged in (True, False):
        g = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT, cache=cache)
        tq, tk, tv, to, sq = (g.tensor_like(x) for x in (q, k, v, offsets, lengths))
        for t in (tq, tk, tv):
            t.set_ragged_offset(to)
        o, _ = g.sdpa(q=tq, k=tk, v=tv, is_inference=True, use_padding_mask=True, seq_len_q=sq, seq_len_kv=sq)
        o.set_output(True).set_dim([b, h, s, d]).set_stride(list(bshd))
        if o_ragged:
            o.set_ragged_offset(to)
        out = torch.full((b * s * h * d,), float("nan")).as_strided((b, h, s, d), bshd)
        g.execute({tq: q, tk: k, tv: v, to: offsets, sq: lengths, o: out})
        outs.append(out)
    assert len(cache.recorded) == 2
    # Padded O: sequence 1's rows at batch 1's own place; ragged O: 3 tokens after sequence 0's.
    flat = outs[0].as_strided((b * s, h, d), (h * d, d, 1))
    assert torch.equal(flat[3:11].transpose(0, 1), outs[1][1])


def _thd_run(tokens, batch, offsets, lengths, h=1, s=4, d=16):
    """The frontend's THD form: packed ``[T, H, D]`` halves under one offsets tensor (in tokens
    here, elements for the graph) and one lengths tensor, executed into a NaN-poisoned output;
    returns (q, k, v, out, run) with ``run(offsets)`` executing again with other offsets."""
    gen = torch.Generator().manual_seed(tokens + batch)
    qb, kb, vb = (torch.randn(tokens, h, d, generator=gen).half() for _ in range(3))
    g = cudnn.pygraph(io_data_type=cudnn.data_type.HALF)
    off = g.tensor(name="off", dim=[batch + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
    lens = g.tensor(name="len", dim=[batch, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
    stride = [s * h * d, d, h * d, 1]
    q, k, v = (g.tensor(name=n, dim=[batch, h, s, d], stride=stride, ragged_offset=off) for n in "qkv")
    o, _ = g.sdpa(
        q=q, k=k, v=v, generate_stats=False, attn_scale=0.25, use_padding_mask=True, seq_len_q=lens, seq_len_kv=lens
    )
    o.set_output(True).set_stride(stride).set_ragged_offset(off)
    g.build([cudnn.heur_mode.A])
    out = torch.full((tokens, h, d), float("nan"), dtype=torch.float16)
    pack = {q: qb, k: kb, v: vb, lens: torch.tensor(lengths, dtype=torch.int32).view(batch, 1, 1, 1), o: out}

    def run(starts):
        given = (torch.tensor(starts, dtype=torch.int32) * h * d).view(batch + 1, 1, 1, 1)
        g.execute({**pack, off: given}, torch.empty(g.get_workspace_size(), dtype=torch.uint8))

    run(offsets)
    return qb, kb, vb, out, run


def _one_sequence(qb, kb, vb, rows):
    """float32 attention of one sequence's rows of packed ``[T, H, D]`` tensors (scale 0.25)."""
    q, k, v = (t[rows].float().transpose(0, 1) for t in (qb, kb, vb))
    return (torch.softmax(q @ k.mT * 0.25, -1) @ v).transpose(0, 1)


@pytest.mark.parametrize("lengths", [[3, 0], [0, 3], [2, 0, 1, 0]], ids=str)
def test_an_empty_sequence_may_start_at_the_end_of_the_tokens(lengths):
    """The frontend's THD form with an empty sequence whose cumulative offset is the token count
    (a batch's trailing empty sequences): it reads nothing, and was refused as placing a
    sequence outside q."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    qb, kb, vb, out, _ = _thd_run(sum(lengths), len(lengths), starts, lengths)
    for start, n in zip(starts, lengths):
        rows = slice(start, start + n)
        assert rel_err(out[rows].float(), _one_sequence(qb, kb, vb, rows)) < TOLERANCE[torch.float16]


def test_sequences_may_lie_anywhere_in_a_larger_token_buffer():
    """Rows 6..9 of a 10-token buffer run as a batch of one sequence of 4: the offsets were judged
    against the graph tensor's dims (64 elements), not the 160 bound, and refused, while a
    buffer smaller than the dims was judged by its real size (and a GPU clamps against it)."""
    qb, kb, vb, out, run = _thd_run(10, 1, [6, 10], [4])
    rows = slice(6, 10)
    assert rel_err(out[rows].float(), _one_sequence(qb, kb, vb, rows)) < TOLERANCE[torch.float16]
    with pytest.raises(cudnn.ValidationError, match="out of range|outside"):
        run([7, 11])  # rows 7..10: past the end
