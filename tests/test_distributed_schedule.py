"""Context parallelism's schedules, without processes: the blocks a rank computes (dense) and the
packed calls it makes cover exactly the scores its queries may see, each once, and nothing else.

A block's mask is read from its definition (``blocks.py``: the diagonal, causal, the left bound),
laid on the positions its rows and keys hold, and summed over every block of a ring step (or
over the gathered calls); the sum must be the step's visibility, 0 or 1 everywhere.
"""

from __future__ import annotations

import pytest
import torch

from cudnn_attn.distributed import packed_schedule, schedule
from cudnn_attn.distributed.chunks import chunk_ids
from cudnn_attn.distributed.documents import Documents, shard_index


def block_mask(mask: str, window: int | None, rows: int, keys: int) -> torch.Tensor:
    """Which scores a block keeps, by ``blocks.py``'s definition of its mask and window."""
    i, j = torch.arange(rows)[:, None], torch.arange(keys)[None, :]
    diagonal = i + (keys - rows if mask == "bottom_right" else 0)
    kept = torch.ones(rows, keys, dtype=torch.bool)
    if mask != "none":
        kept &= j <= diagonal
    if window is not None:
        kept &= j > diagonal - window
    return kept


def visible(rows: torch.Tensor, keys: torch.Tensor, causal: bool, left: int | None) -> torch.Tensor:
    distance = rows[:, None] - keys[None, :]
    seen = torch.ones(distance.shape, dtype=torch.int64)
    if causal:
        seen &= distance >= 0
    if left is not None:
        seen &= distance <= left
    return seen


def positions(layout: str, rank: int, world: int, chunk: int) -> torch.Tensor:
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunk_ids(layout, rank, world)])


GRID = [(w, layout, c) for w in (1, 2, 3) for layout in ("zigzag", "contiguous") for c in (1, 3, 4)]


@pytest.mark.parametrize("left", [None, 0, 1, 2, 5, 100])
@pytest.mark.parametrize("world,layout,chunk", GRID)
def test_dense_ring_blocks_cover_what_each_step_sees(world, layout, chunk, left):
    per_rank = 2 if layout == "zigzag" else 1
    for rank in range(world):
        for src in range(world):
            want = visible(positions(layout, rank, world, chunk), positions(layout, src, world, chunk), True, left)
            got = torch.zeros_like(want)
            for b in schedule.ring_blocks(layout, True, rank, src, world, chunk * per_rank, left):
                kept = block_mask(
                    b.mask,
                    b.window,
                    b.rows.indices(len(want))[1] - b.rows.indices(len(want))[0],
                    b.keys.indices(len(want))[1] - b.keys.indices(len(want))[0],
                )
                assert kept.any(dim=1).all(), f"{b}: a row that sees no key is computed"
                got[b.rows, b.keys] += kept.long()
            assert torch.equal(got, want), (rank, src)


@pytest.mark.parametrize("left", [None, 0, 2, 5])
@pytest.mark.parametrize("world,layout,chunk", GRID)
def test_dense_gathered_blocks_cover_what_each_rank_sees(world, layout, chunk, left):
    per_rank = 2 if layout == "zigzag" else 1
    whole = torch.arange(chunk * per_rank * world)
    for rank in range(world):
        want = visible(positions(layout, rank, world, chunk), whole, True, left)
        got = torch.zeros_like(want)
        for b in schedule.all_gathered_blocks(layout, True, rank, world, chunk * per_rank, left):
            rows, keys = range(*b.rows.indices(want.shape[0])), range(*b.keys.indices(want.shape[1]))
            got[b.rows, b.keys] += block_mask(b.mask, b.window, len(rows), len(keys)).long()
        assert torch.equal(got, want), rank


