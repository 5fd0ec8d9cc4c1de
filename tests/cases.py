"""The feature grid shared by the GPU suite (cuDNN vs the reference) and the CPU lowering tests.

A ``Case`` makes fresh random inputs for one attention configuration and records the same
graph on any backend, so two backends can be run on identical tensors and compared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

import cudnn_attn


@dataclass(frozen=True)
class Case:
    b: int = 2
    h_q: int = 8
    h_kv: int = 8
    s_q: int = 128
    s_kv: int = 128
    d_qk: int = 64
    d_v: int = 64
    dtype: torch.dtype = torch.bfloat16
    layout: str = "BHSD"  # BHSD | BSHD | SBHD
    options: tuple = ()  # (keyword, value) pairs for sdpa/sdpa_backward
    bias: tuple[int, ...] | None = None
    padding: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    backward: bool = True
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def id(self) -> str:
        parts = [
            str(self.dtype).removeprefix("torch."),
            self.layout,
            f"b{self.b}h{self.h_q}-{self.h_kv}",
            f"s{self.s_q}x{self.s_kv}",
            f"d{self.d_qk}-{self.d_v}",
        ]
        parts += [f"{k}={v}" for k, v in self.options]
        if self.bias:
            parts.append("bias" + "x".join(map(str, self.bias)))
        if self.padding:
            parts.append("padding")
        return "-".join(parts)


def paged_cache(dense: torch.Tensor, page_size: int, layout: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter a dense [B, H, S, D] cache into shuffled pages (random garbage in unused
    slots and spare pages); returns (cache in ``layout``, page table [B, pages] int32)."""
    gen = torch.Generator().manual_seed(seed)
    b, h, s, d = dense.shape
    per_seq = -(-s // page_size)
    total = b * per_seq + 3
    order = torch.randperm(total, generator=gen)[: b * per_seq].view(b, per_seq)
    cache = torch.randn(total, page_size, h, d, generator=gen).to(device=dense.device, dtype=dense.dtype)
    for bi in range(b):
        for p in range(per_seq):
            chunk = dense[bi, :, p * page_size : (p + 1) * page_size].transpose(0, 1)
            cache[order[bi, p], : chunk.shape[0]] = chunk
    if layout == "NHPD":
        cache = cache.transpose(1, 2).contiguous()
    return cache, order.to(device=dense.device, dtype=torch.int32)


def _layout(b, h, s, d, layout, dtype, device, gen):
    make = {"BHSD": (b, h, s, d), "BSHD": (b, s, h, d), "SBHD": (s, b, h, d)}[layout]
    x = torch.randn(*make, generator=gen, device="cpu").to(device=device, dtype=dtype)
    return {"BHSD": x, "BSHD": x.transpose(1, 2), "SBHD": x.permute(1, 2, 0, 3)}[layout]


def make_inputs(case: Case, device: str, seed: int = 0) -> dict[str, Any]:
    """Fresh random inputs (never zeros) for ``case`` on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    if case.layout == "BS3HD":  # packed QKV: q, k, v are views of one [B, S, 3, H, D] tensor
        assert case.h_q == case.h_kv and case.s_q == case.s_kv and case.d_qk == case.d_v
        qkv = torch.randn(case.b, case.s_q, 3, case.h_q, case.d_qk, generator=gen).to(device=device, dtype=case.dtype)
        t = {name: qkv[:, :, i].transpose(1, 2) for i, name in enumerate("qkv")}
        t["d_o"] = _layout(case.b, case.h_q, case.s_q, case.d_v, "BSHD", case.dtype, device, gen)
    else:
        t = _dense_inputs(case, device, gen)
    if case.bias:
        t["attn_bias"] = torch.randn(*case.bias, generator=gen).to(device=device, dtype=case.dtype)
    if case.padding:
        t["seq_len_q"] = torch.tensor(case.padding[0], dtype=torch.int32, device=device)
        t["seq_len_kv"] = torch.tensor(case.padding[1], dtype=torch.int32, device=device)
    return t


def _dense_inputs(case: Case, device: str, gen: torch.Generator) -> dict[str, Any]:
    return {
        "q": _layout(case.b, case.h_q, case.s_q, case.d_qk, case.layout, case.dtype, device, gen),
        "k": _layout(case.b, case.h_kv, case.s_kv, case.d_qk, case.layout, case.dtype, device, gen),
        "v": _layout(case.b, case.h_kv, case.s_kv, case.d_v, case.layout, case.dtype, device, gen),
        "d_o": _layout(case.b, case.h_q, case.s_q, case.d_v, case.layout, case.dtype, device, gen),
    }


def keywords(case: Case, t: dict[str, Any]) -> dict[str, Any]:
    kw = dict(case.options)
    if case.bias:
        kw["attn_bias"] = t["attn_bias"]
    if case.padding:
        kw.update(use_padding_mask=True, seq_len_q=t["seq_len_q"], seq_len_kv=t["seq_len_kv"])
    return kw


def forward_graph(case: Case, t: dict[str, Any], backend: str, cache=None) -> cudnn_attn.Graph:
    with cudnn_attn.Graph(backend=backend, cache=cache or cudnn_attn.PlanCache()) as g:
        g.sdpa(t["q"], t["k"], t["v"], generate_stats=True, **keywords(case, t))
    return g


def backward_graph(case: Case, t: dict[str, Any], o, stats, backend: str, cache=None) -> cudnn_attn.Graph:
    with cudnn_attn.Graph(backend=backend, cache=cache or cudnn_attn.PlanCache()) as g:
        g.sdpa_backward(t["q"], t["k"], t["v"], o, t["d_o"], stats, **keywords(case, t))
    return g


def extra_inputs(case: Case, t: dict[str, Any]) -> list[Any]:
    return [t[n] for n in ("attn_bias", "seq_len_q", "seq_len_kv") if n in t]


def valid_rows(case: Case) -> torch.Tensor | None:
    """Bool [B, 1, S_q, 1]: rows whose output is defined (padding masks rows past seq_len_q)."""
    if not case.padding:
        return None
    rows = torch.arange(case.s_q).view(1, 1, -1, 1)
    return rows < torch.tensor(case.padding[0]).view(-1, 1, 1, 1)


FEATURE_GRID = [
    # dtype x head dim x head grouping x layout, causal, with backward
    *[
        Case(dtype=dtype, d_qk=dqk, d_v=dv, h_kv=h_kv, layout=layout, options=(("use_causal_mask", True),))
        for dtype in (torch.float16, torch.bfloat16)
        for dqk, dv in ((64, 64), (128, 128), (256, 256), (192, 128))
        for h_kv in (8, 2, 1)
        for layout in ("BHSD", "BSHD")
    ],
]

MASK_GRID = [
    Case(),
    Case(options=(("use_causal_mask", True),)),
    Case(s_q=64, options=(("use_causal_mask_bottom_right", True),)),
    Case(options=(("use_causal_mask", True), ("sliding_window_length", 32))),
    Case(s_q=96, options=(("use_causal_mask_bottom_right", True), ("sliding_window_length", 40))),
    Case(bias=(2, 8, 128, 128)),
    Case(bias=(1, 8, 128, 128)),
    Case(bias=(2, 1, 1, 128), backward=False),  # backward refused: see capabilities.py
    Case(bias=(1, 1, 128, 128), options=(("use_causal_mask", True),)),
    Case(options=(("use_causal_mask", True), ("use_alibi_mask", True))),
    Case(padding=((128, 77), (128, 100))),
    Case(padding=((128, 77), (128, 100)), options=(("use_causal_mask", True),)),
    Case(padding=((50, 77), (128, 100)), options=(("use_causal_mask_bottom_right", True),)),
    Case(options=(("attn_scale", 0.05),)),
    # odd sizes: S not a multiple of 64, S_q != S_kv, batch 1
    Case(b=1, s_q=100, s_kv=197),
    Case(b=1, s_q=100, s_kv=197, options=(("use_causal_mask", True),)),
    Case(b=3, s_q=33, s_kv=33, h_q=4, h_kv=2, layout="SBHD", options=(("use_causal_mask", True),)),
    Case(b=1, s_q=1, s_kv=257, backward=False),
    # packed QKV: one [B, S, 3, H, D] tensor, q/k/v its views
    Case(layout="BS3HD", options=(("use_causal_mask", True),)),
    Case(layout="BS3HD", dtype=torch.float16, padding=((128, 70), (128, 70))),
    Case(b=2, s_q=1, s_kv=300, h_kv=2, backward=False),
]
