"""Frontend-form ragged cases: 4-D tensors whose sequences the caller places with ragged offsets
(``set_ragged_offset``), recorded with any module that speaks the frontend's graph API, so one
case runs through cudnn_attn (either backend) and through the real frontend on a GPU.

Every element outside a sequence's real rows is NaN, in inputs (a read of it shows in the
results) and in outputs (a write to it shows as a missing NaN).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import oracle
import torch

NAN = float("nan")


@dataclass
class Ragged:
    """A ``[B, H, S, D]`` view (BSHD strides) over one flat buffer; sequence b's rows start at
    token ``starts[b]``, i.e. element ``offsets[b]``; ``lengths[b]`` rows are real."""

    view: torch.Tensor
    offsets: torch.Tensor  # int64 [B + 1, 1, 1, 1]
    starts: list[int]
    lengths: list[int]

    def rows(self, b: int) -> torch.Tensor:
        """Sequence b's real rows as [H, len, D], a view into the buffer."""
        _, h, _, d = self.view.shape
        flat = self.view.as_strided((self.view.numel(),), (1,), self.view.storage_offset())
        start, n = self.starts[b], self.lengths[b]
        return flat[start * h * d : (start + n) * h * d].view(n, h, d).transpose(0, 1)

    def dense(self) -> torch.Tensor:
        """[B, H, S, D] float64: each sequence's rows, 0 past its end."""
        b, h, s, d = self.view.shape
        out = torch.zeros(b, h, s, d, dtype=torch.float64)
        for i in range(b):
            out[i, :, : self.lengths[i]] = self.rows(i).double().cpu()
        return out

    def untouched(self) -> bool:
        """Whether every element outside the real rows still holds NaN."""
        mask = torch.ones(self.view.numel(), dtype=torch.bool)
        _, h, _, d = self.view.shape
        for start, n in zip(self.starts, self.lengths):
            mask[start * h * d : (start + n) * h * d] = False
        flat = self.view.as_strided((self.view.numel(),), (1,), self.view.storage_offset())
        return bool(torch.isnan(flat.float().cpu()[mask]).all())


def place(
    lengths: list[int],
    h: int,
    s: int,
    d: int,
    *,
    dtype: torch.dtype,
    device: str,
    gap: int = 0,
    reverse: bool = False,
    values: torch.Tensor | None = None,
    gen: torch.Generator | None = None,
) -> Ragged:
    """Sequences packed in order (``reverse``: last first), ``gap`` unused tokens after each; real
    rows random (or ``values``' [B, H, S, D] rows, None: left NaN as an output buffer)."""
    b = len(lengths)
    starts, token = [0] * b, 0
    for i in reversed(range(b)) if reverse else range(b):
        starts[i], token = token, token + lengths[i] + gap
    assert token <= b * s, "the sequences and gaps must fit in B * S tokens"
    view = torch.full((b * s * h * d,), NAN, dtype=dtype, device=device).as_strided(
        (b, h, s, d), (s * h * d, d, h * d, 1)
    )
    offsets = torch.tensor([*(t * h * d for t in starts), token * h * d], dtype=torch.int64, device=device)
    ragged = Ragged(view, offsets.view(-1, 1, 1, 1), starts, list(lengths))
    for i, n in enumerate(lengths):
        if values is not None:
            ragged.rows(i).copy_(values[i, :, :n])
        elif gen is not None:
            ragged.rows(i).copy_(torch.randn(h, n, d, generator=gen).to(dtype))
    return ragged


def padded(
    lengths: list[int], h: int, s: int, d: int, *, dtype: torch.dtype, device: str, gen: torch.Generator | None = None
) -> torch.Tensor:
    """A dense BSHD [B, H, S, D] tensor, random rows within each length (None: all NaN). Past the
    lengths: NaN in outputs; in inputs 1000, finite, since cuDNN 9.19 reads the K/V rows past
    seq_len_kv beside a ragged q (the frontend alike); a row read with any weight shows."""
    b = len(lengths)
    t = torch.full((b, s, h, d), NAN if gen is None else 1000.0, dtype=dtype).permute(0, 2, 1, 3)
    if gen is not None:
        for i, n in enumerate(lengths):
            t[i, :, :n] = torch.randn(h, n, d, generator=gen).to(dtype)
    return t.to(device)


def _dense(t: torch.Tensor | Ragged, lengths: list[int]) -> torch.Tensor:
    if isinstance(t, Ragged):
        return t.dense()
    out = t.double().cpu().clone()
    for i, n in enumerate(lengths):
        out[i, :, n:] = 0
    return out


