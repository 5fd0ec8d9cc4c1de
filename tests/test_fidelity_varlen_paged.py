"""Issue 42's varlen and paged items against plain float64 oracles: FlashAttention's bottom-right
windows in ``varlen_sdpa``, k and v token counts checked on every call, ragged offsets bounded
by each sequence's own rows, and page-table padding in slots no sequence reads."""

from __future__ import annotations

import numpy as np
import pytest
import ragged_cases
import torch
from conftest import TOLERANCE, rel_err

import cudnn_attn
import cudnn_attn as cudnn
from cudnn_attn.errors import ShapeMismatchError, ValidationError

# ---- oracles ----------------------------------------------------------------------------------


def flash_window_mask(s_q: int, s_k: int, left: int, right: int, causal: bool) -> torch.Tensor:
    """FlashAttention's mask: query i keeps keys i + s_k - s_q - left .. i + s_k - s_q + right
    (-1: unbounded on that side); causal is a right bound of 0 on the same diagonal."""
    i = torch.arange(s_q).view(-1, 1)
    j = torch.arange(s_k).view(1, -1)
    diagonal = i + s_k - s_q
    right = 0 if causal else right
    allowed = torch.ones(s_q, s_k, dtype=torch.bool)
    if left >= 0:
        allowed &= j >= diagonal - left
    if right >= 0:
        allowed &= j <= diagonal + right
    return allowed


def varlen_oracle(q, k, v, cu_q, cu_k, scale, mask_of, softcap=None) -> torch.Tensor:
    """float64 attention of each packed sequence alone with the boolean mask ``mask_of(s_q, s_k)``
    (after ``softcap * tanh(s / softcap)``, as FlashAttention caps); a row that keeps no key is 0.
    Groups of query heads share a K/V head (GQA)."""
    h_q, h_kv = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape[0], h_q, v.shape[-1], dtype=torch.float64)
    for b in range(cu_q.numel() - 1):
        sq, eq, sk, ek = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        qb = q[sq:eq].double().transpose(0, 1)
        kb, vb = (x[sk:ek].double().transpose(0, 1).repeat_interleave(h_q // h_kv, 0) for x in (k, v))
        scores = (qb @ kb.transpose(1, 2)) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        allowed = mask_of(eq - sq, ek - sk)
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, -1).nan_to_num(0.0)  # rows with no key: 0
        out[sq:eq] = (probs @ vb).transpose(0, 1)
    return out


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def packed(lengths_q, lengths_k, *, h=4, h_kv=2, d=32, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), h, d, generator=gen).to(dtype)
    k = torch.randn(sum(lengths_k), h_kv, d, generator=gen).to(dtype)
    v = torch.randn(sum(lengths_k), h_kv, d, generator=gen).to(dtype)
    return q, k, v, cu(lengths_q), cu(lengths_k)


# ---- item 2: windows measure from the bottom-right diagonal, as FlashAttention's ---------------

# Sequences with fewer queries than keys (chunked prefill), one with as many, one with more.
LENGTHS_Q, LENGTHS_K = [3, 5, 6, 4], [9, 5, 12, 2]

WINDOWS = {
    "left-only": dict(window_size=(2, -1)),
    "left-right0": dict(window_size=(2, 0)),
    "left-right0-causal-false": dict(window_size=(2, 0), causal=False),
    "left-causal": dict(window_size=(3, -1), causal=True),
    "band": dict(window_size=(1, 2)),
    "right-only": dict(window_size=(-1, 3)),
    "causal-overrides-right": dict(window_size=(2, 5), causal=True),
    "causal-alone": dict(causal=True),
}


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("case", WINDOWS, ids=list(WINDOWS))
def test_varlen_window_is_flash_attention_bottom_right(case, softcap):
    """With softcap the capped scores take each sequence's own bottom-right band (the modifier
    reads every sequence's S_kv - S_q; it was refused)."""
    options = WINDOWS[case]
    left, right = options.get("window_size", (-1, -1))
    causal = bool(options.get("causal"))
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K, seed=11)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = cudnn_attn.varlen_sdpa(*leaves, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K), softcap=softcap, **options)
    refs = [x.double().requires_grad_() for x in (q, k, v)]
    expected = varlen_oracle(
        *refs, cu_q, cu_k, 32**-0.5, lambda s_q, s_k: flash_window_mask(s_q, s_k, left, right, causal), softcap
    )
    assert rel_err(out, expected) < TOLERANCE[torch.bfloat16]
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(12)).to(out.dtype)
    out.backward(d_out)
    expected.backward(d_out.double())
    for got, want in zip(leaves, refs):
        assert rel_err(got.grad, want.grad) < 2 * TOLERANCE[torch.bfloat16]


