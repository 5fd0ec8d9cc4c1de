"""Single-token decode over paged caches in one Triton kernel: split-KV with the query heads of a
GQA group packed, for the small batches cuDNN's paged decode leaves the GPU half idle on.

One program takes one sequence, one K/V head and one chunk of ``chunk_pages`` pages: it loads
the group's ``G`` query rows once, walks its pages through the page table, and keeps a running
softmax (max, sum, weighted V) in float32, so each K/V byte is read once for the whole group.
With one chunk per sequence it writes the normalised output directly; with several, each
chunk's normalised output and log-sum-exp go to float32 partial buffers, merged exactly by
``lse_merge.merge_partials``. As plain torch, for sequence ``b`` and query head ``h``::

    k, v = gathered_pages(b, h // G)[:length[b]]       # [L, D]
    out[b, h, 0] = softmax(q[b, h, 0] @ k.T * scale) @ v

With ``sink`` (a logit per query head, gpt-oss's attention sinks) the first chunk starts its
running softmax from the sink, one more term of the denominator weighing no value: its
log-sum-exp then carries the sink into the merge, exactly once.

Lengths and the page table must already be in range (``PagedAttention.plan`` clamps them on
the device). Needs CUDA and Triton; ``supported`` says when the kernel applies.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

from .launch import Launcher
from .lse_merge import merge_checked, split_targets

LOG2_E = 1.4426950408889634
MIN_ROWS = 16  # tl.dot needs 16 rows: smaller groups are padded


def supported(device: torch.device, page_size: int, head_dim: int) -> bool:
    """Whether the kernel runs here: a CUDA device, Triton, a power-of-two page of 16-256 tokens
    (one page is one tile of keys), a head dim up to 256."""
    return (
        device.type == "cuda"
        and 16 <= page_size <= 256
        and page_size & (page_size - 1) == 0
        and head_dim <= 256
        and _kernels() is not None
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor,
    *,
    scale: float,
    kv_layout: str,
    splits: int,
    chunk_pages: int,
    partial_o: torch.Tensor | None = None,
    partial_lse: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    tuning: dict[str, int] | None = None,
) -> torch.Tensor:
    """Decode attention of ``q`` ``[B, H_q, 1, D]`` into ``out`` (same shape, any strides).

    table: ``[B, >= splits * chunk_pages or enough for every length]`` int32 page indices;
    lengths: ``[B]`` int32; splits, chunk_pages: the split-KV layout; partial_o
    ``[B, splits, H_q, D]`` and partial_lse ``[B, splits, H_q]`` float32: persistent buffers for
    ``splits > 1`` (allocated here when not given); sink: ``[H_q]`` float32 contiguous, attention
    sinks in units of the scaled scores; tuning: the kernel's launch settings
    (``pages_per_step``, ``num_warps``, ``num_stages``) where not the defaults.
    """
    tuning = tuning or {}
    kernels = _kernels()
    assert kernels is not None, "paged_decode needs Triton (see supported())"
    batch, heads, _, dim = q.shape
    if kv_layout == "NHPD":  # [N, H_kv, P, D]
        kv_heads, page = k_cache.shape[1], k_cache.shape[2]
        stride_page, stride_head, stride_token = k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)
    else:  # "NPHD": [N, P, H_kv, D]
        kv_heads, page = k_cache.shape[2], k_cache.shape[1]
        stride_page, stride_head, stride_token = k_cache.stride(0), k_cache.stride(2), k_cache.stride(1)
    assert v_cache.stride() == k_cache.stride(), "k and v caches share one layout"
    group = heads // kv_heads
    o, (o_sb, o_ss, o_sh), lse, (l_sb, l_ss, l_sh) = split_targets(out, splits, heads, dim, partial_o, partial_lse)
    block_d = max(16, 1 << (dim - 1).bit_length())
    pages_per_step = tuning.get("pages_per_step", max(1, 128 // page))
    kernels.decode(
        (splits, kv_heads, batch), q, q.stride(0), q.stride(1), k_cache, v_cache, stride_page, stride_head, stride_token,
        table, table.stride(0), lengths, o, o_sb, o_ss, o_sh, lse, l_sb, l_ss, l_sh,
        scale * LOG2_E, chunk_pages, dim, sink if sink is not None else lengths,
        GROUP=group, BLOCK_G=max(MIN_ROWS, 1 << (group - 1).bit_length()), BLOCK_D=block_d, PAGE=page,
        BLOCK_N=page * pages_per_step, NORMALISE=splits == 1, HAS_SINK=sink is not None,
        num_warps=tuning.get("num_warps", 4 if block_d <= 128 else 8), num_stages=tuning.get("num_stages", 3),
    )  # fmt: skip
    if splits > 1:
        merge_checked([(o.unsqueeze(3), lse.unsqueeze(3))], out)
    return out


@functools.cache
def _kernels() -> Any:
    """The Triton kernel, compiled on first use; None without Triton."""
    if importlib.util.find_spec("triton") is None:
        return None
    import types

    import triton
    import triton.language as tl

    @triton.jit
    def decode(q_ptr, q_sb, q_sh, k_ptr, v_ptr, c_sn, c_sh, c_st, table_ptr, t_sb, len_ptr,
               o_ptr, o_sb, o_ss, o_sh, lse_ptr, l_sb, l_ss, l_sh, scale_log2, chunk_pages, dim, sink_ptr,
               GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
               BLOCK_N: tl.constexpr, NORMALISE: tl.constexpr, HAS_SINK: tl.constexpr):  # fmt: skip
        split = tl.program_id(0)
        kv_head = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)  # BLOCK_N / PAGE whole pages per step
        heads = kv_head * GROUP + g
        live = (g < GROUP)[:, None] & (d < dim)[None, :]
        q = tl.load(q_ptr + b * q_sb + heads[:, None] * q_sh + d[None, :], mask=live, other=0.0)
        length = tl.load(len_ptr + b)
        first = split * chunk_pages
        start = first * PAGE
        end = tl.minimum(length, start + chunk_pages * PAGE)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        if HAS_SINK:  # the first chunk's softmax starts from the sink: exp2(sink - m) = 1 at m = sink
            m = tl.load(sink_ptr + heads, mask=(g < GROUP) & (split == 0), other=float("-inf")) * 1.4426950408889634
            total = tl.where(m > float("-inf"), 1.0, 0.0)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        cache_head = kv_head.to(tl.int64) * c_sh
        steps = (tl.maximum(end - start, 0) + BLOCK_N - 1) // BLOCK_N
        for i in range(0, steps):
            token = start + i * BLOCK_N + n
            valid = token < end
            page = tl.load(table_ptr + b * t_sb + token // PAGE, mask=valid, other=0).to(tl.int64)
            offsets = (page * c_sn + cache_head + (token % PAGE) * c_st)[:, None] + d[None, :]
            inside = valid[:, None] & (d < dim)[None, :]
            k = tl.load(k_ptr + offsets, mask=inside, other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale_log2  # [BLOCK_G, BLOCK_N], log2 units
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))  # finite: every step holds a valid key
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + offsets, mask=inside, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        result = acc / tl.where(total > 0, total, 1.0)[:, None]  # no key: zeros
        o_ptrs = o_ptr + b * o_sb + split * o_ss + heads[:, None] * o_sh + d[None, :]
        tl.store(o_ptrs, result.to(o_ptr.dtype.element_ty), mask=live)
        if not NORMALISE:  # natural-log LSE of the chunk, -inf where it has no key
            lse = tl.where(total > 0, (m + tl.log2(tl.where(total > 0, total, 1.0))) * 0.6931471805599453,
                           float("-inf"))  # fmt: skip
            tl.store(lse_ptr + b * l_sb + split * l_ss + heads * l_sh, lse, mask=g < GROUP)

    return types.SimpleNamespace(decode=Launcher(decode))


__all__ = ["paged_decode", "supported"]