def lengths_tensor(lengths: list[int], device: str) -> torch.Tensor:
    return torch.tensor(lengths, dtype=torch.int32, device=device).view(-1, 1, 1, 1)


def build_and_run(graph: Any, mod: Any, pack: dict, device: str) -> None:
    """The frontend's build steps and execute, as its tests spell them."""
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([mod.heur_mode.A, mod.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    workspace = torch.empty(graph.get_workspace_size(), device=device, dtype=torch.uint8)
    graph.execute(pack, workspace)
    if device != "cpu":
        torch.cuda.synchronize()


def forward(
    mod: Any,
    *,
    lengths_q: list[int],
    lengths_kv: list[int],
    h: int = 2,
    s_q: int = 16,
    s_kv: int = 16,
    d: int = 32,
    dtype: torch.dtype = torch.float16,
    device: str = "cpu",
    ragged: tuple[str, ...] = ("q", "k", "v", "o"),
    gap: int = 0,
    reverse: bool = False,
    causal: bool = False,
    stats: str | None = None,
    seed: int = 0,
    **graph_options: Any,
) -> dict[str, Any]:
    """One sdpa forward with the tensors in ``ragged`` placed by offsets (the others padded BSHD);
    ``stats``: None, "dense" or "ragged". Returns the results, the expected ones and the buffers."""
    gen = torch.Generator().manual_seed(seed)
    scale = d**-0.5
    make = {"q": (lengths_q, s_q), "k": (lengths_kv, s_kv), "v": (lengths_kv, s_kv)}
    tensors: dict[str, Any] = {}
    for role, (lengths, s) in make.items():
        if role in ragged:
            tensors[role] = place(lengths, h, s, d, dtype=dtype, device=device, gap=gap, reverse=reverse, gen=gen)
        else:
            tensors[role] = padded(lengths, h, s, d, dtype=dtype, device=device, gen=gen)
    if "o" in ragged:
        tensors["o"] = place(lengths_q, h, s_q, d, dtype=dtype, device=device, gap=gap, reverse=reverse)
    else:
        tensors["o"] = padded(lengths_q, h, s_q, d, dtype=dtype, device=device)
    if stats == "ragged":
        tensors["stats"] = place(lengths_q, h, s_q, 1, dtype=torch.float32, device=device, gap=gap, reverse=reverse)
    elif stats == "dense":
        tensors["stats"] = torch.full((len(lengths_q), h, s_q, 1), NAN, device=device)

    def data(role: str) -> torch.Tensor:
        t = tensors[role]
        return t.view if isinstance(t, Ragged) else t

    g = mod.pygraph(
        io_data_type=_io(mod, dtype),
        intermediate_data_type=mod.data_type.FLOAT,
        compute_data_type=mod.data_type.FLOAT,
        **graph_options,
    )
    handles = {role: g.tensor_like(data(role)) for role in ("q", "k", "v")}
    seq_q, seq_kv = lengths_tensor(lengths_q, device), lengths_tensor(lengths_kv, device)
    pack: dict[Any, torch.Tensor] = {}
    offsets = {}
    for role, t in tensors.items():
        if isinstance(t, Ragged):
            offsets[role] = g.tensor_like(t.offsets)
            pack[offsets[role]] = t.offsets
    for role in ("q", "k", "v"):
        if role in offsets:
            handles[role].set_ragged_offset(offsets[role])
    sq, skv = g.tensor_like(seq_q), g.tensor_like(seq_kv)
    o, st = g.sdpa(
        name="sdpa",
        q=handles["q"],
        k=handles["k"],
        v=handles["v"],
        generate_stats=stats is not None,
        attn_scale=scale,
        use_padding_mask=True,
        seq_len_q=sq,
        seq_len_kv=skv,
        use_causal_mask=causal,
    )
    o.set_output(True).set_dim(list(data("o").shape)).set_stride(list(data("o").stride()))
    if "o" in offsets:
        o.set_ragged_offset(offsets["o"])
    pack.update({handles[r]: data(r) for r in ("q", "k", "v")})
    pack.update({sq: seq_q, skv: seq_kv, o: data("o")})
    if stats is not None:
        st.set_output(True).set_data_type(mod.data_type.FLOAT)
        st.set_dim(list(data("stats").shape)).set_stride(list(data("stats").stride()))
        if "stats" in offsets:
            st.set_ragged_offset(offsets["stats"])
        pack[st] = data("stats")
    build_and_run(g, mod, pack, device)

    dense = {role: _dense(tensors[role], lengths) for role, (lengths, _) in make.items()}
    o_ref, lse_ref = oracle.attention(
        dense["q"],
        dense["k"],
        dense["v"],
        scale=scale,
        seq_q=lengths_q,
        seq_kv=lengths_kv,
        causal="top_left" if causal else None,
    )
    result = {"o": _dense(tensors["o"], lengths_q)}
    expected = {"o": _dense(o_ref, lengths_q)}
    if stats is not None:
        result["stats"] = _dense(tensors["stats"], lengths_q)
        expected["stats"] = _dense(lse_ref, lengths_q)
    return {"result": result, "expected": expected, "tensors": tensors}


def backward(
    mod: Any,
    *,
    lengths_q: list[int],
    lengths_kv: list[int],
    h: int = 2,
    s_q: int = 16,
    s_kv: int = 16,
    d: int = 32,
    dtype: torch.dtype = torch.float16,
    device: str = "cpu",
    gap: int = 0,
    reverse: bool = False,
    causal: bool = False,
    seed: int = 0,
    **graph_options: Any,
) -> dict[str, Any]:
    """One sdpa_backward with q, k, v, o, dO, dQ, dK, dV placed by offsets (o and dO sharing
    theirs, each gradient its input's, as the frontend's test does); stats dense."""
    gen = torch.Generator().manual_seed(seed)
    scale = d**-0.5
    b = len(lengths_q)
    kw = dict(dtype=dtype, device=device, gap=gap, reverse=reverse)
    q, k, v = (place(n, h, s, d, gen=gen, **kw) for n, s in ((lengths_q, s_q), (lengths_kv, s_kv), (lengths_kv, s_kv)))
    dense = {name: t.dense().requires_grad_() for name, t in (("q", q), ("k", k), ("v", v))}
    allowed = oracle.allowed_matrix(
        b, s_q, s_kv, causal="top_left" if causal else None, seq_q=lengths_q, seq_kv=lengths_kv
    )
    out = oracle.attention_autograd(dense["q"], dense["k"], dense["v"], scale=scale, allowed=allowed)
    _, lse = oracle.attention(
        *(dense[n].detach() for n in "qkv"),
        scale=scale,
        seq_q=lengths_q,
        seq_kv=lengths_kv,
        causal="top_left" if causal else None,
    )
    grad_out = torch.randn(b, h, s_q, d, generator=gen, dtype=torch.float64)
    for i, n in enumerate(lengths_q):
        grad_out[i, :, n:] = 0
    out.backward(grad_out)
    o = place(lengths_q, h, s_q, d, values=out.detach().to(dtype), **kw)
    d_o = place(lengths_q, h, s_q, d, values=grad_out.to(dtype), **kw)
    d_o.offsets = o.offsets  # one offsets tensor for both, as the frontend's test passes it
    stats = lse.float().nan_to_num(neginf=0.0).to(device)
    grads = {
        name: place(n, h, s, d, **kw)
        for name, n, s in (("dQ", lengths_q, s_q), ("dK", lengths_kv, s_kv), ("dV", lengths_kv, s_kv))
    }

    g = mod.pygraph(
        io_data_type=_io(mod, dtype),
        intermediate_data_type=mod.data_type.FLOAT,
        compute_data_type=mod.data_type.FLOAT,
        **graph_options,
    )
    t = {name: g.tensor_like(x.view) for name, x in (("q", q), ("k", k), ("v", v), ("o", o), ("dO", d_o))}
    offsets = {name: g.tensor_like(x.offsets) for name, x in (("q", q), ("k", k), ("v", v), ("o", o))}
    for name, key in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "o"), ("dO", "o")):
        t[name].set_ragged_offset(offsets[key])
    stats_t = g.tensor_like(stats)
    seq_q, seq_kv = lengths_tensor(lengths_q, device), lengths_tensor(lengths_kv, device)
    sq, skv = g.tensor_like(seq_q), g.tensor_like(seq_kv)
    d_q, d_k, d_v = g.sdpa_backward(
        name="sdpa_backward",
        q=t["q"],
        k=t["k"],
        v=t["v"],
        o=t["o"],
        dO=t["dO"],
        stats=stats_t,
        attn_scale=scale,
        use_padding_mask=True,
        seq_len_q=sq,
        seq_len_kv=skv,
        use_causal_mask=causal,
    )
    for handle, name, key in ((d_q, "dQ", "q"), (d_k, "dK", "k"), (d_v, "dV", "v")):
        view = grads[name].view
        handle.set_output(True).set_dim(list(view.shape)).set_stride(list(view.stride()))
        handle.set_ragged_offset(offsets[key])
    pack = {t[n]: x.view for n, x in (("q", q), ("k", k), ("v", v), ("o", o), ("dO", d_o))}
    pack.update({offsets[n]: x.offsets for n, x in (("q", q), ("k", k), ("v", v), ("o", o))})
    pack.update(
        {stats_t: stats, sq: seq_q, skv: seq_kv, d_q: grads["dQ"].view, d_k: grads["dK"].view, d_v: grads["dV"].view}
    )
    build_and_run(g, mod, pack, device)
    expected = {"dQ": dense["q"].grad, "dK": dense["k"].grad, "dV": dense["v"].grad}
    return {"result": {n: x.dense() for n, x in grads.items()}, "expected": expected, "tensors": grads}


