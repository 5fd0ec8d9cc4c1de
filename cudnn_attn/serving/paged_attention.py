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

from ..core.finite import finite_real
from ..core.mask import default_scale
from ..core.score_inputs import check_sinks, sink_token
from ..core.sink_fold import add_sink
from ..errors import UnsupportedError, ValidationError, shown
from ..kernels import mla_decode, paged_decode
from ..kernels.lse_merge import merge_partials
from ..log import logger as log
from ..ops.dispatch import DECODE_KERNELS
from . import warming
from .fp8_cache import UNIT_SCALES, check_scales, compact_table, dequantised, dequantised_pages, is_fp8
from .paged_calls import PagedCalls
from .paged_checks import check_device, check_plan, check_run, unread_slots_zeroed
from .schedule import Schedule
from .step import Step, StepBuffers, StepTables, launch_after_tables, launched

LAYOUTS = ("NHPD", "NPHD")


class PagedAttention:
    """Attention over paged K/V caches for a serving loop: ``plan`` per step, ``run`` per layer.

    ``plan`` does a step's work once for every layer: checks the page table and lengths,
    makes their values safe on the device without a host sync, chooses the layout (split-KV,
    query packing, the decode kernel) and derives every table in persistent buffers. ``run``
    then launches only attention work: no host sync, no allocation when ``out`` is given, safe to
    capture in a CUDA graph. Decode takes ``S_q`` = 1 to 16 query tokens per sequence (the last
    ``S_q`` positions of its cache: bottom-right causal); chunked prefill plans with ``q_lens``
    and runs packed ``[T, H_q, D]`` queries, so one step mixes prefill chunks and decode tokens.
    CUDA tensors run on cuDNN's paged attention (cuDNN >= 9.5) or a Triton decode kernel, CPU
    tensors on the reference backend.

    Args:
        num_q_heads: query heads ``H_q``.
        num_kv_heads: K/V heads ``H_kv``; must divide ``num_q_heads``.
        head_dim: Q's and K's head dim ``D``.
        page_size: tokens per cache page (a power of two on a GPU).
        dtype: of q (and of the caches, unless ``kv_dtype``): float16 or bfloat16.
        kv_layout: ``"NHPD"`` (caches ``[num_pages, H_kv, page_size, D]``) or ``"NPHD"``
            (``[num_pages, page_size, H_kv, D]``).
        max_batch: the most sequences a step holds (required with ``cuda_graph``).
        max_pages_per_seq: the most pages a sequence holds (required with ``cuda_graph``).
        cuda_graph: fixed-size persistent buffers of ``max_batch`` rows, so a captured step
            (all layers' ``run``) replays after each ``plan``, which rewrites them in place;
            smaller batches are padded with empty sequences. Keep the instance alive while the
            graph replays.
        device: the caches' device; taken from the tensors when None.
        splits: force the number of split-KV chunks (None: chosen per step).
        pack: force GQA query packing on or off (None: chosen per step).
        scale: softmax scale; ``1 / sqrt(head_dim)`` by default.
        autotune: time every cuDNN candidate when a plan is built (plans found in the plan store
            load as they are; ``cudnn-attn cache warm`` stores tuned ones).
        decode_kernel: force single-token decode's kernel, ``"cudnn"`` or ``"triton"``.
        head_dim_v: V's head dim where it differs (MLA: 576 and 512, V being the first 512 of
            each latent K row, ``v_cache = k_cache[..., :512]``).
        kv_dtype: the caches' dtype where not ``dtype``: ``torch.float8_e4m3fn`` or
            ``float8_e5m2`` (half the bytes a decode step reads; see ``run``'s ``k_scale``).

    Raises:
        ValidationError: a bad geometry, dtype, layout, limit or device (every problem listed).
        UnsupportedError: FP8 caches with different K and V head dims; a CUDA ``device`` where
            torch sees no CUDA GPU.

    Example:
        ```python
        import torch

        import cudnn_attn

        attn = cudnn_attn.PagedAttention(8, 2, 64, page_size=16, dtype=torch.bfloat16, device="cpu")
        k_cache, v_cache = (torch.randn(32, 2, 16, 64, dtype=torch.bfloat16) for _ in range(2))  # NHPD
        page_table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)  # [B, pages]
        attn.plan(page_table, seq_lens_kv=torch.tensor([50, 64], dtype=torch.int32))  # once per step
        q = torch.randn(2, 8, 1, 64, dtype=torch.bfloat16)  # one new token per sequence
        out = attn.run(q, k_cache, v_cache)  # per layer, with that layer's caches
        assert out.shape == (2, 8, 1, 64)
        ```
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
        head_dim_v: int | None = None,
        kv_dtype: torch.dtype | None = None,
    ):
        problems = []
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        for name, value in (
            ("num_q_heads", num_q_heads),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("page_size", page_size),
            ("head_dim_v", head_dim_v),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name}: {value!r}; must be an int >= 1")
        if not problems and num_q_heads % num_kv_heads:
            problems.append(f"num_kv_heads: {num_kv_heads} does not divide num_q_heads={num_q_heads}")
        if dtype not in (torch.float16, torch.bfloat16):
            problems.append(f"dtype: {dtype}; expected torch.float16 or torch.bfloat16")
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        if kv_dtype != dtype and not is_fp8(kv_dtype):
            problems.append(f"kv_dtype: {kv_dtype}; expected None (dtype's), torch.float8_e4m3fn or float8_e5m2")
        if not isinstance(kv_layout, str) or kv_layout not in LAYOUTS:
            problems.append(f"kv_layout: {kv_layout!r}; allowed 'NHPD' or 'NPHD'")
        for name, limit in (("max_batch", max_batch), ("max_pages_per_seq", max_pages_per_seq), ("splits", splits)):
            if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
                problems.append(f"{name}: {limit!r}; must be None or an int >= 1")
        if decode_kernel is not None and (not isinstance(decode_kernel, str) or decode_kernel not in DECODE_KERNELS):
            allowed = " or ".join(repr(name) for name in DECODE_KERNELS)
            problems.append(f"decode_kernel: {decode_kernel!r}; allowed None, {allowed}")
        for name, flag, optional in (
            ("cuda_graph", cuda_graph, False),
            ("autotune", autotune, False),
            ("pack", pack, True),
        ):
            if not isinstance(flag, bool) and not (optional and flag is None):
                problems.append(f"{name}: {flag!r}; must be {'None, ' if optional else ''}True or False")
        if scale is not None and not finite_real(scale):
            problems.append(f"scale: {shown(scale)}; must be None (1/sqrt(head_dim)) or a finite number")
        if cuda_graph and (max_batch is None or max_pages_per_seq is None):
            problems.append("cuda_graph: True needs max_batch and max_pages_per_seq (the buffers' fixed sizes)")
        if problems:
            raise ValidationError(problems, context="PagedAttention")
        if is_fp8(kv_dtype) and head_dim_v != head_dim:
            raise UnsupportedError(
                [
                    f"kv_dtype: {kv_dtype} with head dims {head_dim}/{head_dim_v}: FP8 caches are "
                    "read by the decode kernel of one head dim for K and V; MLA's latent kernels "
                    "and cuDNN's paged attention read 16-bit caches"
                ],
                context="PagedAttention",
                alternatives=[f"kv_dtype=None ({dtype})"],
            )
        self.num_q_heads, self.num_kv_heads, self.head_dim, self.page_size = (
            num_q_heads,
            num_kv_heads,
            head_dim,
            page_size,
        )
        self.dtype, self.kv_layout, self.cuda_graph = dtype, kv_layout, cuda_graph
        self.kv_dtype, self._fp8 = kv_dtype, is_fp8(kv_dtype)
        self.max_batch, self.max_pages_per_seq = max_batch, max_pages_per_seq
        self.device = check_device(device)
        self.head_dim_v = head_dim_v
        self.scale = float(scale) if scale is not None else default_scale(head_dim)
        self._autotune = bool(autotune)
        self._calls = PagedCalls(self.scale, page_size, kv_layout, self._autotune)
        self._buffers = StepBuffers(cuda_graph)
        self._tables = StepTables(
            num_q_heads,
            num_kv_heads,
            head_dim,
            page_size,
            buffers=self._buffers,
            splits=splits,
            pack=pack,
            kernel=decode_kernel,
            head_dim_v=head_dim_v,
            fp8_caches=is_fp8(kv_dtype),
        )
        self.schedule: Schedule | None = None
        self.plans = 0

    # ---- plan: once per step ------------------------------------------------------------------

    def plan(self, page_table: torch.Tensor, seq_lens_kv: torch.Tensor, q_lens: torch.Tensor | None = None) -> None:
        """Prepare a step, for every layer's ``run``.

        CPU tensors are checked value by value here (page indices against each cache at
        ``run``, which sees the cache); CUDA ones are clamped into range on the device, without
        a host sync: a page past the cache reads its last page, and a bad value gives wrong rows
        for its sequence, never an access out of bounds.

        Args:
            page_table: ``[B, pages_per_seq]`` int32 page indices into the caches.
            seq_lens_kv: ``[B]`` int32, each sequence's cache length, the new tokens included.
            q_lens: ``[B]`` int32 for chunked prefill: each sequence's new tokens (at most its
                cache length; they are its last ones). ``run`` then takes packed
                ``[T, H_q, D]`` queries with ``T >= sum(q_lens)``.

        Raises:
            ValidationError: shapes, dtypes, devices or (CPU tensors) values out of range,
                named by argument and row.
        """
        device = check_plan(self, page_table, seq_lens_kv, q_lens)
        page_table = unread_slots_zeroed(page_table, seq_lens_kv, self.page_size)
        batch, pages = page_table.shape
        rows = self.max_batch if self.cuda_graph else batch
        width = self.max_pages_per_seq if self.cuda_graph else pages
        assert rows is not None and width is not None
        self._tables.plan(page_table, seq_lens_kv, q_lens, device, rows, width)
        self.plans += 1

    # ---- warm: at a server's start ---------------------------------------------------------------

    def warm(self, num_pages: int, *, s_q: tuple[int, ...] = (1,), prefill_tokens: tuple[int, ...] = ()) -> list[str]:
        """Build (or load from the plan store) every plan this server's steps run, before the first request.

        Decode with each of ``s_q`` query tokens, and chunked prefill with each packed token
        count of ``prefill_tokens``, for caches of ``num_pages`` pages and steps of
        ``max_batch`` sequences of ``max_pages_per_seq`` pages (required here). With
        ``cuda_graph`` that is every plan a step can need; without it, steps of other sizes
        build their own. ``plan`` again afterwards. ``cudnn-attn cache warm`` does the same
        from a shape list.

        Args:
            num_pages: pages in each cache.
            s_q: query tokens per sequence of the decode steps to plan for (1..16).
            prefill_tokens: packed token counts of the prefill steps to plan for.

        Returns:
            Each plan's source: ``"built"``, ``"disk"`` (the plan store) or ``"reference"``.

        Raises:
            ValidationError: no ``max_batch``/``max_pages_per_seq``, or bad counts.

        Example:
            ```python
            import torch

            import cudnn_attn

            attn = cudnn_attn.PagedAttention(8, 2, 64, 16, dtype=torch.bfloat16, max_batch=4,
                                             max_pages_per_seq=8, device="cpu")
            sources = attn.warm(num_pages=64, s_q=(1, 4))
            ```
        """
        s_q, prefill_tokens = warming.check(self, num_pages, s_q, prefill_tokens)
        warming.run_steps(self, num_pages, s_q, prefill_tokens)
        self._tables.step = None
        return [getattr(run.plan, "source", "reference") for run in self._calls.runs.values()]

    # ---- run: per layer -----------------------------------------------------------------------

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        sinks: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """Attention for one layer of the planned step.

        No host sync, and no allocation when ``out`` is given: safe to capture in a CUDA graph.

        Args:
            q: ``[B, H_q, S_q, D]`` (``S_q`` <= 16), or packed ``[T, H_q, D]`` after a plan with
                ``q_lens``; ``dtype``.
            k_cache: the layer's K cache, in ``kv_layout`` and ``kv_dtype``.
            v_cache: the layer's V cache, likewise.
            out: a tensor of the result's shape to write into; a new one otherwise.
            sinks: the layer's attention sinks (gpt-oss), a logit per query head, ``[H_q]``, in
                every softmax denominator (``sdpa``'s ``sinks``; FlashInfer's name too).
            k_scale: FP8 caches' scale (FlashInfer's and vLLM's name): a stored element's real
                value is ``k_scale * stored``.
            v_scale: likewise for V.

        Returns:
            The output, ``out`` or a new tensor, ``[B, H_q, S_q, D_v]`` (or ``[T, H_q, D_v]``)
                in q's dtype; packed rows past ``sum(q_lens)`` are zero.

        Raises:
            ValidationError: ``run`` before any ``plan``; tensors that do not match the plan or
                the constructor's geometry (a cache's head dim not contiguous included); a
                CPU-planned page past ``k_cache``'s pages.
            UnsupportedError: FP8 caches on a GPU step the Triton decode kernel cannot run; a
                ``v_cache`` whose strides differ from ``k_cache``'s on the decode kernel (along a
                dimension longer than 1).
        """
        step = self._tables.step
        if step is None:
            raise ValidationError(
                ["plan: run() before any plan(); call plan(page_table, seq_lens_kv) each step"],
                context="PagedAttention.run",
            )
        check_run(self, q, k_cache, v_cache, out, step)
        fp8 = self._fp8
        # The defaults, as every 16-bit step passes them, skip the checks: run() is per layer.
        unit = type(k_scale) is float and type(v_scale) is float and k_scale == 1.0 == v_scale
        scales = UNIT_SCALES if unit else check_scales(fp8, k_scale, v_scale)
        if sinks is not None:
            check_sinks(sinks, self.num_q_heads, q.device, context="PagedAttention.run")
        sink = sink_token(sinks, q)
        if step.prefill:
            return self._run_prefill(q, k_cache, v_cache, out, step, sink, scales if fp8 else None)
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
            result = torch.empty(rows, *q.shape[1:-1], self.head_dim_v, dtype=q.dtype, device=q.device)
        if schedule.decode_kernel.one_kernel:
            self._run_triton(q_full, k_cache, v_cache, derived, schedule, result, sink, scales)
            return self._returned(result, q, out)
        if fp8:  # cuDNN's paged calls read 16-bit caches
            if q.is_cuda:
                raise UnsupportedError(
                    [
                        f"k_cache: {self.kv_dtype} caches decode through the Triton kernel, which "
                        f"does not run this step (decode_kernel={self._tables.kernel!r}, page "
                        f"{self.page_size}, head dim {self.head_dim}); cuDNN's paged attention "
                        "reads 16-bit caches"
                    ],
                    context="PagedAttention.run",
                    alternatives=[
                        "decode_kernel=None",
                        "a power-of-two page of 16-256 tokens",
                        f"kv_dtype=None ({self.dtype})",
                    ],
                )
            log.debug("PagedAttention.run: FP8 caches dequantised whole for the reference backend's decode")
            k_cache, v_cache = (dequantised(c, self.dtype, sc) for c, sc in zip((k_cache, v_cache), scales))
        parts = []
        body_q = self._body_query(q_full, schedule)
        # With sinks every path keeps its log-sum-exp, and the sink is folded in from it after.
        body = self._run_part(
            "body",
            body_q,
            k_cache,
            v_cache,
            derived,
            schedule,
            stats=schedule.merged or sink is not None,
            out=None if schedule.merged else self._unpacked_view(result, schedule),
        )
        lse = None
        if schedule.merged:
            o, stats = body
            parts.append(self._as_parts(o, stats, schedule.splits, schedule))
            if schedule.tail:
                o_t, stats_t = self._run_part("tail", q_full, k_cache, v_cache, derived, schedule, stats=True)
                parts.append((o_t.unsqueeze(1), stats_t.squeeze(-1).unsqueeze(1)))
            if sink is not None:
                lse = torch.empty(*result.shape[:3], 1, dtype=torch.float32, device=q.device)
            merge_partials(parts, result, None if lse is None else lse.squeeze(-1))
        elif sink is not None:
            lse = body[1].view(*result.shape[:3], 1)  # packed rows are head-major: [B, H_q, S_q] in order
        if sink is not None:
            assert lse is not None
            add_sink(result, lse, sink)
        return self._returned(result, q, out)

    @staticmethod
    def _returned(result: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """The step's rows of ``result``, in ``out`` when given."""
        if out is not None and result is not out:
            out.copy_(result[: q.shape[0]])
            return out
        return result[: q.shape[0]] if result.shape[0] != q.shape[0] else result

    def _run_triton(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        derived: dict[str, Any],
        schedule: Schedule,
        result: torch.Tensor,
        sink: torch.Tensor | None,
        scales: tuple[float, float],
    ) -> None:
        rows, s_q, splits = q.shape[0], q.shape[2], schedule.splits
        partial_o = partial_lse = None
        if splits > 1:  # persistent: a captured step writes and merges the same buffers
            name = f"@{s_q},{splits}"  # a geometry's own: a captured step keeps its pointers
            partial_o = self._buffers.scratch(
                f"decode_o{name}", (rows, splits, self.num_q_heads * s_q, self.head_dim_v), torch.float32, q.device
            )
            partial_lse = self._buffers.scratch(
                f"decode_lse{name}", (rows, splits, self.num_q_heads * s_q), torch.float32, q.device
            )
        if self.head_dim_v != self.head_dim:  # MLA: one latent head for every query head
            mla_decode.mla_decode(
                q,
                k_cache,
                v_cache,
                derived["table"],
                self._buffers["lengths"],
                result,
                head_dim_v=self.head_dim_v,
                scale=self.scale,
                kv_layout=self.kv_layout,
                splits=splits,
                chunk_pages=schedule.chunk_pages,
                partial_o=partial_o,
                partial_lse=partial_lse,
                sink=None if sink is None else sink.view(-1),
            )
            return
        launch, mark = launch_after_tables(derived, q.device)
        paged_decode.paged_decode(
            q,
            k_cache,
            v_cache,
            derived["table"],
            self._buffers["lengths"],
            result,
            scale=self.scale,
            kv_layout=self.kv_layout,
            splits=splits,
            chunk_pages=schedule.chunk_pages,
            partial_o=partial_o,
            partial_lse=partial_lse,
            sink=None if sink is None else sink.view(-1),
            k_scale=scales[0],
            v_scale=scales[1],
            hopper=schedule.hopper,
            dependent_launch=launch,
        )
        launched(derived, mark)

    def _run_prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor | None,
        step: Step,
        sink: torch.Tensor | None,
        fp8_scales: tuple[float, float] | None,
    ) -> torch.Tensor:
        """Chunked prefill: packed queries, bottom-right causal per sequence, one ragged call.
        Prefill chunks bring query rows enough to fill the GPU: no split, no packing. FP8
        caches (``fp8_scales``) are read through a compact 16-bit copy of the step's pages."""
        tokens, num_pages = q.shape[0], k_cache.shape[0]
        if tokens == 0:  # a step without new tokens (q_lens all 0): nothing to attend from
            return out if out is not None else q.new_empty(0, q.shape[1], self.head_dim_v)
        longest = self._tables.longest_chunk(tokens, step)
        derived = self._tables.get(("prefill", tokens, longest, num_pages), step)
        self.schedule = derived["schedule"]
        result = out if out is not None and out.is_contiguous() else None
        if result is None:
            result = torch.empty(*q.shape[:-1], self.head_dim_v, dtype=q.dtype, device=q.device)
        table, lengths, q_lengths = derived["table"], self._buffers["lengths"], derived["q_lengths"]
        if fp8_scales is not None:
            k_cache, v_cache = (
                dequantised_pages(c, table, self.dtype, sc) for c, sc in zip((k_cache, v_cache), fp8_scales)
            )
            table = compact_table(table)
        inputs = {
            "q": q,
            "k": k_cache,
            "v": v_cache,
            "page_table_k": table,
            "page_table_v": table,
            "seq_len_q": q_lengths,
            "seq_len_kv": lengths,
        }
        if sink is not None:  # cuDNN takes sinks with packed queries, from two query tokens up
            inputs["sink_token"] = sink
            longest = max(longest, 2)
        self._calls.run(inputs, {"o": result}, causal=True, max_seq_len_q=longest)
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
        return o.view(*shape, self.head_dim_v), stats.view(*shape)

    def _run_part(
        self,
        part: str,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        derived: dict[str, Any],
        schedule: Schedule,
        stats: bool,
        out: torch.Tensor | None = None,
    ) -> Any:
        o = out if out is not None else torch.empty(*q.shape[:-1], self.head_dim_v, dtype=q.dtype, device=q.device)
        outputs = {"o": o}
        if stats:
            outputs["stats"] = torch.empty(*q.shape[:3], 1, dtype=torch.float32, device=q.device)
        eager_step = None if self.cuda_graph else self._tables.step
        self._calls.run_part(part, q, k_cache, v_cache, derived, outputs, eager_step=eager_step)
        return (o, outputs["stats"]) if stats else o
