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
- **The kernel**: cuDNN's paged calls, or ``kernels/paged_decode.py``, one Triton kernel doing
  both of the above (and the causal mask of several query tokens) in one launch.

``choose`` picks all three; every field can be forced (``PagedAttention(..., splits=, pack=,
decode_kernel=)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..kernels import paged_decode
from ..log import logger as log

# Enough blocks to keep every SM busy with two in flight; H100/H200 have 132 SMs.
TARGET_BLOCKS = 264
KERNELS = ("cudnn", "triton")
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
    kernel: str = "cudnn"  # single-token decode: "cudnn" or "triton" (paged_decode.py)

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
    splits: int | None = None,
    pack: bool | None = None,
    kernel: str | None = None,
    sm_count: int = 132,
    triton: bool = False,
    mla: bool = False,
    hopper: bool = False,
    fp8: bool = False,
) -> Schedule:
    """The layout for a step of ``batch`` sequences of up to ``pages_per_seq`` pages and ``s_q``
    query tokens each. ``splits``/``pack``/``kernel``: forced values (None: chosen here);
    ``triton``: whether the Triton decode kernel can run here (``paged_decode.supported``, or
    ``mla_decode.supported`` for ``mla``: one latent K/V head, V of another head dim); ``hopper``:
    whether MLA's warp-specialised kernel serves the geometry (``mla_decode_hopper.serves``);
    ``fp8``: FP8 caches, whose half-size chunks want twice the splits with one query token
    (measured on an H100: B1 KV 32k 41.4 against 45.6 us a layer, B64 KV 4k 256 against 306)."""
    if mla:
        return _mla(batch, pages_per_seq, num_q_heads, s_q, splits, kernel, sm_count, triton, hopper)
    packs = paged_decode.packs(num_q_heads // num_kv_heads, s_q)
    if kernel is None:  # measured faster than cuDNN's calls at every shape of ``bench --serving``
        kernel = "triton" if triton and packs else "cudnn"
    elif kernel == "triton" and not packs:
        log.debug(
            "decode_kernel='triton': %d query heads per K/V head by %d tokens exceed its tile of %d rows; "
            "this step runs cuDNN's calls",
            num_q_heads // num_kv_heads,
            s_q,
            paged_decode.MAX_ROWS,
        )
        kernel = "cudnn"
    if kernel == "triton":  # one kernel packs the group and tokens, splits the keys and masks itself
        if splits is None:
            splits = _splits(batch * num_kv_heads, pages_per_seq, page_size, sm_count, TRITON_MIN_CHUNK_TOKENS)
            if fp8 and s_q == 1:
                splits = min(MAX_SPLITS, 2 * splits)
        splits = max(1, min(int(splits), pages_per_seq))
        chunk_pages = math.ceil(pages_per_seq / splits)
        return Schedule(
            batch=batch,
            s_q=s_q,
            splits=math.ceil(pages_per_seq / chunk_pages),
            chunk_pages=chunk_pages,
            packed=True,
            tail=False,
            kernel="triton",
        )
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
    splits = max(1, min(int(splits), pages_per_seq))
    chunk_pages = math.ceil(pages_per_seq / splits)
    splits = math.ceil(pages_per_seq / chunk_pages)  # no empty trailing chunk
    return Schedule(
        batch=batch, s_q=s_q, splits=splits, chunk_pages=chunk_pages, packed=packed, tail=s_q > 1, kernel=kernel
    )


def _mla(
    batch: int,
    pages_per_seq: int,
    heads: int,
    s_q: int,
    splits: int | None,
    kernel: str | None,
    sm_count: int,
    triton: bool,
    hopper: bool,
) -> Schedule:
    """MLA decode: our kernel (``mla_decode.py``; on Hopper the warp-specialised one) with enough
    chunks per sequence for one wave of blocks of 64 heads (on an H100 one wave beat 2-4 waves
    and half a wave at every shape of ``bench --mla``). Measured there (CUDA-graph replay, d
    576/512, page 64) it ran 2.5-14x cuDNN's paged decode (which reads the latent once per head)
    from 16 heads at B16 to 128 heads at B64, and 7.5x at B1 KV 32k with 128 heads; with 16 heads
    at B1 KV 32k the Triton kernel ran 15% behind cuDNN's, which stays with cuDNN unless the
    Hopper kernel serves (24.6 against 62.7 us there, each layer reading its own latent). Several
    query tokens go to cuDNN, unpacked."""
    if s_q > 1:  # our MLA kernels take one query token
        kernel = "cudnn"
    elif kernel is None:
        kernel = "triton" if triton and (batch > 1 or heads >= 64 or hopper) else "cudnn"
    if kernel == "cudnn":
        wanted = 1 if splits is None else max(1, min(int(splits), pages_per_seq))
        chunk = math.ceil(pages_per_seq / wanted)
        return Schedule(
            batch=batch,
            s_q=s_q,
            splits=math.ceil(pages_per_seq / chunk),
            chunk_pages=chunk,
            packed=False,
            tail=s_q > 1,
            kernel="cudnn",
        )
    if splits is None:
        splits = max(1, sm_count // (batch * math.ceil(heads / 64)))
    splits = max(1, min(int(splits), pages_per_seq))
    chunk = math.ceil(pages_per_seq / splits)
    return Schedule(
        batch=batch,
        s_q=s_q,
        splits=math.ceil(pages_per_seq / chunk),
        chunk_pages=chunk,
        packed=True,
        tail=False,
        kernel="triton",
    )


def _splits(
    blocks: int, pages_per_seq: int, page_size: int, sm_count: int, min_chunk_tokens: int = MIN_CHUNK_TOKENS
) -> int:
    """Chunks per sequence: a power of two bringing ``blocks`` near ``TARGET_BLOCKS`` (scaled to
    this GPU's SMs), no chunk under ``min_chunk_tokens``."""
    longest_split = max(1, pages_per_seq * page_size // min_chunk_tokens)
    wanted = max(1, int(TARGET_BLOCKS * sm_count / 132) // max(1, blocks))
    return min(MAX_SPLITS, longest_split, 1 << (wanted.bit_length() - 1))  # a power of two, at most wanted


def tail_pages(page_size: int, s_q: int) -> int:
    """Pages the causal tail can span: from the page holding the first key some query cannot
    see to the end, at most ``page_size - 1 + s_q - 1`` keys after a page boundary."""
    return math.ceil((page_size - 1 + s_q) / page_size) + 1
