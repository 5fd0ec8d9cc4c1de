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
import numbers
from typing import Any

import torch

from .cache import PlanCache, default_cache
from .core.constructors import forward_problem
from .core.dtypes import dtype_name
from .core.finite import finite_real
from .core.mask import Causal, ScoreOptions, default_scale
from .core.problem import TensorSpec
from .errors import UnsupportedError, ValidationError, shown
from .ops import BACKEND_NAMES, LENGTHS_BACKEND_NAMES
from .runtime.keyed import KeyedCache
from .runtime.prepared import PreparedRun, prepare

DEFAULT_BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
CONTEXT = "BucketedAttention"  # every error's prefix: the caller's object, not the graph inside it


class BucketedAttention:
    """Attention over ``[B, H, S, D]`` tensors of any length up to the largest bucket, on few plans.

    Each request is padded up to the next bucket length and the padding masked (a padding mask
    with the real lengths), so N distinct lengths need at most one plan per bucket pair and
    batch geometry, and the results are those of the unpadded request. The price is a copy
    into the padded buffers and the work on the padded tail (< 2x with power-of-two buckets).

    Args:
        buckets: the padded lengths plans are built for: a tuple (or list) of distinct positive
            ints in ascending order.
        causal: ``False``, ``True`` or ``"top_left"``, or ``"bottom_right"`` (the diagonal
            aligned with each request's real lengths, as decoding with a cache needs).
        max_plans: how many plans (bucket pairs times batch geometries) to keep at most.
        **graph_options: as ``Graph`` takes them: ``backend`` (``"auto"``, ``"cudnn"`` or
            ``"reference"``: torch's kernel takes no padding mask), ``autotune``, ``cache``.

    Raises:
        ValidationError: bad buckets, causal value, option (``backend``, ``autotune``, ``cache``)
            or ``max_plans``.

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
        self.buckets = _buckets(buckets)
        self.causal: str | None = "top_left" if causal is True else (None if causal is False else str(causal))
        if self.causal not in (None, "top_left", "bottom_right"):
            raise ValidationError([f"causal: {shown(causal)}; allowed False, True/'top_left', 'bottom_right'"], CONTEXT)
        unknown = sorted(set(graph_options) - {"backend", "autotune", "cache"})
        if unknown:
            raise ValidationError(
                [f"{name}: not an option of BucketedAttention (backend, autotune, cache)" for name in unknown], CONTEXT
            )
        problems = []
        backend = graph_options.get("backend", "auto")
        allowed = ", ".join(map(repr, LENGTHS_BACKEND_NAMES))
        if isinstance(backend, str) and backend in BACKEND_NAMES and backend not in LENGTHS_BACKEND_NAMES:
            raise UnsupportedError(
                [f"backend: {backend!r}; its kernel takes no per-sequence lengths, which every request needs"],
                context=CONTEXT,
                alternatives=[f"backend={name!r}" for name in LENGTHS_BACKEND_NAMES],
            )
        if not isinstance(backend, str) or backend not in BACKEND_NAMES:
            problems.append(f"backend: {shown(backend)}; allowed {allowed}")
        autotune = graph_options.get("autotune")
        if autotune is not None and not isinstance(autotune, bool):  # bool("false") is True
            problems.append(f"autotune: {shown(autotune)}; expected True, False or None")
        cache = graph_options.get("cache")
        if cache is not None and not isinstance(cache, PlanCache):  # else it fails at the first call
            problems.append(f"cache: {type(cache).__name__}; expected a cudnn_attn.PlanCache or None")
        if isinstance(max_plans, bool) or not isinstance(max_plans, int) or max_plans < 1:
            problems.append(f"max_plans: {shown(max_plans)}; must be an int >= 1")
        if problems:
            raise ValidationError(problems, CONTEXT)
        self.graph_options = graph_options
        # By problem: one plan per bucket pair and geometry, the oldest dropped past max_plans.
        self._runs = KeyedCache(max_plans, release_at_exit=True)

    def bucket(self, length: int) -> int:
        """The bucket a sequence of ``length`` is padded to; ``ValidationError`` past the largest."""
        if isinstance(length, bool) or not isinstance(length, numbers.Integral) or length < 0:
            raise ValidationError([f"length: {shown(length)}; expected an int >= 0"], CONTEXT)
        return self._bucket("length", int(length))

    def _bucket(self, name: str, length: int) -> int:
        i = bisect.bisect_left(self.buckets, length)
        if i == len(self.buckets):
            raise ValidationError(
                [f"{name}: sequence length {length} exceeds the largest bucket {self.buckets[-1]}"], CONTEXT
            )
        return self.buckets[i]

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_scale: float | None = None
    ) -> torch.Tensor:
        """Attention of one request, padded to its buckets and cut back.

        Args:
            q: ``[B, H_q, S_q, D]``, float16 or bfloat16 (float32 on the reference backend); any
                strides (expanded or transposed views too: each is copied into a contiguous
                padded buffer).
            k: ``[B, H_kv, S_kv, D]``, ``H_kv`` dividing ``H_q`` (GQA/MQA).
            v: ``[B, H_kv, S_kv, D_v]``, as many keys as ``k``.
            attn_scale: softmax scale; ``1 / sqrt(D)`` by default.

        Returns:
            ``[B, H_q, S_q, D_v]``, as attention over the unpadded tensors (empty for B = 0).

        Raises:
            ValidationError: a length past the largest bucket, or a malformed request (each
                line names ``q``, ``k``, ``v`` or ``attn_scale``).
        """
        _check_request(q, k, v, attn_scale)
        s_q, s_kv = q.shape[2], k.shape[2]
        padded_lengths, problems = [], []
        for name, length in (("q", s_q), ("k", s_kv)):
            try:
                padded_lengths.append(self._bucket(name, length))
            except ValidationError as error:  # both lengths' problems in one error
                problems += error.problems
        if problems:
            raise ValidationError(problems, CONTEXT)
        scale = float(attn_scale) if attn_scale is not None else default_scale(q.shape[-1])
        if q.shape[0] == 0:  # torch's empty call: an empty result, no plan (cuDNN takes no empty batch)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        bq, bkv = padded_lengths
        padded = [_pad(t, n) for t, n in ((q, bq), (k, bkv), (v, bkv))]
        lengths_q = torch.full((q.shape[0],), s_q, dtype=torch.int32, device=q.device)
        lengths_kv = torch.full((q.shape[0],), s_kv, dtype=torch.int32, device=q.device)
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
            run = self._runs.put(problem, prepare(problem, context=CONTEXT, **self.graph_options))
            (cache if (cache := self.graph_options.get("cache")) is not None else default_cache()).on_drop(
                self._runs.forget_plans
            )
        return run

    @property
    def plan_count(self) -> int:
        """How many distinct plans (one per bucket pair and geometry) this object has used."""
        return len(self._runs)


def _buckets(buckets: Any) -> tuple[int, ...]:
    """``buckets`` as a tuple of ints, or ``ValidationError`` naming it."""
    wrong = ValidationError(
        [f"buckets: {shown(buckets)}; give a tuple of distinct positive int lengths in ascending order"], CONTEXT
    )
    if not isinstance(buckets, (tuple, list, range)):  # a tensor, a set (no order), a str, one int
        raise wrong
    if not buckets or any(isinstance(b, bool) or not isinstance(b, numbers.Integral) for b in buckets):
        raise wrong  # a float length would reach torch.zeros at the first call
    lengths = tuple(int(b) for b in buckets)
    if list(lengths) != sorted(set(lengths)) or lengths[0] < 1:
        raise wrong
    return lengths


def _check_request(q: Any, k: Any, v: Any, attn_scale: Any) -> None:
    """What a request must be before it is padded: every problem found, in the caller's names
    (the padded buffers and the length tensors are internal; an error about them would not
    say what the caller gave)."""
    problems = []
    tensors = {}
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            problems.append(f"{name}: {type(t).__name__}; expected a torch tensor [B, H, S, D]")
        elif t.is_nested:
            problems.append(f"{name}: a nested tensor; BucketedAttention takes dense [B, H, S, D] tensors")
        elif t.dim() != 4:
            problems.append(f"{name}: {t.dim()}-D (shape {list(t.shape)}); expected 4-D [B, H, S, D]")
        elif t.dtype not in DTYPES:  # FP8 needs scales: sdpa_fp8's door, not this one
            problems.append(f"{name}: dtype {dtype_name(t.dtype)}; expected float16, bfloat16, float32 or float64")
        else:
            tensors[name] = t
    if attn_scale is not None and not finite_real(attn_scale):
        problems.append(f"attn_scale: {shown(attn_scale)}; expected a finite float or None (1 / sqrt(D))")
    if len(tensors) == 3:
        problems += _geometry_problems(q, k, v)
    if problems:
        raise ValidationError(problems, CONTEXT)


def _geometry_problems(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[str]:
    """What must agree between q, k and v ([B, H, S, D] each)."""
    problems = []
    if k.dtype != q.dtype or v.dtype != q.dtype:
        dtypes = [dtype_name(t.dtype) for t in (q, k, v)]
        problems.append(f"q: dtype {dtypes[0]} but k is {dtypes[1]} and v {dtypes[2]}; they must share one dtype")
    if k.device != q.device or v.device != q.device:
        problems.append(f"q: on {q.device} but k on {k.device} and v on {v.device}; put them on one device")
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] != q.shape[0]:
            problems.append(f"{name}: batch {t.shape[0]} differs from q's {q.shape[0]}")
    no_heads = [f"{name}: 0 heads; heads must be >= 1" for name, t in (("q", q), ("k", k), ("v", v)) if not t.shape[1]]
    problems += no_heads
    if not no_heads and v.shape[1] != k.shape[1]:
        problems.append(f"v: {v.shape[1]} heads but k has {k.shape[1]}; they must match")
    elif not no_heads and q.shape[1] % k.shape[1]:
        problems.append(f"k: {k.shape[1]} heads do not divide q's {q.shape[1]} (GQA/MQA needs H_kv to divide H_q)")
    if v.shape[2] != k.shape[2]:  # a longer v would be cut to k's length by the padding mask, silently
        problems.append(f"v: {v.shape[2]} keys but k has {k.shape[2]}; they must match")
    if k.shape[3] != q.shape[3]:
        problems.append(f"k: head dim {k.shape[3]} differs from q's {q.shape[3]}; they must match")
    for name, t in (("q", q), ("v", v)):
        if t.shape[3] == 0:
            problems.append(f"{name}: head dim 0 (shape {list(t.shape)}); head dims must be >= 1")
    return problems


def _pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """``t`` ([B, H, S, D]) in a buffer of S = ``length``, the tail 0: BSHD-contiguous where ``t``
    is laid out so, else BHSD-contiguous. Never ``t``'s own stride order: a stride-0 (expanded)
    dimension or a head dim that is not innermost would give a buffer the kernels refuse."""
    b, h, s, d = t.shape
    if t.stride(3) == 1 and t.stride(2) > t.stride(1):  # the head dim innermost, then the heads: BSHD
        out = torch.zeros(b, length, h, d, dtype=t.dtype, device=t.device).transpose(1, 2)
    else:
        out = torch.zeros(b, h, length, d, dtype=t.dtype, device=t.device)
    out[:, :, :s] = t
    return out
