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

from .cache import default_cache
from .core.constructors import forward_problem
from .core.mask import Causal, ScoreOptions, default_scale
from .core.problem import TensorSpec
from .errors import ValidationError
from .ops import BACKEND_NAMES
from .runtime.keyed import KeyedCache
from .runtime.prepared import PreparedRun, prepare

DEFAULT_BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class BucketedAttention:
    """Attention over ``[B, H, S, D]`` tensors of any length up to the largest bucket, on few plans.

    Each request is padded up to the next bucket length and the padding masked (a padding mask
    with the real lengths), so N distinct lengths need at most one plan per bucket pair and
    batch geometry, and the results are those of the unpadded request. The price is a copy
    into the padded buffers and the work on the padded tail (< 2x with power-of-two buckets).

    Args:
        buckets: the padded lengths plans are built for: distinct, positive, ascending.
        causal: ``False``, ``True`` or ``"top_left"``, or ``"bottom_right"`` (the diagonal
            aligned with each request's real lengths, as decoding with a cache needs).
        max_plans: how many plans (bucket pairs times batch geometries) to keep at most.
        **graph_options: as ``Graph`` takes them: ``backend``, ``autotune``, ``cache``.

    Raises:
        ValidationError: bad buckets, causal value, option or ``max_plans``.

    Example:
        ```python
        import torch

        import cudnn_attn

        attend = cudnn_attn.BucketedAttention(buckets=(64, 128, 256), causal=True)
        for length in (50, 100, 120):  # three lengths, two plans
            q, k, v = (torch.randn(1, 4, length, 64, dtype=torch.float16) for _ in range(3))
            out = attend(q, k, v)  # [1, 4, length, 64]
        assert attend.plan_count == 2
        ```
    """

    def __init__(
        self,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        causal: bool | str = False,
        max_plans: int = 256,
        **graph_options: Any,
    ):
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValidationError([f"buckets: {buckets!r}; give distinct positive lengths in ascending order"])
        self.buckets = tuple(buckets)
        self.causal: str | None = "top_left" if causal is True else (None if causal is False else str(causal))
        if self.causal not in (None, "top_left", "bottom_right"):
            raise ValidationError([f"causal: {causal!r}; allowed False, True/'top_left', 'bottom_right'"])
        unknown = sorted(set(graph_options) - {"backend", "autotune", "cache"})
        if unknown:
            raise ValidationError(
                [f"{name}: not an option of BucketedAttention (backend, autotune, cache)" for name in unknown]
            )
        if graph_options.get("backend", "auto") not in BACKEND_NAMES:
            raise ValidationError(
                [f"backend: {graph_options['backend']!r}; allowed {', '.join(map(repr, BACKEND_NAMES))}"]
            )
        self.graph_options = graph_options
        if isinstance(max_plans, bool) or not isinstance(max_plans, int) or max_plans < 1:
            raise ValidationError([f"max_plans: {max_plans!r}; must be an int >= 1"])
        # By problem: one plan per bucket pair and geometry, the oldest dropped past max_plans.
        self._runs = KeyedCache(max_plans, release_at_exit=True)

    def bucket(self, length: int) -> int:
        """The bucket a sequence of ``length`` is padded to; ``ValidationError`` past the largest."""
        i = bisect.bisect_left(self.buckets, length)
        if i == len(self.buckets):
            raise ValidationError([f"sequence length {length} exceeds the largest bucket {self.buckets[-1]}"])
        return self.buckets[i]

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_scale: float | None = None
    ) -> torch.Tensor:
        """Attention of one request, padded to its buckets and cut back.

        Args:
            q: ``[B, H_q, S_q, D]``, float16 or bfloat16 (float32 on the reference backend).
            k: ``[B, H_kv, S_kv, D]``.
            v: ``[B, H_kv, S_kv, D_v]``.
            attn_scale: softmax scale; ``1 / sqrt(D)`` by default.

        Returns:
            ``[B, H_q, S_q, D_v]``, as attention over the unpadded tensors.

        Raises:
            ValidationError: a length past the largest bucket, or a malformed request.
        """
        s_q, s_kv = q.shape[2], k.shape[2]
        bq, bkv = self.bucket(s_q), self.bucket(s_kv)
        padded = [_pad(t, n) for t, n in ((q, bq), (k, bkv), (v, bkv))]
        lengths_q = torch.full((q.shape[0],), s_q, dtype=torch.int32, device=q.device)
        lengths_kv = torch.full((q.shape[0],), s_kv, dtype=torch.int32, device=q.device)
        scale = attn_scale if attn_scale is not None else default_scale(q.shape[-1])
        run = self._run(padded, lengths_q, lengths_kv, scale)
        out = run.run(
            {"q": padded[0], "k": padded[1], "v": padded[2], "seq_len_q": lengths_q, "seq_len_kv": lengths_kv}
        )["o"]
        return out[:, :, :s_q]

    def _run(
        self, padded: list[torch.Tensor], lengths_q: torch.Tensor, lengths_kv: torch.Tensor, scale: float
    ) -> PreparedRun:
        options = ScoreOptions(attn_scale=scale, causal=Causal(self.causal or "none"), padding=True)
        q, k, v = (TensorSpec.of(t) for t in padded)
        problem = forward_problem(
            q, k, v, options, seq_len_q=TensorSpec.of(lengths_q), seq_len_kv=TensorSpec.of(lengths_kv)
        )
        run = self._runs.get(problem)
        if run is None:
            run = self._runs.put(problem, prepare(problem, context="BucketedAttention", **self.graph_options))
            (self.graph_options.get("cache") or default_cache()).on_drop(self._runs.forget_plans)
        return run

    @property
    def plan_count(self) -> int:
        """How many distinct plans (one per bucket pair and geometry) this object has used."""
        return len(self._runs)


def _pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """``t`` ([B, H, S, D]) in a buffer of S = ``length`` with ``t``'s memory order; the tail is 0."""
    shape = (t.shape[0], t.shape[1], length, t.shape[3])
    order = sorted(range(4), key=lambda i: -t.stride()[i])
    storage = torch.zeros([shape[i] for i in order], dtype=t.dtype, device=t.device)
    out = storage.permute([order.index(i) for i in range(4)])
    out[:, :, : t.shape[2]] = t
    return out
