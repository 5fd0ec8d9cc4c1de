"""``cudnn_attn.PagedAttention``: serving attention, planned once per step, run per layer.

An inference server runs the same attention shape in every layer of a decode step, with a
page table and lengths that change once per step. ``plan`` does the per-step work once:
checks (on the CPU, naming the page or length), values made safe on the device without a
host sync, the layout (``paged_schedule``: split-KV and query packing) and every derived
table and length, in persistent buffers. ``run`` then launches only attention work::

    attn = cudnn_attn.PagedAttention(32, 8, 128, page_size=64, dtype=torch.bfloat16, device="cuda")
    attn.plan(page_table, seq_lens_kv)          # once per step: [B, pages] int32, [B] int32
    for layer in layers:
        out = attn.run(q, k_cache[layer], v_cache[layer])   # q: [B, 32, S_q, 128]

Decode takes ``S_q = 1``; multi-token decode (speculative) takes ``S_q`` up to 16, each
sequence's query tokens being its last ``S_q`` positions (bottom-right causal). Chunked
prefill plans with ``q_lens`` and runs packed queries ``[T, H_q, D]``: sequence ``i``'s
``q_lens[i]`` tokens are the last ones of its cache (bottom-right causal), so one step mixes
prefill chunks and decode tokens::

    attn.plan(page_table, seq_lens_kv, q_lens=q_lens)   # q_lens[i] <= seq_lens_kv[i]
    out = attn.run(q_packed, k_cache[layer], v_cache[layer])  # [T, 32, 128], T >= sum(q_lens)

The caches
are ``[num_pages, H_kv, page_size, D]`` (``kv_layout="NHPD"``) or ``[num_pages, page_size,
H_kv, D]`` (``"NPHD"``). With ``cuda_graph=True`` every buffer has ``max_batch`` rows: a
whole step (all layers' ``run``) can be captured once and replayed after each ``plan``,
which rewrites the buffers in place; batches smaller than ``max_batch`` are padded with
empty sequences. The captured kernels read this instance's buffers: keep it alive as long as
the graph replays.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.constructors import forward_problem
from ..core.mask import Causal, ScoreOptions, default_scale
from ..core.problem import KVCacheLayout, TensorSpec
from ..errors import ValidationError
from ..kernels import paged_decode
from ..kernels.lse_merge import merge_partials
from ..runtime.keyed import KeyedCache
from ..runtime.prepared import PreparedRun, prepare
from . import schedule as paged_schedule
from .schedule import Schedule
from .step import Step, StepBuffers, StepTables, bucket, canonical_device, geometry

LAYOUTS = ("NHPD", "NPHD")
MAX_QUERY_TOKENS = 16
MAX_RUNS = 256  # the prepared runs one instance keeps: a few per layer geometry


class PagedAttention:
    """Attention over paged K/V caches for a serving loop: ``plan`` per step, ``run`` per layer.

    Args:
        num_q_heads, num_kv_heads, head_dim, page_size: the model's attention geometry.
        dtype: of q and the caches (float16 or bfloat16).
        kv_layout: ``"NHPD"`` or ``"NPHD"`` (see the module docstring).
        max_batch, max_pages_per_seq: the largest step (required with ``cuda_graph``).
        cuda_graph: fixed-size persistent buffers, so captured runs stay valid across plans.
        splits, pack, decode_kernel: force the layout and single-token decode's kernel
            (``"cudnn"`` or ``"triton"``; None: chosen per step, ``paged_schedule.choose``).
        scale: softmax scale (default ``1/sqrt(head_dim)``).
        autotune: time every cuDNN candidate when a plan is built (plans found in the plan store,
            tuned or not, load as they are; ``cudnn-attn cache warm`` stores tuned ones).
    """

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        dtype: torch.dtype,
        kv_layout: str = "NHPD",
        max_batch: int | None = None,
        max_pages_per_seq: int | None = None,
        cuda_graph: bool = False,
        device: Any = None,
        splits: int | None = None,
        pack: bool | None = None,
        scale: float | None = None,
        autotune: bool = False,
        decode_kernel: str | None = None,
    ):
        problems = []
        for name, value in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("page_size", page_size)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}: {value!r}; must be an int >= 1")
        if not problems and num_q_heads % num_kv_heads:
            problems.append(f"num_kv_heads: {num_kv_heads} does not divide num_q_heads={num_q_heads}")
        if dtype not in (torch.float16, torch.bfloat16):
            problems.append(f"dtype: {dtype}; expected torch.float16 or torch.bfloat16")
        if kv_layout not in LAYOUTS:
            problems.append(f"kv_layout: {kv_layout!r}; allowed 'NHPD' or 'NPHD'")
        for name, limit in (("max_batch", max_batch), ("max_pages_per_seq", max_pages_per_seq), ("splits", splits)):
            if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
                problems.append(f"{name}: {limit!r}; must be None or an int >= 1")
        if decode_kernel is not None and decode_kernel not in paged_schedule.KERNELS:
            problems.append(f"decode_kernel: {decode_kernel!r}; allowed None, 'cudnn' or 'triton'")
        if cuda_graph and (max_batch is None or max_pages_per_seq is None):
            problems.append("cuda_graph: True needs max_batch and max_pages_per_seq (the buffers' fixed sizes)")
        if problems:
            raise ValidationError(problems, context="PagedAttention")
        self.num_q_heads, self.num_kv_heads, self.head_dim, self.page_size = (num_q_heads, num_kv_heads, head_dim,
                                                                              page_size)  # fmt: skip
        self.dtype, self.kv_layout, self.cuda_graph = dtype, kv_layout, cuda_graph
        self.max_batch, self.max_pages_per_seq = max_batch, max_pages_per_seq
        self.device = canonical_device(device) if device is not None else None
        self.scale = float(scale) if scale is not None else default_scale(head_dim)
        self._autotune = bool(autotune)
        # Prepared runs by the problem their plan was built for, held as long as this instance (a
        # captured step replays their plans), not dropped with the plan cache's entries.
        self._runs = KeyedCache(MAX_RUNS)  # by the problem a plan was built for
        self._fast = KeyedCache(4 * MAX_RUNS)  # by the call's tensor geometry, in front
        self._buffers = StepBuffers(cuda_graph)
        self._tables = StepTables(num_q_heads, num_kv_heads, head_dim, page_size, buffers=self._buffers,
                                  splits=splits, pack=pack, kernel=decode_kernel)  # fmt: skip
        self.schedule: Schedule | None = None
        self.plans = 0

    # ---- plan: once per step ------------------------------------------------------------------

    def plan(self, page_table: torch.Tensor, seq_lens_kv: torch.Tensor, q_lens: torch.Tensor | None = None) -> None:
        """Prepare a step: ``page_table`` ``[B, pages_per_seq]`` int32 (page indices into the
        caches), ``seq_lens_kv`` ``[B]`` int32 (each sequence's cache length, the new tokens
        included), ``q_lens`` ``[B]`` int32 for chunked prefill (each sequence's new tokens, at
        most its cache length; ``run`` then takes packed ``[T, H_q, D]`` queries). CPU tensors
        are checked value by value, here, and page indices against each cache at ``run`` (which
        sees the cache); CUDA ones are clamped into range on the device, without a host sync: a
        page past the cache reads its last page, and a bad value gives wrong rows for its
        sequence, never an access out of bounds."""
        device = self._check_plan(page_table, seq_lens_kv, q_lens)
        batch, pages = page_table.shape
        rows = self.max_batch if self.cuda_graph else batch
        width = self.max_pages_per_seq if self.cuda_graph else pages
        assert rows is not None and width is not None
        self._tables.plan(page_table, seq_lens_kv, q_lens, device, rows, width)
        self.plans += 1

    def _check_plan(self, page_table: Any, seq_lens_kv: Any, q_lens: Any) -> torch.device:
        problems = []
        given = [("page_table", page_table, 2), ("seq_lens_kv", seq_lens_kv, 1)]
        for name, t, rank in given + ([("q_lens", q_lens, 1)] if q_lens is not None else []):
            if not isinstance(t, torch.Tensor):
                problems.append(f"{name}: {type(t).__name__}; expected an int32 tensor")
            elif t.dtype != torch.int32 or t.dim() != rank:
                problems.append(f"{name}: {t.dtype} of shape {list(t.shape)}; expected int32 with {rank} dims")
        if problems:
            raise ValidationError(problems, context="PagedAttention.plan")
        batch, pages = page_table.shape
        if seq_lens_kv.shape[0] != batch:
            problems.append(f"seq_lens_kv: {seq_lens_kv.shape[0]} lengths for {batch} page-table rows")
        if q_lens is not None and q_lens.shape[0] != batch:
            problems.append(f"q_lens: {q_lens.shape[0]} lengths for {batch} page-table rows")
        if batch < 1 or pages < 1:
            problems.append(f"page_table: shape {list(page_table.shape)}; needs at least one sequence and one page")
        if self.max_batch is not None and batch > self.max_batch:
            problems.append(f"page_table: {batch} sequences, above max_batch={self.max_batch}")
        if self.max_pages_per_seq is not None and pages > self.max_pages_per_seq:
            problems.append(f"page_table: {pages} pages per sequence, above max_pages_per_seq={self.max_pages_per_seq}")
        device = self.device if self.device is not None else page_table.device
        if self.device is not None and page_table.device.type != "cpu" and page_table.device != device:
            problems.append(f"page_table: on {page_table.device}; this PagedAttention runs on {device}")
        if not problems and not page_table.is_cuda:
            if (page_table < 0).any():
                row, col = (int(i) for i in torch.nonzero(page_table < 0)[0])
                problems.append(f"page_table: page {int(page_table[row, col])} at [{row}, {col}] is negative")
            limit = pages * self.page_size
            bad = (seq_lens_kv < 0) | (seq_lens_kv > limit)  # 0: an empty slot, whose output is zeros
            if bad.any():
                at = int(torch.nonzero(bad)[0])
                problems.append(f"seq_lens_kv: sequence {at} has length {int(seq_lens_kv[at])}; allowed 0..{limit} "
                                f"({pages} pages of {self.page_size})")  # fmt: skip
            elif q_lens is not None and not q_lens.is_cuda and ((q_lens < 0) | (q_lens > seq_lens_kv)).any():
                at = int(torch.nonzero((q_lens < 0) | (q_lens > seq_lens_kv))[0])
                problems.append(f"q_lens: sequence {at} has {int(q_lens[at])} new tokens; allowed 0..seq_lens_kv[{at}]="
                                f"{int(seq_lens_kv[at])} (the new tokens are the last of its cache)")  # fmt: skip
        if problems:
            raise ValidationError(problems, context="PagedAttention.plan")
        return device

    # ---- warm: at a server's start ---------------------------------------------------------------

    def warm(self, num_pages: int, *, s_q: tuple[int, ...] = (1,), prefill_tokens: tuple[int, ...] = ()) -> list[str]:
        """Build (or load from the plan store) every plan the steps of this server run, before
        the first request: decode with each of ``s_q`` query tokens, and chunked prefill with
        each packed token count of ``prefill_tokens``, for caches of ``num_pages`` pages and
        steps of ``max_batch`` sequences of ``max_pages_per_seq`` pages (required here). With
        ``cuda_graph`` that is every plan a step can need; without it, steps of other sizes
        build their own. Returns each plan's source ("built", "disk"); plan again after.

        Example, at a server's start (``cudnn-attn cache warm`` does the same from a shape list)::

            attn = PagedAttention(32, 8, 128, 64, dtype=torch.bfloat16, max_batch=64,
                                  max_pages_per_seq=512, cuda_graph=True, device="cuda")
            attn.warm(num_pages=40_000, s_q=(1, 4), prefill_tokens=(4096,))
        """
        problems = []
        if self.max_batch is None or self.max_pages_per_seq is None:
            problems.append("max_batch: warm() needs max_batch and max_pages_per_seq (the step geometry to plan for)")
        for name, values in (("s_q", s_q), ("prefill_tokens", prefill_tokens)):
            if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in values):
                problems.append(f"{name}: {values!r}; expected ints >= 1")
        if any(n > MAX_QUERY_TOKENS for n in s_q if isinstance(n, int)):
            problems.append(f"s_q: {s_q!r}; decode takes 1..{MAX_QUERY_TOKENS} query tokens")
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            problems.append(f"num_pages: {num_pages!r}; must be an int >= 1")
        if problems:
            raise ValidationError(problems, context="PagedAttention.warm")
        assert self.max_batch is not None and self.max_pages_per_seq is not None
        device = self.device or canonical_device("cuda" if torch.cuda.is_available() else "cpu")
        rows, width, page = self.max_batch, self.max_pages_per_seq, self.page_size
        shape = ((num_pages, self.num_kv_heads, page, self.head_dim) if self.kv_layout == "NHPD"
                 else (num_pages, page, self.num_kv_heads, self.head_dim))  # fmt: skip
        k_cache, v_cache = (torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(2))
        table = (torch.arange(rows * width, dtype=torch.int32, device=device) % num_pages).view(rows, width)
        lengths = torch.full((rows,), width * page, dtype=torch.int32, device=device)
        self.plan(table, lengths)
        for tokens in s_q:
            self.run(torch.zeros(rows, self.num_q_heads, tokens, self.head_dim, dtype=self.dtype, device=device),
                     k_cache, v_cache)  # fmt: skip
        for tokens in prefill_tokens:
            q = torch.zeros(tokens, self.num_q_heads, self.head_dim, dtype=self.dtype, device=device)
            most = min(tokens, width * page)  # without cuda_graph, each chunk bucket up to it is a plan
            buckets = {bucket(1 << b) for b in range(most.bit_length() + 1)} if not self.cuda_graph else set()
            for chunk in sorted({min(size, most) for size in buckets} | {most}):
                q_lens = torch.zeros(rows, dtype=torch.int32)
                q_lens[: tokens // chunk] = chunk
                self.plan(table, lengths, q_lens=q_lens)
                self.run(q, k_cache, v_cache)
        self._tables.step = None
        return [getattr(run.plan, "source", "reference") for run in self._runs.values()]

    # ---- run: per layer -----------------------------------------------------------------------

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor | None = None):
        """One layer: ``q`` ``[B, H_q, S_q, D]`` (S_q <= 16), or packed ``[T, H_q, D]`` after a
        plan with ``q_lens``, and the layer's caches; returns ``out`` (or a new tensor) of
        ``q``'s shape. Output rows past ``sum(q_lens)`` are zero. A page table planned on the
        CPU is refused here if it names a page past ``k_cache``'s (``ValidationError``)."""
        step = self._tables.step
        if step is None:
            raise ValidationError(["plan: run() before any plan(); call plan(page_table, seq_lens_kv) each step"],
                                  context="PagedAttention.run")  # fmt: skip
        self._check_run(q, k_cache, v_cache, out, step)
        if step.prefill:
            return self._run_prefill(q, k_cache, v_cache, out, step)
        # A geometry new to this PagedAttention is derived now, and by every later plan().
        derived = self._tables.get(("decode", q.shape[2], k_cache.shape[0]), step)
        schedule = derived["schedule"]
        self.schedule = schedule
        rows = step.rows
        if q.shape[0] != rows:  # cuda_graph: the batch is padded to max_batch
            padded = self._buffers.scratch("q_padded", (rows, *q.shape[1:]), q.dtype, q.device)
            padded[: q.shape[0]].copy_(q)
            q_full = padded
        else:
            q_full = q
        result = out if out is not None and q.shape[0] == rows and out.is_contiguous() else None
        if result is None:
            result = torch.empty(rows, *q.shape[1:], dtype=q.dtype, device=q.device)
        if schedule.kernel == "triton":
            self._run_triton(q_full, k_cache, v_cache, derived, schedule, result)
            return self._returned(result, q, out)
        parts = []
        body_q = self._body_query(q_full, schedule)
        body = self._run_part("body", body_q, k_cache, v_cache, derived, schedule, stats=schedule.merged,
                              out=None if schedule.merged else self._unpacked_view(result, schedule))  # fmt: skip
        if schedule.merged:
            o, stats = body
            parts.append(self._as_parts(o, stats, schedule.splits, schedule))
            if schedule.tail:
                o_t, stats_t = self._run_part("tail", q_full, k_cache, v_cache, derived, schedule, stats=True)
                parts.append((o_t.unsqueeze(1), stats_t.squeeze(-1).unsqueeze(1)))
            merge_partials(parts, result)
        return self._returned(result, q, out)

    @staticmethod
    def _returned(result: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """The step's rows of ``result``, in ``out`` when given."""
        if out is not None and result is not out:
            out.copy_(result[: q.shape[0]])
            return out
        return result[: q.shape[0]] if result.shape[0] != q.shape[0] else result

    def _run_triton(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, derived: dict[str, Any],
                    schedule: Schedule, result: torch.Tensor) -> None:  # fmt: skip
        rows, splits = q.shape[0], schedule.splits
        partial_o = partial_lse = None
        if splits > 1:  # persistent: a captured step writes and merges the same buffers
            partial_o = self._buffers.scratch("decode_o", (rows, splits, self.num_q_heads, self.head_dim), torch.float32,
                                      q.device)  # fmt: skip
            partial_lse = self._buffers.scratch("decode_lse", (rows, splits, self.num_q_heads), torch.float32,
                                                q.device)  # fmt: skip
        paged_decode.paged_decode(q, k_cache, v_cache, derived["table"], self._buffers["lengths"], result,
                                  scale=self.scale, kv_layout=self.kv_layout, splits=splits,
                                  chunk_pages=schedule.chunk_pages, partial_o=partial_o,
                                  partial_lse=partial_lse)  # fmt: skip

    def _check_run(self, q: Any, k_cache: Any, v_cache: Any, out: Any, step: Step) -> None:
        problems = []
        q_rank = 3 if step.prefill else 4
        for name, t, rank in (("q", q, q_rank), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4)):
            if not isinstance(t, torch.Tensor) or t.dim() != rank:
                form = ("a packed [T, H_q, D] tensor (the step was planned with q_lens)" if name == "q" and rank == 3
                        else "a 4-D tensor")  # fmt: skip
                problems.append(f"{name}: expected {form}, got {getattr(t, 'shape', type(t).__name__)}")
            elif t.dtype != self.dtype:
                problems.append(f"{name}: dtype {t.dtype}; this PagedAttention takes {self.dtype}")
            elif t.device != step.device:
                problems.append(f"{name}: on {t.device}; the step was planned on {step.device}")
        if problems:
            raise ValidationError(problems, context="PagedAttention.run")
        heads, dim = q.shape[-2 if step.prefill else 1], q.shape[-1]
        if heads != self.num_q_heads or dim != self.head_dim:
            problems.append(f"q: {heads} heads of {dim}; expected {self.num_q_heads} heads of {self.head_dim}")
        if step.prefill:
            if step.tokens is not None and q.shape[0] < step.tokens:
                problems.append(f"q: {q.shape[0]} tokens; the step's q_lens sum to {step.tokens}")
            if q.stride(-1) != 1:
                problems.append(f"q: strides {list(q.stride())}; the head dim must be contiguous (stride 1)")
        else:
            batch, s_q = q.shape[0], q.shape[2]
            if batch not in (step.batch, step.rows):  # with cuda_graph, a step of max_batch rows
                problems.append(f"q: batch {batch}; the step was planned for {step.batch} sequences")
            if not 1 <= s_q <= MAX_QUERY_TOKENS:
                problems.append(f"q: {s_q} query tokens per sequence; allowed 1..{MAX_QUERY_TOKENS}")
        expected = ([None, self.num_kv_heads, self.page_size, self.head_dim] if self.kv_layout == "NHPD"
                    else [None, self.page_size, self.num_kv_heads, self.head_dim])  # fmt: skip
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if list(t.shape[1:]) != expected[1:]:
                problems.append(f"{name}: shape {list(t.shape)}; expected [num_pages, {', '.join(map(str, expected[1:]))}] "
                                f"({self.kv_layout})")  # fmt: skip
        if v_cache.shape[0] != k_cache.shape[0]:
            problems.append(f"v_cache: {v_cache.shape[0]} pages, k_cache has {k_cache.shape[0]}")
        largest = step.largest_page
        if largest is not None and largest[0] >= k_cache.shape[0]:
            page, row, entry = largest
            pages = k_cache.shape[0]
            problems.append(f"page_table: sequence {row}, entry {entry} is page {page}; the cache has {pages} "
                            f"page{'s' if pages != 1 else ''}")  # fmt: skip
        if out is not None and (not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype):
            problems.append(f"out: expected a {q.dtype} tensor of shape {list(q.shape)}")
        if problems:
            raise ValidationError(problems, context="PagedAttention.run")

    def _run_prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor | None,
                     step: Step) -> torch.Tensor:  # fmt: skip
        """Chunked prefill: packed queries, bottom-right causal per sequence, one ragged call.
        Prefill chunks bring query rows enough to fill the GPU: no split, no packing."""
        tokens, num_pages = q.shape[0], k_cache.shape[0]
        longest = self._tables.longest_chunk(tokens, step)
        derived = self._tables.get(("prefill", tokens, longest, num_pages), step)
        self.schedule = derived["schedule"]
        result = (
            out if out is not None and out.is_contiguous() else torch.empty(q.shape, dtype=q.dtype, device=q.device)
        )
        table, lengths, q_lengths = derived["table"], self._buffers["lengths"], derived["q_lengths"]
        inputs = {"q": q, "k": k_cache, "v": v_cache, "page_table_k": table, "page_table_v": table,
                  "seq_len_q": q_lengths, "seq_len_kv": lengths}  # fmt: skip
        self._paged_sdpa(inputs, {"o": result}, causal=True, max_seq_len_q=longest)
        if out is not None and result is not out:
            return out.copy_(result)
        return result

    # ---- parts ------------------------------------------------------------------------------------

    def _body_query(self, q: torch.Tensor, schedule: Schedule) -> torch.Tensor:
        """q as the body reads it: packed ``[B, H_kv, G*S_q, D]`` (or as given), repeated per split."""
        batch, heads, s_q, dim = q.shape
        if schedule.packed:
            q = q.reshape(batch, self.num_kv_heads, (heads // self.num_kv_heads) * s_q, dim)
        if schedule.splits == 1:
            return q
        repeated = self._buffers.scratch("body_q", (batch, schedule.splits, *q.shape[1:]), q.dtype, q.device)
        repeated.copy_(q.unsqueeze(1).expand_as(repeated))
        return repeated.view(batch * schedule.splits, *q.shape[1:])

    def _unpacked_view(self, result: torch.Tensor, schedule: Schedule) -> torch.Tensor:
        """``result`` ``[B, H_q, S_q, D]`` as the body writes it when nothing is merged."""
        batch, heads, s_q, dim = result.shape
        if not schedule.packed:
            return result
        return result.view(batch, self.num_kv_heads, (heads // self.num_kv_heads) * s_q, dim)

    def _as_parts(self, o: torch.Tensor, stats: torch.Tensor, splits: int, schedule: Schedule) -> tuple:
        """The body's outputs as ``[B, splits, H_q, S_q, D]`` and ``[B, splits, H_q, S_q]``."""
        rows = o.shape[0] // splits
        shape = (rows, splits, self.num_q_heads, schedule.s_q)
        return o.view(*shape, self.head_dim), stats.view(*shape)

    def _run_part(self, part: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  derived: dict[str, Any], schedule: Schedule, stats: bool, out: torch.Tensor | None = None) -> Any:  # fmt: skip
        table = derived[f"{part}_table"]
        inputs = {"q": q, "k": k_cache, "v": v_cache, "page_table_k": table, "page_table_v": table,
                  "seq_len_q": derived[f"{part}_q_lengths"], "seq_len_kv": derived[f"{part}_lengths"]}  # fmt: skip
        o = out if out is not None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
        outputs = {"o": o}
        if stats:
            outputs["stats"] = torch.empty(*q.shape[:3], 1, dtype=torch.float32, device=q.device)
        self._paged_sdpa(inputs, outputs, causal=part == "tail")
        return (o, outputs["stats"]) if stats else o

    def _paged_sdpa(self, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor], *, causal: bool,
                    max_seq_len_q: int | None = None) -> None:  # fmt: skip
        """One paged forward: ``inputs`` and ``outputs`` by role, bottom-right ``causal`` or not.
        Its problem is these tensors' geometry, the outputs' own strides included; the run
        prepared for it serves every call of that problem (a packed q's token count aside: the
        plan reads it at run time, ``AttentionProblem.for_plan``), trusting the caller's geometry."""
        # The tensors' geometry leads straight to the run: a step's layers repeat it (the problem's nine
        # specs, built and hashed, cost several times the tuple).
        fast = (causal, max_seq_len_q, *geometry(inputs), *geometry(outputs))
        run = self._fast.get(fast)
        if run is None:
            run = self._fast.put(fast, self._prepared_run(inputs, outputs, causal, max_seq_len_q))
        run.run(inputs, outputs)

    def _prepared_run(self, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor], causal: bool,
                      max_seq_len_q: int | None) -> PreparedRun:  # fmt: skip
        """The run of these tensors' problem (one per plan: a packed q's token count aside)."""
        spec = TensorSpec.of
        options = ScoreOptions(attn_scale=self.scale, causal=Causal.BOTTOM_RIGHT if causal else Causal.NONE,
                               padding=True)  # fmt: skip
        problem = forward_problem(
            spec(inputs["q"]), spec(inputs["k"]), spec(inputs["v"]), options, stats="stats" in outputs,
            seq_len_q=spec(inputs["seq_len_q"]), seq_len_kv=spec(inputs["seq_len_kv"]), max_seq_len_q=max_seq_len_q,
            max_seq_len_kv=inputs["page_table_k"].shape[1] * self.page_size, page_table_k=spec(inputs["page_table_k"]),
            page_table_v=spec(inputs["page_table_v"]), kv_cache_layout=KVCacheLayout(self.kv_layout),
        )  # fmt: skip
        o, stats = spec(outputs["o"]), spec(outputs["stats"]) if "stats" in outputs else None
        if problem.o != o or problem.stats != stats:  # the outputs given are laid out otherwise
            problem = problem.replace(o=o, stats=stats)
        key = problem.for_plan()
        run = self._runs.get(key)
        if run is None:  # values checked once, as a plan's first build does
            run = self._runs.put(key, prepare(problem, autotune=self._autotune, values=inputs,
                                              context="PagedAttention"))  # fmt: skip
        return run