def packed_page_tables(mod: Any, *, device: str = "cpu", seed: int = 0, **graph_options: Any) -> dict[str, Any]:
    """Decode over paged caches whose page tables are packed back to back ([B, 1, pages, 1] with
    ragged offsets, notebook 53's form); entries no sequence needs hold -1."""
    gen = torch.Generator().manual_seed(seed)
    b, h, d, page, s_kv = 3, 2, 32, 4, 16
    lengths = [7, 16, 1]
    k, v = (torch.randn(b, h, s_kv, d, generator=gen).half() for _ in range(2))
    q = torch.randn(b, h, 1, d, generator=gen).half()
    pages_per_seq = s_kv // page
    # Page j of sequence i is cache entry i * pages_per_seq + j, as [pages, H, page_size, D].
    k_cache, v_cache = (
        x.view(b, h, pages_per_seq, page, d).permute(0, 2, 1, 3, 4).reshape(-1, h, page, d) for x in (k, v)
    )
    used = [-(-n // page) for n in lengths]
    starts = [sum(used[:i]) for i in range(b)]
    packed = torch.full((b * pages_per_seq,), -1, dtype=torch.int32)
    for i in range(b):
        packed[starts[i] : starts[i] + used[i]] = torch.arange(used[i]) + i * pages_per_seq
    table = packed.to(device).as_strided((b, 1, pages_per_seq, 1), (pages_per_seq, pages_per_seq, 1, 1))
    offsets = torch.tensor([*starts, sum(used)], dtype=torch.int32, device=device).view(-1, 1, 1, 1)
    seq_q, seq_kv = lengths_tensor([1] * b, device), lengths_tensor(lengths, device)
    q, k_cache, v_cache = q.to(device), k_cache.to(device), v_cache.to(device)

    g = mod.pygraph(
        io_data_type=mod.data_type.HALF,
        intermediate_data_type=mod.data_type.FLOAT,
        compute_data_type=mod.data_type.FLOAT,
        **graph_options,
    )
    tq, tk, tv = g.tensor_like(q), g.tensor_like(k_cache), g.tensor_like(v_cache)
    tables = [g.tensor_like(table), g.tensor_like(table)]
    table_offsets = [g.tensor_like(offsets), g.tensor_like(offsets)]
    for t, o in zip(tables, table_offsets):
        t.set_ragged_offset(o)
    sq, skv = g.tensor_like(seq_q), g.tensor_like(seq_kv)
    o, _ = g.sdpa(
        name="sdpa",
        q=tq,
        k=tk,
        v=tv,
        is_inference=True,
        attn_scale=d**-0.5,
        use_padding_mask=True,
        seq_len_q=sq,
        seq_len_kv=skv,
        paged_attention_k_table=tables[0],
        paged_attention_v_table=tables[1],
        paged_attention_max_seq_len_kv=s_kv,
    )
    o.set_output(True).set_dim(list(q.shape)).set_stride(list(q.stride()))
    out = torch.full_like(q, NAN)
    build_and_run(
        g,
        mod,
        {
            tq: q,
            tk: k_cache,
            tv: v_cache,
            tables[0]: table,
            tables[1]: table,
            table_offsets[0]: offsets,
            table_offsets[1]: offsets,
            sq: seq_q,
            skv: seq_kv,
            o: out,
        },
        device,
    )
    expected, _ = oracle.attention(q.cpu(), k, v, scale=d**-0.5, seq_kv=lengths)
    return {"result": out.double().cpu(), "expected": expected}


def _io(mod: Any, dtype: torch.dtype) -> Any:
    names = {torch.float16: "HALF", torch.bfloat16: "BFLOAT16", torch.float32: "FLOAT"}
    return getattr(mod.data_type, names[dtype])
