"""One ``PagedAttention`` step: what ``plan`` derives from the page table and lengths, and the
persistent buffers it lives in.

``StepTables.plan`` copies the step's page table and lengths into fixed buffers and derives,
for every layer geometry run before, the tables and lengths of each part of a run (the split
body, the causal tail, a prefill's clamped table and cut query lengths); ``get`` derives a new
geometry on its first run. ``StepBuffers`` holds them by name, reused while their geometry holds:
a captured step reads them in place, and each plan rewrites them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.bounds import packed_lengths
from ..kernels import launch, mla_decode, mla_decode_hopper, paged_decode, paged_decode_hopper
from ..ops.decode_step import DecodeStep, is_mla
from ..ops.dispatch import select_decode
from ..runtime.keyed import KeyedCache
from ..runtime.late_value import LateValue, capturing
from . import schedule as paged_schedule
from .schedule import Schedule

SMALLEST_PREFILL_BUCKET = 16  # a prefill plan is built per power of two of the longest chunk
MAX_SCHEDULES = 1024  # decode layouts by step geometry: eager steps of many sizes make many


class StepBuffers(Mapping[str, torch.Tensor]):
    """Persistent buffers by name (reused while their geometry holds): captured runs read them in
    place. With ``cuda_graph`` a run's working buffers are persistent too."""

    def __init__(self, cuda_graph: bool):
        self.cuda_graph = cuda_graph
        self._tensors: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def buffer(self, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The buffer ``name``, made anew where its shape, dtype or device changed."""
        buffer = self._tensors.get(name)
        if buffer is None or buffer.shape != torch.Size(shape) or buffer.dtype != dtype or buffer.device != device:
            buffer = self._tensors[name] = torch.empty(shape, dtype=dtype, device=device)
        return buffer

    def scratch(self, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A run's working buffer: persistent where steps are captured (a replay reads it in place),
        else the run's own, so runs on several threads never write one buffer under each other."""
        if self.cuda_graph:
            return self.buffer(name, shape, dtype, device)
        return torch.empty(shape, dtype=dtype, device=device)

    def store(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """``value`` copied into the buffer ``name``."""
        return self.buffer(name, tuple(value.shape), value.dtype, value.device).copy_(value)

    def forget(self, prefix: str) -> None:
        """Drop the buffers whose names start with ``prefix``."""
        for name in [name for name in self._tensors if name.startswith(prefix)]:
            del self._tensors[name]


@dataclass
class Step:
    """What ``plan`` prepared: ``batch`` sequences in buffers of ``rows`` by ``width`` pages.
    ``largest_page``: a host page table's largest page, where it first is (``largest_page``);
    ``longest_q``/``tokens``: a host ``q_lens``' longest chunk and sum (None otherwise);
    ``host_shortest``: an eager decode step's shortest (clamped) length, from host
    ``seq_lens_kv``; ``device_shortest``: from GPU lengths, on its way to the host (``shortest``
    reads whichever is known now, without a sync)."""

    batch: int
    rows: int
    width: int
    device: torch.device
    prefill: bool
    largest_page: tuple[int, int, int] | None
    longest_q: int | None = None
    tokens: int | None = None
    host_shortest: int | None = None
    device_shortest: LateValue | None = None
    checked: set[tuple] = field(default_factory=set)  # run geometries check_run passed

    def shortest(self) -> int | None:
        """The step's shortest length where the host knows it now (None: not yet, or never)."""
        if self.host_shortest is not None:
            return self.host_shortest
        return None if self.device_shortest is None else self.device_shortest.read()


class StepTables:
    """The planned step's table and lengths, and each layer geometry's tables and lengths derived
    from them, in ``buffers``. A geometry (its key): decode ``("decode", s_q, num_pages)`` or
    prefill ``("prefill", tokens, longest, num_pages)``. ``splits``, ``pack``, ``kernel``: the
    layout forced (None: ``ops/dispatch.select_decode`` picks the kernel, ``paged_schedule.choose``
    the layout, once per step geometry)."""

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        buffers: StepBuffers,
        splits: int | None,
        pack: bool | None,
        kernel: str | None,
        head_dim_v: int | None = None,
        fp8_caches: bool = False,
    ):
        self.num_q_heads, self.num_kv_heads, self.head_dim, self.page_size = (
            num_q_heads,
            num_kv_heads,
            head_dim,
            page_size,
        )
        self.head_dim_v = head_dim if head_dim_v is None else head_dim_v
        self.buffers, self.cuda_graph = buffers, buffers.cuda_graph
        self.splits, self.pack, self.kernel = splits, pack, kernel
        self.fp8_caches = fp8_caches  # only the Triton kernel reads them: eager steps take it too
        self.mla = is_mla(num_kv_heads, head_dim, self.head_dim_v)
        self._schedules = KeyedCache(MAX_SCHEDULES, release_at_exit=False)  # by (rows, width, s_q, device)
        self.step: Step | None = None  # the planned step
        self._derived: dict[tuple, dict[str, Any]] = {}  # per geometry: the step's derived inputs

    def plan(
        self,
        page_table: torch.Tensor,
        seq_lens_kv: torch.Tensor,
        q_lens: torch.Tensor | None,
        device: torch.device,
        rows: int,
        width: int,
    ) -> None:
        """Make a checked step ``step``: copied into the buffers (``rows`` by ``width`` pages),
        lengths clamped on the device, and every layer geometry of its kind run before derived."""
        batch, pages = page_table.shape
        table = self.buffers.buffer("table", (rows, width), torch.int32, device)
        lengths = self.buffers.buffer("lengths", (rows,), torch.int32, device)
        table.zero_()
        table[:batch, :pages].copy_(page_table, non_blocking=True)
        lengths.zero_()  # sequences past the batch are empty
        torch.clamp(seq_lens_kv.to(device, non_blocking=True), 0, pages * self.page_size, out=lengths[:batch])
        step = self.step = Step(batch, rows, width, device, q_lens is not None, largest_page(page_table))
        # Eager decode layers skip the fill of empty rows where the host knows the shortest
        # sequence (``keyed_parts``): at once from host lengths, from GPU ones once a copy lands.
        # Captured steps (their batch padded with empty rows) and prefill steps never bind.
        if not self.cuda_graph and q_lens is None:
            if not seq_lens_kv.is_cuda:
                step.host_shortest = int(seq_lens_kv.clamp(0, pages * self.page_size).min())
            elif not capturing(lengths.device):  # min() would land in the caller's graph
                step.device_shortest = LateValue(lengths.min())
        if q_lens is not None:
            query_lengths = self.buffers.buffer("q_lens", (rows,), torch.int32, device)
            query_lengths.zero_()
            torch.minimum(q_lens.to(device, non_blocking=True).clamp(min=0), lengths[:batch], out=query_lengths[:batch])
            host = not q_lens.is_cuda  # then the longest chunk and the tokens are known without a sync
            step.longest_q = int(q_lens.max()) if host else None
            step.tokens = int(q_lens.sum()) if host else None
        # Every layer geometry of this kind run before is derived now, into the same buffers: a
        # captured step reads them in place, and run() launches attention work only. Eager
        # prefill geometries (one per token count) are derived again by their first run.
        kind = "prefill" if step.prefill else "decode"
        self._derived = {
            key: self._derive(key, step) if key[0] == kind else derived
            for key, derived in self._derived.items()
            if key[0] == "decode" or self.cuda_graph
        }
        if not self.cuda_graph:  # and their buffers, which would pile up one per token count
            self.buffers.forget("prefill_")

    def get(self, key: tuple, step: Step) -> dict[str, Any]:
        """Geometry ``key``'s derived inputs for ``step``: derived now where it is new to this
        instance, and by every later plan."""
        derived = self._derived.get(key)
        if derived is None:
            derived = self._derived[key] = self._derive(key, step)
        return derived

    def longest_chunk(self, tokens: int, step: Step) -> int:
        """The prefill plan's bound on a chunk: the longest planned chunk's power of two when
        known on the host; otherwise (q_lens on the GPU), and always with ``cuda_graph`` (a
        captured step must hold every later plan's chunks), what the step can hold at most."""
        most = min(tokens, step.width * self.page_size)
        known = step.longest_q
        return bucket(most if known is None or self.cuda_graph else min(known, most))

    def _derive_prefill(self, key: tuple, step: Step) -> dict[str, Any]:
        """A prefill step's query lengths, cut to the packed tensor's ``tokens`` and bounded by
        the plan's ``longest`` chunk, so no sequence reads or writes past the tensors."""
        _, tokens, longest, num_pages = key
        name = f"@{tokens},{longest},{num_pages}"  # a geometry's own: one step may run several token counts
        q_lengths = packed_lengths(self.buffers["q_lens"], longest, tokens)
        schedule = Schedule(batch=step.rows, s_q=longest, splits=1, chunk_pages=step.width, packed=False, tail=False)
        return {
            "schedule": schedule,
            "table": self.buffers.store(f"prefill_table{name}", self.buffers["table"].clamp(0, num_pages - 1)),
            "q_lengths": self.buffers.store(f"prefill_q_lengths{name}", q_lengths),
        }

    def _schedule(self, rows: int, width: int, s_q: int, device: torch.device) -> Schedule:
        """The layout of ``rows`` sequences of ``width`` pages and ``s_q`` query tokens on
        ``device``, on the kernel ``select_decode`` chooses from the kernels' facts. Made once per
        geometry: every plan derives the geometries run before again."""
        key = (rows, width, s_q, device)
        schedule = self._schedules.get(key)
        if schedule is not None:
            return schedule
        decode_step = self._decode_step(rows, width, s_q, device)
        schedule = paged_schedule.choose(
            rows,
            width,
            self.page_size,
            self.num_q_heads,
            self.num_kv_heads,
            s_q,
            kernel=select_decode(decode_step, self.kernel or "auto"),
            sm_count=sm_count(device),
            splits=self.splits,
            pack=self.pack,
            mla=self.mla,
            fp8=self.fp8_caches,
            hopper=decode_step.hopper,
        )
        return self._schedules.put(key, schedule)

    def _decode_step(self, rows: int, width: int, s_q: int, device: torch.device) -> DecodeStep:
        """The step as the dispatch reads it: its geometry, and what ``kernels/`` says of itself
        (ops/ may not import kernels/)."""
        if self.mla:
            triton = mla_decode.supported(device, self.page_size, self.head_dim, self.head_dim_v)
            hopper = triton and mla_decode_hopper.serves(device, self.page_size, self.head_dim, self.head_dim_v)
        else:
            triton = paged_decode.supported(device, self.page_size, self.head_dim) and self.head_dim_v == self.head_dim
            rows_per_tile = self.num_q_heads // self.num_kv_heads * s_q
            hopper = triton and paged_decode_hopper.serves(device, self.page_size, self.head_dim, rows_per_tile)
        return DecodeStep(
            device=str(device),
            batch=rows,
            num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads,
            s_q=s_q,
            page_size=self.page_size,
            head_dim=self.head_dim,
            head_dim_v=self.head_dim_v,
            captured=self.cuda_graph,
            fp8=self.fp8_caches,
            triton_runs=triton,
            hopper=hopper,
            tile_rows=paged_decode.MAX_ROWS,
            pages_per_seq=width,
        )

    def _derive(self, key: tuple, step: Step) -> dict[str, Any]:
        """This step's tables and lengths for each part of one layer geometry (``key``), from the
        planned table and lengths."""
        if key[0] == "prefill":
            return self._derive_prefill(key, step)
        _, s_q, num_pages = key
        rows, width, device = step.rows, step.width, step.device
        schedule = self._schedule(rows, width, s_q, device)
        page = self.page_size
        if schedule.decode_kernel.one_kernel:  # the kernel walks the clamped table itself
            table = self.buffers["table"].clamp(0, num_pages - 1)
            return {"schedule": schedule, "table": self.buffers.store(f"decode_table@{s_q},{num_pages}", table)}

        def store(name: str, value: torch.Tensor) -> torch.Tensor:  # buffers of their own per geometry
            return self.buffers.store(f"{name}@{s_q},{num_pages}", value)

        table = self.buffers["table"].clamp(0, num_pages - 1)  # pages past the cache's end never read
        lengths = self.buffers["lengths"]
        body_end = body_end_of(lengths, s_q, page) if schedule.tail else lengths
        derived: dict[str, Any] = {"schedule": schedule}
        if schedule.tail:
            span = paged_schedule.tail_pages(page, s_q)
            columns = (
                torch.div(body_end, page, rounding_mode="floor").unsqueeze(1) + torch.arange(span, device=device)
            ).clamp(max=width - 1)
            derived["tail_table"] = store("tail_table", torch.gather(table, 1, columns.long()))
            derived["tail_lengths"] = store("tail_lengths", (lengths - body_end).to(torch.int32))
            derived["tail_q_lengths"] = store(
                "tail_q_lengths", torch.full((rows,), s_q, dtype=torch.int32, device=device)
            )
        splits, chunk = schedule.splits, schedule.chunk_pages
        padded = torch.zeros(rows, splits * chunk, dtype=torch.int32, device=device)
        padded[:, :width] = table
        derived["body_table"] = store("body_table", padded.view(rows * splits, chunk))
        starts = torch.arange(splits, device=device) * (chunk * page)
        chunk_lengths = (body_end.unsqueeze(1) - starts).clamp(0, chunk * page)
        derived["body_lengths"] = store("body_lengths", chunk_lengths.reshape(-1).to(torch.int32))
        body_rows = (self.num_q_heads // self.num_kv_heads) * s_q if schedule.packed else s_q
        derived["body_q_lengths"] = store(
            "body_q_lengths", torch.full((rows * splits,), body_rows, dtype=torch.int32, device=device)
        )
        return derived


def launch_after_tables(derived: dict[str, Any], device: torch.device) -> tuple[str, str]:
    """How this geometry's next decode kernel launches on ``device`` (``kernels/grid_dependency``),
    and the mark ``launched`` sets once it has. The first since ``derived``'s tables were written
    (by ``plan``, or by the geometry's first derivation) reads them only once the kernel before it
    has completed: that kernel may be the one that wrote them (``"wait"``). Later ones read the
    length and first page indices as they start, while the kernel before drains (``"early"``):
    nothing but those two writes them, and a decode that waited has run since. A graph being
    captured runs nothing: its launches count apart, its own first decode waiting too."""
    mark = "decode_captured" if _capturing(device) else "decode_launched"
    return ("early" if derived.get(mark) else "wait"), mark


def _capturing(device: torch.device) -> bool:
    """``capturing``, without switching devices where ``device`` is the current one (per layer)."""
    if device.type != "cuda":
        return False
    if device.index is None or device.index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    return capturing(device)


def launched(derived: dict[str, Any], mark: str) -> None:
    """Count a decode of this geometry as launched (after the launch: one that failed is not)."""
    derived[mark] = True


def body_end_of(lengths: Any, s_q: int, page: int) -> Any:
    """Where a multi-token decode body ends (a tensor of lengths, or one length): the keys every
    query token sees, rounded down to a page boundary; the causal tail holds the rest."""
    first_hidden = lengths - s_q + 1
    first_hidden = first_hidden.clamp(min=0) if isinstance(first_hidden, torch.Tensor) else max(first_hidden, 0)
    return first_hidden // page * page


def keyed_parts(shortest: int | None, schedule: Schedule, page: int) -> frozenset[str]:
    """The parts of a cuDNN decode layer whose every row has keys, from the step's shortest
    length (None: not known now): the body's last chunk starts ``splits - 1`` chunks in and
    ends where the body does; the tail holds a sequence's last keys (all of them if the body
    is empty)."""
    if shortest is None or shortest <= 0:
        return frozenset()
    parts = {"tail"} if schedule.tail else set()
    body_end = body_end_of(shortest, schedule.s_q, page) if schedule.tail else shortest
    if body_end > (schedule.splits - 1) * schedule.chunk_pages * page:
        parts.add("body")
    return frozenset(parts)


def largest_page(page_table: torch.Tensor) -> tuple[int, int, int] | None:
    """A host page table's largest page and where it first is: ``(page, sequence, entry)``,
    for ``run`` to check against the cache it is given. None on a GPU: reading it would sync
    (there the pages past the cache are clamped to its last page)."""
    if page_table.is_cuda:
        return None
    at = int(torch.argmax(page_table))  # the first largest entry
    row, entry = divmod(at, page_table.shape[1])
    return int(page_table[row, entry]), row, entry


def bucket(n: int) -> int:
    """The power of two at or above ``n`` (at least ``SMALLEST_PREFILL_BUCKET``)."""
    return max(SMALLEST_PREFILL_BUCKET, 1 << max(0, n - 1).bit_length())


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return launch.sm_count(device)


def geometry(tensors: dict[str, torch.Tensor]) -> tuple:
    """Roles, shapes, strides, dtypes and devices of a call's tensors: what its problem is made of."""
    return tuple((role, t.shape, t.stride(), t.dtype, t.device) for role, t in tensors.items())


def canonical_device(device: Any) -> torch.device:
    """One spelling per device: a bare "cuda" is the current CUDA device, "cpu:0" the CPU (as
    torch places every CPU tensor)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        return torch.device("cpu")
    return device