def test_varlen_window_means_the_same_with_causal_false_written_out():
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K, seed=13)
    implicit = cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, 6, 12, window_size=(2, 0))
    explicit = cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, 6, 12, window_size=(2, 0), causal=False)
    assert torch.equal(implicit, explicit)


def test_varlen_takes_flash_attentions_numpy_scalars_and_empty_key_sequences():
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K, seed=14)
    longest_q, longest_k = np.array(LENGTHS_Q).max(), np.array(LENGTHS_K).max()  # NumPy ints
    got = cudnn_attn.varlen_sdpa(
        q, k, v, cu_q, cu_k, longest_q, longest_k, softcap=np.float32(20), window_size=(np.int64(2), -1)
    )
    assert torch.equal(got, cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, 6, 12, softcap=20.0, window_size=(2, -1)))
    none = cu([0, 0, 0, 0])  # max_seqlen_k=0: every key sequence empty, FlashAttention's zeros
    assert torch.equal(cudnn_attn.varlen_sdpa(q, k, v, cu_q, none, 6, 0), torch.zeros_like(q))


def test_a_generous_max_seqlen_on_host_lengths_computes_over_the_longest_sequence():
    """FlashAttention's callers often pass the model's longest length: on host cu_seqlens the
    tile spans the longest sequence (a 12-token call at 32768 took minutes on the reference)."""
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K, seed=16)
    generous = cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, 32768, 32768, causal=True)
    assert torch.equal(generous, cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, 6, 12, causal=True))


def test_varlen_names_v_with_other_heads_than_k():
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K, seed=15)
    with pytest.raises(ValidationError, match="v: 1 heads differ from k's 2"):
        cudnn_attn.varlen_sdpa(q, k, v[:, :1], cu_q, cu_k, 6, 12)


# ---- item 4: k and v token counts checked on every call ---------------------------------------


@pytest.mark.parametrize("tokens", [30, 20], ids=["longer-v", "shorter-v"])
def test_varlen_k_v_token_counts_checked_after_a_warm_call(tokens):
    cu_seq = torch.tensor([0, 5, 16, 24], dtype=torch.int32)
    gen = torch.Generator().manual_seed(15)
    q = torch.randn(24, 8, 64, generator=gen).bfloat16()
    k, v = (torch.randn(24, 2, 64, generator=gen).bfloat16() for _ in range(2))
    cudnn_attn.varlen_sdpa(q, k, v, cu_seq, cu_seq, 11, 11)  # the geometry's plan is now warm
    bad_v = torch.randn(tokens, 2, 64, generator=gen).bfloat16()
    with pytest.raises((ValidationError, ShapeMismatchError), match=f"v: {tokens} tokens differ from k's 24"):
        cudnn_attn.varlen_sdpa(q, k, bad_v, cu_seq, cu_seq, 11, 11)


# ---- item 11: ragged offsets bounded by each sequence's length --------------------------------


