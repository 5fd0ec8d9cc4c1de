"""How one serving step's attention is laid out on the GPU: the split and the packing.

A decode step has little work per sequence: one query row (or a few) per head against a long
K/V cache. Run as it comes, a small batch launches too few thread blocks to fill the GPU, and
every query head re-reads its group's K/V. Two choices fix that, made once per step from the
batch geometry alone (no device values, so no host sync):

- **Packing** (GQA and multi-token decode): the ``G = H_q / H_kv`` query heads of a group and
  the ``S_q`` query tokens become ``G * S_q`` rows of one head, so K/V is read once per group.
  Rows packed that way share one mask, so only keys every query sees are packed (the *body*);
  with ``S_q > 1`` the last keys, which the bottom-right causal mask hides from the earlier
  query tokens, run unpacked (the *tail*: at most a page and ``S_q - 1`` keys).
- **Split-KV** (flash-decoding): the body's pages are cut into ``splits`` chunks, each chunk a
  batch entry of its own, so ``B * H_kv * splits`` blocks run; the partial results are merged
  by their log-sum-exp (``kernels/lse_merge.py``), exactly.
- **The kernel**: cuDNN's paged calls, or ``kernels/paged_decode.py`` (``mla_decode.py`` for
  MLA's latent), one Triton kernel doing both of the above (and the causal mask of several
  query tokens) in one launch. ``ops/dispatch.select_decode`` chooses it; ``choose`` lays the
  step out for the kernel chosen.

Every field can be forced (``PagedAttention(..., splits=, pack=, decode_kernel=)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..ops.dispatch import PAGED_CALLS, DecodeKernel

# Enough blocks to keep every SM busy with two in flight; H100/H200 have 132 SMs.
TARGET_BLOCKS = 264
# The shortest chunk worth a block of its own: below it, the merge costs more than it saves.
MIN_CHUNK_TOKENS = 256
# The Triton kernel's merge is one light launch: at batch 1 over 2k tokens 16 chunks of 128
# tokens ran 8.7 us a layer against 9.8 for 8 of 256 (H100, CUDA-graph replay).
TRITON_MIN_CHUNK_TOKENS = 128
MAX_SPLITS = 64


@dataclass(frozen=True)
class Schedule:
    """One step's layout: recorded on ``PagedAttention.schedule`` after every ``plan``/``run``."""

    batch: int
    s_q: int
    splits: int  # body chunks per sequence
    chunk_pages: int  # pages per body chunk
    packed: bool  # query heads (and tokens) packed into rows of one K/V head
    tail: bool  # the causal tail runs apart (multi-token decode)
    decode_kernel: DecodeKernel = PAGED_CALLS  # as ``ops/dispatch.select_decode`` chose it
    hopper: bool = False  # laid out for our kernel's Hopper form (16-bit GQA caches TMA can address run it)

    @property
    def kernel(self) -> str:
        """The decode kernel's name: ``decode_kernel=``'s values."""
        return self.decode_kernel.name

    @property
    def merged(self) -> bool:
        """Whether partial results are merged (more than one part per sequence)."""
        return self.splits > 1 or self.tail


