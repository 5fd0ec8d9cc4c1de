"""Decode over paged caches in one Triton kernel: split-KV with the query heads of a GQA group
and the query tokens of a multi-token step packed into one tile, for the small batches cuDNN's
paged decode leaves the GPU half idle on.

One program takes one sequence, one K/V head and one chunk of ``chunk_pages`` pages: it loads
the group's ``G * S_q`` query rows once, walks its pages through the page table, and keeps a
running softmax (max, sum, weighted V) in float32, so each K/V byte is read once for the whole
group and every query token. Query token ``t`` of ``S_q`` sees the keys before
``length - S_q + 1 + t`` (bottom-right causal, as a speculative or multi-token decode step
needs). With one chunk per sequence it writes the normalised output directly; with several,
each chunk's normalised output and log-sum-exp go to float32 partial buffers, merged exactly by
``lse_merge`` (a merge inside the kernel, by the last program to finish, ran 4-10% slower on an
H100: one program merging serially, and more registers for every program). As plain torch, for
sequence ``b``, query head ``h`` and query token ``t``::

    k, v = gathered_pages(b, h // G)[:length[b] - S_q + 1 + t]      # [L_t, D]
    out[b, h, t] = softmax(q[b, h, t] @ k.T * scale) @ v

With ``sink`` (a logit per query head, gpt-oss's attention sinks) the first chunk starts its
running softmax from the sink, one more term of the denominator weighing no value: its
log-sum-exp then carries the sink into the merge, exactly once.

The K/V loads have no mask along the head dim when it is a power of two, and the head dim is
a compile-time constant: a mask with a runtime bound there kept Triton from vectorising and
pipelining the loads.

Lengths and the page table must already be in range (``PagedAttention.plan`` clamps them on
the device). Needs CUDA and Triton; ``supported`` says when the kernel applies.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

from ..core.dtypes import FP8
from ..errors import UnsupportedError
from . import paged_decode_hopper
from .launch import Launcher, sm_count
from .lse_merge import merge_checked, split_targets
from .strides import strides_alike

LOG2_E = 1.4426950408889634
MIN_ROWS = 16  # tl.dot needs 16 rows: smaller groups are padded
MAX_ROWS = 64  # query rows of one tile (G * S_q): more would spill the accumulator


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


def packs(group: int, s_q: int) -> bool:
    """Whether ``G * S_q`` query rows fit one tile of the kernel."""
    return group * s_q <= MAX_ROWS


# Tokens a program loads per step. 64 where the grid is two programs or more per SM (smaller
# tiles, more programs resident: at batch 64 over 4k tokens, pages of 64, 100% of the memory's
# rate against 93% with 128; H100), else 128. In tokens, not pages: over pages of 16, one page a
# step ran batch 64 over 4k at 375 us a layer against 242 with four (H200, CUDA-graph replay).
SMALL_STEP_TOKENS, STEP_TOKENS = 64, 128


def default_pages_per_step(programs: int, page: int, device: torch.device) -> int:
    """Pages a program loads per step: ``SMALL_STEP_TOKENS``' worth where the grid is two
    programs or more per SM, else ``STEP_TOKENS``' worth (at least one page)."""
    tokens = SMALL_STEP_TOKENS if programs >= 2 * sm_count(device) else STEP_TOKENS
    return max(1, tokens // page)


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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    hopper: bool = False,
    dependent_launch: str = "off",
) -> torch.Tensor:
    """Decode attention of ``q`` ``[B, H_q, S_q, D]`` into ``out`` (same shape, any strides),
    bottom-right causal over each sequence's ``lengths[b]`` keys.

    table: ``[B, >= splits * chunk_pages or enough for every length]`` int32 page indices;
    lengths: ``[B]`` int32, at least ``S_q`` each; splits, chunk_pages: the split-KV layout;
    partial_o ``[B, splits, H_q * S_q, D]`` and partial_lse ``[B, splits, H_q * S_q]`` float32 (any
    strides, D contiguous): persistent buffers for ``splits > 1`` (allocated here when not given); sink: ``[H_q]`` float32
    contiguous, attention sinks in units of the scaled scores; tuning: the kernel's launch settings
    (``pages_per_step``, ``num_warps``, ``num_stages``) where not the defaults. FP8 caches
    (``float8_e4m3fn``/``float8_e5m2``) are read as they are, widened in registers (to ``q``'s
    dtype with one query token, else to float16, the query scaled into its range), and their real values are ``k_scale`` / ``v_scale`` times the stored ones: K's
    folds into the softmax scale, V's multiplies the output. ``hopper``: run
    ``paged_decode_hopper``'s warp-specialised kernel instead where it takes these tensors
    (16-bit caches TMA can address, on Hopper; ``tuning`` is then not read), launched as
    ``dependent_launch`` says (``paged_decode_hopper``; the Triton kernel launches plainly).
    """
    if hopper and paged_decode_hopper.usable(q, k_cache, v_cache, kv_layout):  # refuses FP8 caches
        return paged_decode_hopper.paged_decode_hopper(
            q,
            k_cache,
            v_cache,
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
            dependent_launch=dependent_launch,
        )
    tuning = tuning or {}
    kernels = _kernels()
    assert kernels is not None, "paged_decode needs Triton (see supported())"
    batch, heads, s_q, dim = q.shape
    if kv_layout == "NHPD":  # [N, H_kv, P, D]
        kv_heads, page = k_cache.shape[1], k_cache.shape[2]
        stride_page, stride_head, stride_token = k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)
    else:  # "NPHD": [N, P, H_kv, D]
        kv_heads, page = k_cache.shape[2], k_cache.shape[1]
        stride_page, stride_head, stride_token = k_cache.stride(0), k_cache.stride(2), k_cache.stride(1)
    if not strides_alike(v_cache, k_cache):  # the kernel walks V with K's strides
        raise UnsupportedError(
            [
                f"v_cache: strides {list(v_cache.stride())} differ from k_cache's {list(k_cache.stride())}; "
                "the decode kernel reads K and V with one set of strides"
            ],
            context="the paged decode kernel",
            alternatives=[
                "k_cache and v_cache with the same strides (both views of one [2, pages, ...] tensor, "
                "or both made by torch.empty of one shape)",
                "cuDNN's paged attention (PagedAttention(decode_kernel='cudnn'), 16-bit caches)",
            ],
        )
    group = heads // kv_heads
    rows = group * s_q
    block_d = max(16, 1 << (dim - 1).bit_length())
    kv_fp8 = k_cache.dtype in FP8
    # FP8 tiles are widened in registers before their dots: with one query token, 64 tokens a
    # step and two stages ran 9-16% faster than the 16-bit settings at every shape tried (pages
    # of 64; H100), with 4-8 tokens 15-20% slower; over pages of 16, 64 tokens a step ran 1.6-1.7x
    # as fast as one page (H200, CUDA-graph replay).
    lean = kv_fp8 and s_q == 1
    pages_per_step = tuning.get(
        "pages_per_step",
        max(1, SMALL_STEP_TOKENS // page)
        if lean
        else default_pages_per_step(batch * kv_heads * splits, page, q.device),
    )
    # One split: normalised straight into out, the partial targets placeholders never written.
    o, (o_sb, o_ss, o_sh), lse, (l_sb, l_ss, l_sh) = split_targets(
        out, splits, heads * s_q, dim, partial_o, partial_lse
    )
    block_r = max(MIN_ROWS, 1 << (rows - 1).bit_length())
    kernels.decode(
        (splits, kv_heads, batch),
        q,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_cache,
        v_cache,
        stride_page,
        stride_head,
        stride_token,
        table,
        table.stride(0),
        lengths,
        out,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        o,
        o_sb,
        o_ss,
        o_sh,
        lse,
        l_sb,
        l_ss,
        l_sh,
        scale * LOG2_E * k_scale,
        chunk_pages,
        sink if sink is not None else lengths,
        v_scale,
        GROUP=group,
        S_Q=s_q,
        BLOCK_R=block_r,
        HEAD_DIM=dim,
        BLOCK_D=block_d,
        PAGE=page,
        BLOCK_N=page * pages_per_step,
        SPLIT=splits > 1,
        HAS_SINK=sink is not None,
        KV_FP8=kv_fp8,
        num_warps=tuning.get("num_warps", 4 if block_d <= 128 else 8),
        num_stages=tuning.get("num_stages", 2 if lean else 3),
    )
    if splits > 1:
        parts = o.unflatten(2, (heads, s_q)), lse.unflatten(2, (heads, s_q))
        merge_checked([parts], out)
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
    def into_half(q, scale_log2):
        """``q`` in float16, each row's largest magnitude brought into [2^14, 2^15) by a power of
        two (exact for the row's values within 2^28 of that largest: a bf16 value has 8
        significant bits, float16 11), and each row's scale of the scores, ``[BLOCK_R, 1]``,
        carrying the inverse power. Per row, so that no row's size flushes another's. FP8
        tiles then widen to float16 in one instruction per pair of values, against three to
        bfloat16 (through float16)."""
        qf = q.to(tl.float32)
        amax = tl.max(tl.abs(qf), 1)
        exponent = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(amax)), amax normal
        shift = tl.minimum(tl.maximum(exponent - 14, -126), 126)  # both powers normal floats
        down = ((127 - shift) << 23).to(tl.float32, bitcast=True)  # 2^-shift, built exactly
        up = ((127 + shift) << 23).to(tl.float32, bitcast=True)
        return (qf * down[:, None]).to(tl.float16), (scale_log2 * up)[:, None]

    @triton.jit
    def decode(
        q_ptr,
        q_sb,
        q_sh,
        q_st,
        k_ptr,
        v_ptr,
        c_sn,
        c_sh,
        c_st,
        table_ptr,
        t_sb,
        len_ptr,
        out_ptr,
        out_sb,
        out_sh,
        out_st,
        o_ptr,
        o_sb,
        o_ss,
        o_sh,
        lse_ptr,
        l_sb,
        l_ss,
        l_sh,
        scale_log2,
        chunk_pages,
        sink_ptr,
        v_scale,
        GROUP: tl.constexpr,
        S_Q: tl.constexpr,
        BLOCK_R: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PAGE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLIT: tl.constexpr,
        HAS_SINK: tl.constexpr,
        KV_FP8: tl.constexpr,
    ):
        split = tl.program_id(0)
        kv_head = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        r = tl.arange(0, BLOCK_R)  # row r: query head kv_head * GROUP + r // S_Q, token r % S_Q
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)  # BLOCK_N / PAGE whole pages per step
        live = r < GROUP * S_Q
        heads = kv_head * GROUP + r // S_Q
        t = r % S_Q
        q = tl.load(
            q_ptr + b * q_sb + (heads * q_sh + t * q_st)[:, None] + d[None, :],
            mask=live[:, None] & (d < HEAD_DIM)[None, :],
            other=0.0,
        )
        length = tl.load(len_ptr + b)
        start = split * chunk_pages * PAGE
        end = tl.minimum(length, start + chunk_pages * PAGE)
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_R], tl.float32)
        if HAS_SINK:  # the first chunk's softmax starts from the sink: exp2(sink - m) = 1 at m = sink
            m = tl.load(sink_ptr + heads, mask=live & (split == 0), other=float("-inf")) * 1.4426950408889634
            total = tl.where(m > float("-inf"), 1.0, 0.0)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        if KV_FP8 and S_Q > 1:  # the dots in float16 (K, V and P widen to q.dtype below): 1.1-1.2x
            q, scale_log2 = into_half(q, scale_log2)  # faster; with one token 1.02-1.21x slower (H200)
        cache_head = kv_head.to(tl.int64) * c_sh
        steps = (tl.maximum(end - start, 0) + BLOCK_N - 1) // BLOCK_N
        for i in range(0, steps):
            token = start + i * BLOCK_N + n
            valid = token < end
            page = tl.load(table_ptr + b * t_sb + token // PAGE, mask=valid, other=0).to(tl.int64)
            offsets = (page * c_sn + cache_head + (token % PAGE) * c_st)[:, None] + d[None, :]
            if HEAD_DIM == BLOCK_D:  # no mask along D: vector loads, which Triton pipelines
                inside = valid[:, None]
            else:
                inside = valid[:, None] & (d < HEAD_DIM)[None, :]
            k = tl.load(k_ptr + offsets, mask=inside, other=0.0)
            if KV_FP8:  # widened in registers (to q.dtype): the cache's bytes are read once, in 8 bits
                k = k.to(q.dtype)
            s = tl.dot(q, tl.trans(k)) * scale_log2  # [BLOCK_R, BLOCK_N], log2 units
            if S_Q == 1:
                s = tl.where(valid[None, :], s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, 1))  # finite: every step holds a valid key
                m_use = m_new
            else:  # a row may see none of this step's keys: its max stays -inf, used as 0
                s = tl.where(valid[None, :] & (token[None, :] < (length - S_Q + 1 + t)[:, None]), s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, 1))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_use)
            p = tl.exp2(s - m_use[:, None])
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + offsets, mask=inside, other=0.0)
            if KV_FP8:
                v = v.to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        result = acc / tl.where(total > 0, total, 1.0)[:, None]  # no key: zeros
        if KV_FP8:  # V's scale: the merge is linear in O, so partials may carry it
            result = result * v_scale
        if SPLIT:  # float32 partials [B, splits, H_q * S_q, D] and their natural-log LSE
            flat = kv_head * (GROUP * S_Q) + r  # the row's index in [H_q * S_q]: head-major
            o_ptrs = o_ptr + b * o_sb + split * o_ss + flat[:, None] * o_sh + d[None, :]
            tl.store(o_ptrs, result, mask=live[:, None] & (d < HEAD_DIM)[None, :])
            lse = tl.where(
                total > 0, (m + tl.log2(tl.where(total > 0, total, 1.0))) * 0.6931471805599453, float("-inf")
            )
            tl.store(lse_ptr + b * l_sb + split * l_ss + flat * l_sh, lse, mask=live)
        else:
            out_ptrs = out_ptr + b * out_sb + (heads * out_sh + t * out_st)[:, None] + d[None, :]
            tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=live[:, None] & (d < HEAD_DIM)[None, :])

    return types.SimpleNamespace(decode=Launcher(decode))


__all__ = ["packs", "paged_decode", "supported"]