def test_ragged_offset_past_b_minus_1_strides_runs_when_the_sequence_fits():
    """B = 2, S = 8: sequence 1 (3 tokens) starts at token 9 and ends at token 12, inside the
    16-token buffers of q, k, v and O; sequence 0 (5 tokens) starts at 0."""
    b, h, s, d, lengths, starts = 2, 2, 8, 16, [5, 3], [0, 9]
    gen = torch.Generator().manual_seed(16)

    def placed(values: bool) -> ragged_cases.Ragged:
        view = torch.full((b * s * h * d,), float("nan"), dtype=torch.float16).as_strided(
            (b, h, s, d), (s * h * d, d, h * d, 1)
        )
        offsets = torch.tensor([*(t * h * d for t in starts), 12 * h * d], dtype=torch.int64).view(-1, 1, 1, 1)
        r = ragged_cases.Ragged(view, offsets, starts, lengths)
        for i, n in enumerate(lengths):
            if values:
                r.rows(i).copy_(torch.randn(h, n, d, generator=gen).half())
        return r

    q, k, v, o = placed(True), placed(True), placed(True), placed(False)
    seq = torch.tensor(lengths, dtype=torch.int32).view(-1, 1, 1, 1)
    g = cudnn.pygraph(
        io_data_type=cudnn.data_type.HALF,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
    )
    handles, pack = {}, {}
    for name, t in (("q", q), ("k", k), ("v", v)):
        handles[name], offsets = g.tensor_like(t.view), g.tensor_like(t.offsets)
        handles[name].set_ragged_offset(offsets)
        pack.update({handles[name]: t.view, offsets: t.offsets})
    sq, skv = g.tensor_like(seq), g.tensor_like(seq)
    out, _ = g.sdpa(
        q=handles["q"],
        k=handles["k"],
        v=handles["v"],
        is_inference=True,
        attn_scale=d**-0.5,
        use_padding_mask=True,
        seq_len_q=sq,
        seq_len_kv=skv,
    )
    o_offsets = g.tensor_like(o.offsets)
    out.set_output(True).set_dim(list(o.view.shape)).set_stride(list(o.view.stride())).set_ragged_offset(o_offsets)
    pack.update({sq: seq, skv: seq, out: o.view, o_offsets: o.offsets})
    ragged_cases.build_and_run(g, cudnn, pack, "cpu")
    for i in range(b):
        qb, kb, vb = (t.rows(i).double() for t in (q, k, v))
        expected = torch.softmax((qb @ kb.transpose(1, 2)) * d**-0.5, -1) @ vb
        assert rel_err(o.rows(i), expected) < TOLERANCE[torch.float16]
    assert o.untouched(), "O written outside its sequences' rows"


def test_ragged_offset_whose_sequence_ends_past_the_tensor_is_refused_by_name():
    b, h, s, d = 2, 2, 8, 16
    q = torch.randn(b, h, s, d, generator=torch.Generator().manual_seed(17)).half()
    lengths = torch.tensor([3, 8], dtype=torch.int32).view(-1, 1, 1, 1)
    # Sequence 1 has 8 rows: starting at token 9 of 16 it would end past the tensor.
    offsets = torch.tensor([0, 9 * h * d, 17 * h * d], dtype=torch.int64).view(-1, 1, 1, 1)
    g = cudnn.pygraph(io_data_type=cudnn.data_type.HALF)
    tq = g.tensor_like(q)
    tq.set_ragged_offset(g.tensor_like(offsets))
    g.sdpa(
        q=tq,
        k=g.tensor_like(q),
        v=g.tensor_like(q),
        is_inference=True,
        use_padding_mask=True,
        seq_len_q=g.tensor_like(lengths),
        seq_len_kv=g.tensor_like(lengths),
    )
    with pytest.raises(cudnn.ValidationError, match=r"q.ragged_offset: offsets \[288\] out of range"):
        g.build()


# ---- item 12: page-table padding in slots no sequence reads -----------------------------------