def test_a_window_skips_the_ring_steps_it_cannot_see():
    """Zigzag over 4 ranks, chunks of 8, a window of 3: rank 0 holds chunks 0 and 7; rank 1's
    K/V (chunks 1 and 6) is seen (chunk 7 reaches back into 6), rank 2's (2 and 5) is not."""
    assert schedule.ring_blocks("zigzag", True, 0, 1, 4, 16, left=3)
    assert schedule.ring_blocks("zigzag", True, 0, 2, 4, 16, left=3) == []
    assert schedule.ring_blocks("zigzag", True, 0, 2, 4, 16) != []  # without the window it is


def _packed_cover(docs: Documents, calls, rank: int, keys_of) -> torch.Tensor:
    """The count of times each (local row, key token) score is computed by ``calls``."""
    rows_total = sum(docs.local_lengths)
    got = torch.zeros(rows_total, keys_of, dtype=torch.int64)
    for call in calls:
        rows = torch.arange(rows_total) if call.rows is None else call.rows
        keys = torch.arange(keys_of) if call.keys is None else call.keys
        lengths_q = call.lengths_q.view(-1).tolist()
        lengths_k = call.lengths_k.view(-1).tolist()
        assert len(set(rows.tolist())) == rows.numel(), "a row twice in one call"
        r0 = k0 = 0
        for n_q, n_k in zip(lengths_q, lengths_k):
            kept = block_mask(call.mask, call.window, n_q, n_k)
            got[rows[r0 : r0 + n_q][:, None], keys[k0 : k0 + n_k][None, :]] += kept.long()
            r0, k0 = r0 + n_q, k0 + n_k
        assert max(lengths_q) <= call.max_q and max(lengths_k) <= call.max_k
        assert (call.sequence.numel(), call.position.numel()) == (rows.numel(), rows.numel())
    return got


def _document_visibility(docs: Documents, rows: torch.Tensor, keys: torch.Tensor, causal: bool, left) -> torch.Tensor:
    doc = torch.repeat_interleave(torch.arange(len(docs.lengths)), torch.tensor(docs.lengths))
    start = torch.tensor(docs.starts)[doc]
    position = torch.arange(docs.tokens) - start
    same = doc[rows][:, None] == doc[keys][None, :]
    return visible(position[rows], position[keys], causal, left) & same.long()


@pytest.mark.parametrize("causal,left", [(True, None), (False, None), (True, 0), (True, 3), (True, 9)])
@pytest.mark.parametrize("world,layout", [(2, "zigzag"), (3, "zigzag"), (2, "contiguous")])
def test_packed_calls_cover_what_each_document_sees(world, layout, causal, left):
    parts = (2 if layout == "zigzag" else 1) * world
    docs = Documents(tuple(n * parts for n in (4, 1, 0, 2, 3)), world, layout)  # an empty document too
    cpu = torch.device("cpu")
    for rank in range(world):
        mine = shard_index(docs, rank, "cpu")
        for src in range(world):
            calls = packed_schedule.ring_calls(docs, causal, rank, src, left, cpu)
            got = _packed_cover(docs, calls, rank, len(mine))
            want = _document_visibility(docs, mine, shard_index(docs, src, "cpu"), causal, left)
            assert torch.equal(got, want), (rank, src)
            if not want.any():
                assert calls == (), "a step that sees nothing makes no call"
        calls = packed_schedule.gathered_calls(docs, causal, rank, left, cpu)
        got = _packed_cover(docs, calls, rank, docs.tokens)
        assert torch.equal(got, _document_visibility(docs, mine, torch.arange(docs.tokens), causal, left)), rank


def test_packed_calls_read_whole_shards_in_place():
    """Each document causal over its own part at a rank's own step: one call, no copies."""
    docs = Documents((8, 4, 12), 2, "zigzag")
    (call,) = packed_schedule.ring_calls(docs, True, 0, 0, None, torch.device("cpu"))
    assert call.rows is None and call.keys is None and call.mask == "top_left"
    assert call.lengths_q.view(-1).tolist() == [4, 2, 6, 0]  # slots bucketed to a power of two
