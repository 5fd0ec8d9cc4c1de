"""MLA decode (DeepSeek-V2/V3, Kimi) over a paged latent cache in one Triton kernel.

Multi-head latent attention keeps one K/V head per token: a latent of ``D_V`` dims (512) and a
rope part (64), ``D = D_V + D_ROPE``; V is the latent itself. Every query head reads the same
cache, so one program takes a block of ``BLOCK_H`` query heads of one sequence and one chunk of
its pages: the scores of the whole block come from one matrix product per key tile
(``q_nope @ k_nope.T + q_rope @ k_rope.T``), and each latent byte is read once per block of
heads instead of once per head (what cuDNN's decode does). FlashMLA's shape of work, written
plainly: a running softmax in float32, ``P @ latent`` into a ``[BLOCK_H, D_V]`` accumulator.
As plain torch, for sequence ``b``::

    c = gathered_pages(b)[:length[b]]                 # [L, D]
    out[b, :, 0] = softmax(q[b, :, 0] @ c.T * scale) @ c[:, :D_V]

With several chunks per sequence, each writes its normalised output and log-sum-exp to float32
partial buffers, merged by ``lse_merge.merge_partials``; a sink (one logit per head) starts the
first chunk's softmax. Lengths and the table must be in range (``PagedAttention.plan`` clamps
them on the device).

On Hopper, calls of DeepSeek's geometry go to ``mla_decode_hopper`` (warp-specialised, 1.7-2.1x
this kernel on an H100); this one serves other GPUs, pages and dims. Tried on an H100 to speed
it up and kept out: two pages per step, two programs per block of heads, three pipeline stages,
half-page steps, one stage, four warps, Triton 3.6's ``warp_specialize`` and unmasked full
pages. At 64 heads per program it holds 242-255 registers a thread and 216 KB of shared memory,
one program per SM that loads, multiplies and exponentiates in turn (210-280 TFLOP/s).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

from .launch import Launcher
from .lse_merge import merge_checked, split_targets
from .mla_decode_hopper import mla_decode_hopper, usable
from .strides import strides_alike

LOG2_E = 1.4426950408889634


def supported(device: torch.device, page_size: int, head_dim: int, head_dim_v: int) -> bool:
    """A CUDA device with Triton; the latent and the rope part powers of two (512 and 64 in
    DeepSeek's MLA), a page of 16-256 tokens (a power of two)."""
    rope = head_dim - head_dim_v
    return (
        device.type == "cuda"
        and 16 <= page_size <= 256
        and page_size & (page_size - 1) == 0
        and 16 <= head_dim_v <= 512
        and head_dim_v & (head_dim_v - 1) == 0
        and 16 <= rope <= 128
        and rope & (rope - 1) == 0
        and _kernels() is not None
    )


def mla_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor,
    *,
    head_dim_v: int,
    scale: float,
    kv_layout: str,
    splits: int,
    chunk_pages: int,
    partial_o: torch.Tensor | None = None,
    partial_lse: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    tuning: dict[str, int] | None = None,
) -> torch.Tensor:
    """Decode attention of ``q`` ``[B, H, 1, D]`` over the latent ``cache`` ``[N, 1, P, D]``
    (NHPD) or ``[N, P, 1, D]`` (NPHD) into ``out`` ``[B, H, 1, D_V]`` (any strides). ``v_cache``:
    V, ``[..., D_V]`` in the same layout; where it is ``cache[..., :D_V]`` (MLA's latent) the
    tile of K already loaded serves as V, otherwise V is read from ``v_cache``.

    table: ``[B, >= splits * chunk_pages]`` int32; lengths: ``[B]`` int32; partial_o
    ``[B, splits, H, D_V]`` and partial_lse ``[B, splits, H]`` float32 for ``splits > 1``
    (allocated here when not given); sink: ``[H]`` float32 contiguous; tuning: ``block_h``,
    ``num_warps``, ``num_stages`` where not the defaults (given, this Triton kernel runs even where
    ``mla_decode_hopper`` would).
    """
    if not tuning and usable(q, cache, v_cache, kv_layout):  # Hopper: the warp-specialised kernel
        return mla_decode_hopper(
            q,
            cache,
            table,
            lengths,
            out,
            scale=scale,
            kv_layout=kv_layout,
            splits=splits,
            chunk_pages=chunk_pages,
            partial_o=partial_o,
            partial_lse=partial_lse,
            sink=sink,
        )
    tuning = tuning or {}
    kernels = _kernels()
    assert kernels is not None, "mla_decode needs Triton (see supported())"
    batch, heads, _, dim = q.shape
    token = 2 if kv_layout == "NHPD" else 1  # the token dim of [N, 1, P, D] or [N, P, 1, D]
    page, c_st, v_st = cache.shape[token], cache.stride(token), v_cache.stride(token)
    latent = v_cache.data_ptr() == cache.data_ptr() and strides_alike(v_cache, cache)
    o, (o_sb, o_ss, o_sh), lse, (l_sb, l_ss, l_sh) = split_targets(
        out, splits, heads, head_dim_v, partial_o, partial_lse
    )
    block_h = tuning.get("block_h", 64 if heads >= 64 else max(16, 1 << (heads - 1).bit_length()))
    grid = (splits, triton_cdiv(heads, block_h), batch)
    kernels.decode(
        grid,
        q,
        q.stride(0),
        q.stride(1),
        cache,
        cache.stride(0),
        c_st,
        v_cache,
        v_cache.stride(0),
        v_st,
        table,
        table.stride(0),
        lengths,
        o,
        o_sb,
        o_ss,
        o_sh,
        lse,
        l_sb,
        l_ss,
        l_sh,
        sink if sink is not None else lengths,
        scale * LOG2_E,
        chunk_pages,
        heads,
        D_V=head_dim_v,
        D_ROPE=dim - head_dim_v,
        BLOCK_H=block_h,
        PAGE=page,
        NORMALISE=splits == 1,
        HAS_SINK=sink is not None,
        V_IS_LATENT=latent,
        num_warps=tuning.get("num_warps", 8),
        num_stages=tuning.get("num_stages", 2),
    )
    if splits > 1:
        merge_checked([(o.unsqueeze(3), lse.unsqueeze(3))], out)
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _kernels() -> Any:
    """The Triton kernel, compiled on first use; None without Triton."""
    if importlib.util.find_spec("triton") is None:
        return None
    import types

    import triton
    import triton.language as tl

    @triton.jit
    def decode(
        q_ptr,
        q_sb,
        q_sh,
        c_ptr,
        c_sn,
        c_st,
        v_ptr,
        v_sn,
        v_st,
        table_ptr,
        t_sb,
        len_ptr,
        o_ptr,
        o_sb,
        o_ss,
        o_sh,
        lse_ptr,
        l_sb,
        l_ss,
        l_sh,
        sink_ptr,
        scale_log2,
        chunk_pages,
        heads,
        D_V: tl.constexpr,
        D_ROPE: tl.constexpr,
        BLOCK_H: tl.constexpr,
        PAGE: tl.constexpr,
        NORMALISE: tl.constexpr,
        HAS_SINK: tl.constexpr,
        V_IS_LATENT: tl.constexpr,
    ):
        split = tl.program_id(0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        b = tl.program_id(2).to(tl.int64)
        dv = tl.arange(0, D_V)
        dr = tl.arange(0, D_ROPE)
        n = tl.arange(0, PAGE)  # one page per step
        live = h < heads
        q_rows = q_ptr + b * q_sb + h[:, None] * q_sh
        q_nope = tl.load(q_rows + dv[None, :], mask=live[:, None], other=0.0)
        q_rope = tl.load(q_rows + D_V + dr[None, :], mask=live[:, None], other=0.0)
        length = tl.load(len_ptr + b)
        start = split * chunk_pages * PAGE
        end = tl.minimum(length, start + chunk_pages * PAGE)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_H], tl.float32)
        if HAS_SINK:  # the first chunk's softmax starts from the sink
            m = tl.load(sink_ptr + h, mask=live & (split == 0), other=float("-inf")) * 1.4426950408889634
            total = tl.where(m > float("-inf"), 1.0, 0.0)
        acc = tl.zeros([BLOCK_H, D_V], tl.float32)
        steps = (tl.maximum(end - start, 0) + PAGE - 1) // PAGE
        for i in range(0, steps):
            token = start + i * PAGE + n
            valid = token < end
            page = tl.load(table_ptr + b * t_sb + (start // PAGE + i)).to(tl.int64)
            rows = c_ptr + page * c_sn + n[:, None].to(tl.int64) * c_st
            k_nope = tl.load(rows + dv[None, :], mask=valid[:, None], other=0.0)  # [PAGE, D_V], also V
            k_rope = tl.load(rows + D_V + dr[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(q_nope, tl.trans(k_nope)) + tl.dot(q_rope, tl.trans(k_rope))
            s = tl.where(valid[None, :], s * scale_log2, float("-inf"))  # [BLOCK_H, PAGE], log2 units
            m_new = tl.maximum(m, tl.max(s, 1))  # finite: every step holds a valid key
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            if V_IS_LATENT:
                v = k_nope
            else:
                v_rows = v_ptr + page * v_sn + n[:, None].to(tl.int64) * v_st
                v = tl.load(v_rows + dv[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        result = acc / tl.where(total > 0, total, 1.0)[:, None]  # no key: zeros
        o_ptrs = o_ptr + b * o_sb + split * o_ss + h[:, None] * o_sh + dv[None, :]
        tl.store(o_ptrs, result.to(o_ptr.dtype.element_ty), mask=live[:, None])
        if not NORMALISE:  # natural-log LSE of the chunk, -inf where it has no key
            lse = tl.where(
                total > 0, (m + tl.log2(tl.where(total > 0, total, 1.0))) * 0.6931471805599453, float("-inf")
            )
            tl.store(lse_ptr + b * l_sb + split * l_ss + h * l_sh, lse, mask=live)

    return types.SimpleNamespace(decode=Launcher(decode))


__all__ = ["mla_decode", "supported"]