def paged_oracle(q, k_cache, v_cache, table, lengths, scale):
    """float64 decode attention of each sequence over its cache's first ``lengths[b]`` tokens
    (NHPD pages, read through ``table``), GQA by head groups; several queries are bottom-right causal."""
    batch, h_q, s_q, _ = q.shape
    h_kv, page = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(batch, h_q, s_q, v_cache.shape[-1], dtype=torch.float64)
    for b in range(batch):
        n = int(lengths[b])
        pages = table[b, : -(-n // page)].long()
        keys, values = (
            c[pages].double().permute(1, 0, 2, 3).reshape(h_kv, -1, c.shape[-1])[:, :n] for c in (k_cache, v_cache)
        )
        keys, values = (x.repeat_interleave(h_q // h_kv, 0) for x in (keys, values))
        scores = (q[b].double() @ keys.transpose(1, 2)) * scale
        allowed = flash_window_mask(s_q, n, -1, 0, True)
        out[b] = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ values
    return out


@pytest.mark.parametrize("padding", [-1, 99], ids=["negative", "past-the-cache"])
def test_paged_cpu_takes_padding_in_slots_no_sequence_reads(padding):
    gen = torch.Generator().manual_seed(18)
    bf = torch.bfloat16
    attn = cudnn_attn.PagedAttention(4, 2, 16, 4, dtype=bf)
    k_cache, v_cache = (torch.randn(6, 2, 4, 16, generator=gen).to(bf) for _ in range(2))
    table = torch.tensor([[0, 1, padding, padding], [2, 3, 4, padding]], dtype=torch.int32)
    lengths = torch.tensor([7, 10], dtype=torch.int32)
    q = torch.randn(2, 4, 2, 16, generator=gen).to(bf)
    attn.plan(table, lengths)
    out = attn.run(q, k_cache, v_cache)
    assert torch.equal(table[:, 2:], torch.tensor([[padding, padding], [4, padding]], dtype=torch.int32))  # unwritten
    expected = paged_oracle(q, k_cache, v_cache, table.clamp(min=0), lengths, 16**-0.5)
    assert rel_err(out, expected) < TOLERANCE[bf]


def test_paged_cpu_still_refuses_a_bad_page_a_sequence_reads():
    bf = torch.bfloat16
    attn = cudnn_attn.PagedAttention(4, 2, 16, 4, dtype=bf)
    k_cache, v_cache = (torch.randn(6, 2, 4, 16, generator=torch.Generator().manual_seed(19)).to(bf) for _ in range(2))
    lengths = torch.tensor([7, 10], dtype=torch.int32)
    with pytest.raises(ValidationError, match=r"page_table: page -1 at \[0, 1\] is negative"):
        attn.plan(torch.tensor([[0, -1, -1, -1], [2, 3, 4, -1]], dtype=torch.int32), lengths)
    attn.plan(torch.tensor([[0, 1, -1, -1], [2, 3, 9, -1]], dtype=torch.int32), lengths)
    q = torch.randn(2, 4, 1, 16).to(bf)
    with pytest.raises(ValidationError, match="page_table: sequence 1, entry 2 is page 9; the cache has 6 pages"):
        attn.run(q, k_cache, v_cache)


def test_the_paged_graph_on_the_cpu_takes_padding_in_the_slots_no_sequence_reads():
    """The Graph's paged node takes the tables PagedAttention takes (-1 or a page past the cache
    past a sequence's length), as a GPU does; a bad page a sequence reads is still refused."""
    gen = torch.Generator().manual_seed(24)
    k_cache, v_cache = (torch.randn(6, 2, 4, 16, generator=gen) for _ in range(2))  # NHPD, as the oracle reads
    q = torch.randn(2, 4, 1, 16, generator=gen)
    lengths = torch.tensor([7, 10], dtype=torch.int32)
    table = torch.tensor([[0, 1, -1, -1], [2, 3, 4, 99]], dtype=torch.int32)
    with cudnn_attn.Graph() as g:
        g.sdpa_with_paged_cache(q, k_cache, v_cache, table, seq_len_kv=lengths, kv_cache_layout="NHPD")
    expected = paged_oracle(q, k_cache, v_cache, table.clamp(0, 5), lengths, 16**-0.5)
    assert rel_err(g(q, k_cache, v_cache, table, lengths), expected) < TOLERANCE[torch.float32]
    with pytest.raises(ValidationError, match=r"page_table_k: page indices \[-1\] out of range"):
        g(q, k_cache, v_cache, torch.tensor([[0, -1, 5, 5], [2, 3, 4, 99]], dtype=torch.int32), lengths)


@pytest.mark.parametrize("given", ["page_table", "seq_lens_kv", "q_lens"])
def test_plan_names_an_argument_that_is_not_a_tensor(given):
    attn = cudnn_attn.PagedAttention(4, 2, 16, 4, dtype=torch.bfloat16)
    arguments = {"page_table": torch.tensor([[0, 1]], dtype=torch.int32), "seq_lens_kv": torch.tensor([3]).int()}
    arguments[given] = [1]
    with pytest.raises(ValidationError, match=f"{given}: list; expected an int32 tensor"):
        attn.plan(arguments["page_table"], arguments["seq_lens_kv"], q_lens=arguments.get("q_lens"))


# ---- GPU: the same windows lowered to cuDNN, against the reference ---------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("case", WINDOWS, ids=list(WINDOWS))
def test_gpu_varlen_bottom_right_window_matches_the_oracle(case):
    options = WINDOWS[case]
    left, right = options.get("window_size", (-1, -1))
    causal = bool(options.get("causal"))
    q, k, v, cu_q, cu_k = packed(LENGTHS_Q, LENGTHS_K, seed=21)
    leaves = [x.cuda().requires_grad_() for x in (q, k, v)]
    with cudnn_attn.backend("cudnn"):
        out = cudnn_attn.varlen_sdpa(*leaves, cu_q.cuda(), cu_k.cuda(), 6, 12, **options)
        d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(22)).to(out)
        out.backward(d_out)
    refs = [x.double().requires_grad_() for x in (q, k, v)]
    expected = varlen_oracle(
        *refs, cu_q, cu_k, 32**-0.5, lambda s_q, s_k: flash_window_mask(s_q, s_k, left, right, causal)
    )
    assert rel_err(out, expected) < TOLERANCE[torch.bfloat16]
    expected.backward(d_out.double().cpu())
    for got, want in zip(leaves, refs):
        assert rel_err(got.grad, want.grad) < 2 * TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_varlen_softcap_with_per_sequence_bottom_right_bands_names_cudnns_limit():
    q, k, v, cu_q, cu_k = (x.cuda() for x in packed(LENGTHS_Q, LENGTHS_K, seed=26))
    with pytest.raises(cudnn_attn.UnsupportedError, match="misreads score_mod tensors that vary by batch"):
        with cudnn_attn.backend("cudnn"):
            cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, 6, 12, causal=True, softcap=20.0)
    with cudnn_attn.backend("reference"):  # what the refusal offers, on the same CUDA tensors
        out = cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, 6, 12, causal=True, softcap=20.0)
    mask = lambda s_q, s_k: flash_window_mask(s_q, s_k, -1, 0, True)  # noqa: E731
    expected = varlen_oracle(*(x.cpu() for x in (q, k, v)), cu_q.cpu(), cu_k.cpu(), 32**-0.5, mask, 20.0)
    assert rel_err(out.cpu(), expected) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_paged_takes_the_same_padded_table_as_the_cpu():
    gen = torch.Generator().manual_seed(23)
    bf = torch.bfloat16
    k_cache, v_cache = (torch.randn(6, 2, 4, 16, generator=gen).to(bf) for _ in range(2))
    table = torch.tensor([[0, 1, -1, -1], [2, 3, 4, 99]], dtype=torch.int32)
    lengths = torch.tensor([7, 10], dtype=torch.int32)
    q = torch.randn(2, 4, 1, 16, generator=gen).to(bf)
    results = []
    for device in ("cpu", "cuda"):
        attn = cudnn_attn.PagedAttention(4, 2, 16, 4, dtype=bf, device=device)
        attn.plan(table.to(device), lengths.to(device))
        results.append(attn.run(q.to(device), k_cache.to(device), v_cache.to(device)).cpu())
    expected = paged_oracle(q, k_cache, v_cache, table.clamp(0, 5), lengths, 16**-0.5)
    for out in results:
        assert rel_err(out, expected) < TOLERANCE[bf]
