"""Shape buckets: serve any sequence length with a bounded number of plans.

A server sees many lengths; a plan is specialised on every shape. ``BucketedAttention``
pads each request up to the next bucket length and masks the padding (a padding mask with
the real lengths), so N distinct lengths need at most one plan per bucket pair, and results
are exactly those of the unpadded request. The price is a copy into the padded buffers and
the work on the padded tail, bounded by the bucket spacing (powers of two: < 2x).

Example::

    attend = cudnn_attn.BucketedAttention(buckets=(256, 512, 1024, 2048), causal=True)
    out = attend(q, k, v)   # q: [B, H, S_q, D] with any S_q <= 2048
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

from .core.mask import default_scale
from .errors import ValidationError
from .graph import Graph
from .graph_cache import GraphCache

DEFAULT_BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class BucketedAttention:
    """Attention over ``[B, H, S, D]`` tensors of any length up to the largest bucket.

    Args:
        buckets: the padded lengths plans are built for, ascending.
        causal: ``"top_left"`` (``True``), ``"bottom_right"`` or ``False``; bottom-right aligns
            the diagonal with each request's real lengths, as decoding with a cache needs.
        graph_options: passed to each ``Graph`` (``backend``, ``autotune``, ``cache``).
    """

    def __init__(self, buckets: tuple[int, ...] = DEFAULT_BUCKETS, causal: bool | str = False, **graph_options: Any):
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValidationError([f"buckets: {buckets!r}; give distinct positive lengths in ascending order"])
        self.buckets = tuple(buckets)
        self.causal: str | None = "top_left" if causal is True else (None if causal is False else str(causal))
        if self.causal not in (None, "top_left", "bottom_right"):
            raise ValidationError([f"causal: {causal!r}; allowed False, True/'top_left', 'bottom_right'"])
        self.graph_options = graph_options
        self._graphs = GraphCache(**graph_options)

    def bucket(self, length: int) -> int:
        i = bisect.bisect_left(self.buckets, length)
        if i == len(self.buckets):
            raise ValidationError([f"sequence length {length} exceeds the largest bucket {self.buckets[-1]}"])
        return self.buckets[i]

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_scale: float | None = None
    ) -> torch.Tensor:
        s_q, s_kv = q.shape[2], k.shape[2]
        bq, bkv = self.bucket(s_q), self.bucket(s_kv)
        padded = [_pad(t, n) for t, n in ((q, bq), (k, bkv), (v, bkv))]
        lengths_q = torch.full((q.shape[0],), s_q, dtype=torch.int32, device=q.device)
        lengths_kv = torch.full((q.shape[0],), s_kv, dtype=torch.int32, device=q.device)
        scale = attn_scale if attn_scale is not None else default_scale(q.shape[-1])
        graph = self._graph(padded, lengths_q, lengths_kv, scale)
        out = graph(*padded, lengths_q, lengths_kv)
        return out[:, :, :s_q]

    def _graph(
        self, padded: list[torch.Tensor], lengths_q: torch.Tensor, lengths_kv: torch.Tensor, scale: float
    ) -> Graph:
        key = (*(tuple(t.shape) + tuple(t.stride()) for t in padded), padded[0].dtype, str(padded[0].device), scale)

        def record(graph: Graph) -> None:
            graph.sdpa(
                *padded, attn_scale=scale, use_padding_mask=True, seq_len_q=lengths_q, seq_len_kv=lengths_kv,
                use_causal_mask=self.causal == "top_left", use_causal_mask_bottom_right=self.causal == "bottom_right",
            )  # fmt: skip

        return self._graphs.get_or_build(key, record)

    @property
    def plan_count(self) -> int:
        """How many distinct graphs (one plan each) this object holds."""
        return len(self._graphs)


def _pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """``t`` ([B, H, S, D]) in a buffer of S = ``length`` with ``t``'s memory order; the tail is 0."""
    shape = (t.shape[0], t.shape[1], length, t.shape[3])
    order = sorted(range(4), key=lambda i: -t.stride()[i])
    storage = torch.zeros([shape[i] for i in order], dtype=t.dtype, device=t.device)
    out = storage.permute([order.index(i) for i in range(4)])
    out[:, :, : t.shape[2]] = t
    return out
