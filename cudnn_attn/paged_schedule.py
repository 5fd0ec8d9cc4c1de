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
  by their log-sum-exp (``lse_merge.py``), exactly.

``choose`` picks both; every field can be forced (``PagedAttention(..., splits=, pack=)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Enough blocks to keep every SM busy with two in flight; H100/H200 have 132 SMs.
TARGET_BLOCKS = 264
# The shortest chunk worth a block of its own: below it, the merge costs more than it saves.
MIN_CHUNK_TOKENS = 256
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
    sm_count: int = 132,
) -> Schedule:
    """The layout for a step of ``batch`` sequences of up to ``pages_per_seq`` pages and ``s_q``
    query tokens each. ``splits``/``pack``: forced values (None: chosen here)."""
    # Measured on an H200 (``cudnn-attn bench --serving``, CUDA-graph replay): with one query
    # token cuDNN's own paged decode beat every split and packing tried (it spreads a sequence
    # over the GPU itself), so single-token decode runs plain unless forced; with several
    # query tokens, packing and splitting ran 2.5x faster than the plain call.
    packed = pack if pack is not None else s_q > 1
    heads = num_kv_heads if packed else num_q_heads
    if splits is None and s_q == 1:
        splits = 1
    if splits is None:
        longest_split = max(1, pages_per_seq * page_size // MIN_CHUNK_TOKENS)
        wanted = max(1, int(TARGET_BLOCKS * sm_count / 132) // max(1, batch * heads))
        splits = min(MAX_SPLITS, longest_split, 1 << (wanted.bit_length() - 1))  # a power of two, at most wanted
    splits = max(1, min(int(splits), pages_per_seq))
    chunk_pages = math.ceil(pages_per_seq / splits)
    splits = math.ceil(pages_per_seq / chunk_pages)  # no empty trailing chunk
    return Schedule(batch=batch, s_q=s_q, splits=splits, chunk_pages=chunk_pages, packed=packed, tail=s_q > 1)


def tail_pages(page_size: int, s_q: int) -> int:
    """Pages the causal tail can span: from the page holding the first key some query cannot
    see to the end, at most ``page_size - 1 + s_q - 1`` keys after a page boundary."""
    return math.ceil((page_size - 1 + s_q) / page_size) + 1