def choose(
    batch: int,
    pages_per_seq: int,
    page_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    s_q: int,
    *,
    kernel: DecodeKernel = PAGED_CALLS,
    splits: int | None = None,
    pack: bool | None = None,
    sm_count: int = 132,
    mla: bool = False,
    fp8: bool = False,
    hopper: bool = False,
) -> Schedule:
    """The layout for a step of ``batch`` sequences of up to ``pages_per_seq`` pages and ``s_q``
    query tokens each, on ``kernel`` (``select_decode``'s choice). ``splits``/``pack``: forced
    values (None: chosen here); ``mla``: one latent K/V head, V of another head dim; ``fp8``:
    FP8 caches, whose half-size chunks want twice the splits with one query token (measured on
    an H100: B1 KV 32k 41.4 against 45.6 us a layer, B64 KV 4k 256 against 306); ``hopper``:
    the GQA decode kernel's Hopper form serves this geometry (``paged_decode_hopper.serves``).

    The Hopper form takes the steps whose K/V heads fit one wave of the GPU's SMs, split into
    one wave of programs: on an H200 (``cudnn-attn bench --serving`` geometry, CUDA-graph
    replay) one wave beat two by 3-26% at every such shape, and at batch 8 over 32k it beat the
    Triton kernel's two waves (100.7% of the memory's peak against 98.3%). Past one wave (more
    K/V heads than SMs), both forms on the Triton kernel's split, interleaved (H200, us a layer
    over pages of 64, Triton form against Hopper form): batch 20 over 8k 204 against 220, batch
    24 over 4k 109 against 115, batch 128 over 2k 241 against 249; the Hopper form 1-2.4% ahead
    only at batches 32 and 48 over 4k, within 1% either way at batch 64. Pages of 16 and 32
    follow the same rule (``docs/benchmarks.md``)."""
    if kernel.one_kernel:  # one kernel packs the group and tokens, splits the keys and masks itself
        hopper = hopper and not mla and not fp8 and batch * num_kv_heads <= sm_count
        if splits is None and hopper:
            splits = _splits(batch * num_kv_heads, pages_per_seq, page_size, sm_count, TRITON_MIN_CHUNK_TOKENS, 1)
        if splits is None:
            splits = _one_kernel_splits(batch, pages_per_seq, page_size, num_q_heads, num_kv_heads, sm_count, mla)
            if fp8 and s_q == 1 and not mla:
                splits = min(MAX_SPLITS, 2 * splits)
        return _laid_out(batch, s_q, pages_per_seq, splits, packed=True, tail=False, kernel=kernel, hopper=hopper)
    if mla:  # several query tokens, or cuDNN's calls asked for: unpacked, split only where forced
        return _laid_out(batch, s_q, pages_per_seq, 1 if splits is None else splits, False, s_q > 1, kernel)
    # Measured on an H200 (``cudnn-attn bench --serving``, CUDA-graph replay): with one query
    # token cuDNN's own paged decode beat every split and packing of cuDNN calls tried (it
    # spreads a sequence over the GPU itself), so its single-token decode runs plain unless
    # forced; with several query tokens, packing and splitting ran 2.5x faster than plain.
    packed = pack if pack is not None else s_q > 1
    heads = num_kv_heads if packed else num_q_heads
    if splits is None and s_q == 1:
        splits = 1
    if splits is None:
        splits = _splits(batch * heads, pages_per_seq, page_size, sm_count)
    return _laid_out(batch, s_q, pages_per_seq, splits, packed, s_q > 1, kernel)


def _one_kernel_splits(
    batch: int, pages_per_seq: int, page_size: int, num_q_heads: int, num_kv_heads: int, sm_count: int, mla: bool
) -> int:
    """Our kernels' chunks per sequence. MLA: one wave of blocks of 64 heads (on an H100 one wave
    beat 2-4 waves and half a wave at every shape of ``bench --mla``); otherwise chunks of at
    least ``TRITON_MIN_CHUNK_TOKENS`` bringing the blocks near ``TARGET_BLOCKS``."""
    if mla:
        return max(1, sm_count // (batch * math.ceil(num_q_heads / 64)))
    return _splits(batch * num_kv_heads, pages_per_seq, page_size, sm_count, TRITON_MIN_CHUNK_TOKENS)


def _laid_out(
    batch: int,
    s_q: int,
    pages_per_seq: int,
    splits: int,
    packed: bool,
    tail: bool,
    kernel: DecodeKernel,
    hopper: bool = False,
) -> Schedule:
    """The schedule of ``splits`` chunks (at most one a page, no empty trailing chunk)."""
    splits = max(1, min(int(splits), pages_per_seq))
    chunk_pages = math.ceil(pages_per_seq / splits)
    return Schedule(
        batch=batch,
        s_q=s_q,
        splits=math.ceil(pages_per_seq / chunk_pages),
        chunk_pages=chunk_pages,
        packed=packed,
        tail=tail,
        decode_kernel=kernel,
        hopper=hopper,
    )


def _splits(
    blocks: int,
    pages_per_seq: int,
    page_size: int,
    sm_count: int,
    min_chunk_tokens: int = MIN_CHUNK_TOKENS,
    waves: float = TARGET_BLOCKS / 132,
) -> int:
    """Chunks per sequence: a power of two bringing ``blocks`` near ``waves`` programs per SM
    (two: ``TARGET_BLOCKS`` on 132 SMs), no chunk under ``min_chunk_tokens``."""
    longest_split = max(1, pages_per_seq * page_size // min_chunk_tokens)
    wanted = max(1, int(waves * sm_count) // max(1, blocks))
    return min(MAX_SPLITS, longest_split, 1 << (wanted.bit_length() - 1))  # a power of two, at most wanted


def tail_pages(page_size: int, s_q: int) -> int:
    """Pages the causal tail can span: from the page holding the first key some query cannot
    see to the end, at most ``page_size - 1 + s_q - 1`` keys after a page boundary."""
    return math.ceil((page_size - 1 + s_q) / page_size) + 1
