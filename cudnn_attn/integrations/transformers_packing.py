"""How a transformers batch is laid out, read from its token mask or keywords: per sequence
query and key starts for ``varlen_attention`` (``Packing``), from padding, restarting
position ids, or ``DataCollatorWithFlattening``'s ``cu_seq_lens_*`` keywords; recent results
kept, so the layers of one forward derive a batch's packing once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import UnsupportedError, ValidationError

CONTEXT = "cudnn_attn (transformers)"


@dataclass(frozen=True)
class Packing:
    """Where a batch's real tokens sit, prepared once per mask for every layer. ``rows_q`` and
    ``rows_k`` index the ``[B, S]`` grid (``None``: all rows in order); the first ``keys`` keys count;
    ``aligned``: every sequence has as many queries as keys (None: not known)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    keys: int
    aligned: bool | None
    rows_q: tuple[torch.Tensor, ...] | None = None
    rows_k: tuple[torch.Tensor, ...] | None = None


class _RecentPackings:
    """The last few packings, by source tensor: every layer of a forward gets the same mask (two
    alternating ones in models with sliding and full layers), so each is prepared once."""

    def __init__(self, size: int = 4):
        self._size = size
        self._entries: list[tuple[torch.Tensor, int | None, tuple, Packing | None]] = []

    def get(self, source: torch.Tensor, key: tuple, build: Callable[[], Packing | None]) -> Packing | None:
        version = _tensor_version(source)
        for entry in self._entries:
            if entry[0] is source and entry[1] == version and entry[2] == key:
                return entry[3]
        packing = build()
        self._entries = [(source, version, key, packing), *self._entries[: self._size - 1]]
        return packing


_recent = _RecentPackings()


def _tensor_version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter
        return None


def find_packing(mask, kwargs: dict, batch: int, q_len: int, k_len: int, causal: bool) -> Packing | None:
    """How this layer's tokens pack, or None when they need no packing (no padding, no runs)."""
    if mask is not None:
        if mask.shape[0] != batch:
            raise ValidationError(
                [f"attention_mask: shape {list(mask.shape)}; expected [{batch}, keys]"], context=CONTEXT
            )
        packing = _recent.get(mask, (q_len, causal), lambda: _from_token_ids(mask, q_len, causal))
        if packing is not None and packing.keys > k_len:
            raise ValidationError(
                [f"attention_mask: covers {packing.keys} keys, the layer has {k_len}"], context=CONTEXT
            )
        return packing
    cu_q, cu_k, max_q, max_k = (
        kwargs.get(name) for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    )
    if cu_q is not None and cu_k is not None and max_q is not None and max_k is not None:
        return Packing(cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k), k_len, aligned=None)
    positions = kwargs.get("position_ids")
    if isinstance(positions, torch.Tensor) and batch == 1 and q_len == k_len > 1 and positions.numel() == q_len:
        return _recent.get(positions, (q_len,), lambda: _from_positions(positions.reshape(-1)))
    return None


def _from_token_ids(ids: torch.Tensor, q_len: int, causal: bool) -> Packing:
    """Packing from per-token sequence ids ``[B, M]`` (0 = padding). Causal: the queries are the
    last ``q_len`` keys; otherwise every query (cross-attention too) sees its row's real keys."""
    batch, keys = ids.shape
    if ids.is_floating_point() or ids.is_complex():
        raise ValidationError(
            [f"attention_mask: dtype {ids.dtype}; expected a bool or integer [B, keys] token mask"], context=CONTEXT
        )
    if causal and keys < q_len:
        raise ValidationError([f"attention_mask: covers {keys} keys, fewer than the {q_len} queries"], context=CONTEXT)
    ids = ids.to(torch.int64)
    real = ids > 0
    per_row = max(int(ids.max()), 1)
    slot = ids - 1 + per_row * torch.arange(batch, device=ids.device)[:, None]  # each token's sequence
    slot_k = slot[real]
    if bool((slot_k.diff() < 0).any()):
        raise ValidationError(
            ["attention_mask: sequence ids decrease along a row; each sequence's tokens must be consecutive"],
            context=CONTEXT,
        )
    if not causal and per_row > 1:
        raise UnsupportedError(["attention_mask: packed sequences without a causal mask"], context=CONTEXT)
    lengths_k = torch.bincount(slot_k, minlength=batch * per_row)
    everything = bool(real.all())
    rows_k = None if everything else real.nonzero(as_tuple=True)
    if causal:
        real_q = real[:, keys - q_len :]
        lengths_q = torch.bincount(slot[:, keys - q_len :][real_q], minlength=batch * per_row)
        rows_q = None if everything and keys == q_len else real_q.nonzero(as_tuple=True)
    else:
        lengths_q, rows_q = torch.full((batch,), q_len, dtype=torch.int64, device=ids.device), None
    longest_q, longest_k = torch.stack([lengths_q.max(), lengths_k.max()]).tolist()
    return Packing(
        _cumulative(lengths_q),
        _cumulative(lengths_k),
        max(int(longest_q), 1),
        max(int(longest_k), 1),
        keys,
        causal and keys == q_len,
        rows_q,
        rows_k,
    )


def _from_positions(positions: torch.Tensor) -> Packing | None:
    """transformers' FlashAttention rule for a one-row batch: a sequence starts wherever the
    position is the row's smallest (and at the row's start); None when the row is one run."""
    length = positions.shape[0]
    first = positions.min()
    steps = torch.arange(length, device=positions.device)
    if not bool((positions - first - steps).abs().sum()):
        return None
    starts = ((positions == first) | (steps == 0)).nonzero().view(-1)
    cu = torch.cat([starts, starts.new_tensor([length])]).to(torch.int32)
    longest = int(cu.diff().max())
    return Packing(cu, cu, longest, longest, length, aligned=True)


def _cumulative(lengths: torch.Tensor) -> torch.Tensor:
    return F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)


def packed_mask(packing: Packing, q_len: int, k_len: int, causal: bool, window: int | None) -> torch.Tensor:
    """A dense boolean ``[1, 1, Q, K]`` mask of one row of caller-packed sequences (``cu_seq_lens``
    keywords, as transformers' continuous batching passes them): query i sees the keys of its own
    sequence, causal aligned bottom-right (a sequence's queries are the last of its keys), within
    ``window`` keys before it. Rows past the last sequence see every key (their output is unused)."""
    device = packing.cu_q.device
    cu_q, cu_k = packing.cu_q.to(torch.int64), packing.cu_k.to(torch.int64).to(device)
    rows, cols = torch.arange(q_len, device=device), torch.arange(k_len, device=device)
    seq_q = torch.searchsorted(cu_q[1:], rows, right=True).clamp(max=cu_q.numel() - 2)
    seq_k = torch.searchsorted(cu_k[1:], cols, right=True).clamp(max=cu_k.numel() - 2)
    pos_k = cols - cu_k[seq_k]
    lengths_q, lengths_k = cu_q.diff(), cu_k.diff()
    last = (lengths_k - lengths_q)[seq_q] + rows - cu_q[seq_q]  # each query's position among its keys
    allowed = (seq_q[:, None] == seq_k[None, :]) & (rows < cu_q[-1])[:, None] & (cols < cu_k[-1])[None, :]
    if causal:
        allowed &= pos_k[None, :] <= last[:, None]
    if window is not None:  # window = sliding_window - 1, as the layers pass it
        allowed &= pos_k[None, :] > last[:, None] - (window + 1)
    allowed |= ~allowed.any(-1, keepdim=True)
    return allowed[None, None]
