"""What ``PagedAttention`` checks of its arguments, on the host, naming each: the page table and
lengths at ``plan`` (values too, when they are on the CPU), the layer's tensors at ``run``."""

from __future__ import annotations

from typing import Any

import torch

from ..core.problem import TensorSpec
from ..core.tensor_checks import overlaps
from ..errors import UnsupportedError, ValidationError
from .step import Step, canonical_device

MAX_QUERY_TOKENS = 16


def check_device(device: Any) -> torch.device | None:
    """The constructor's ``device`` in one spelling; a device this host lacks is refused here,
    naming it, rather than by torch at the first step."""
    if device is None:
        return None
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as error:
        raise ValidationError([f"device: {device!r}: {error}"], context="PagedAttention") from None
    if resolved.type == "cuda":
        count = torch.cuda.device_count()  # 0 where torch has no CUDA build
        if count == 0:
            raise UnsupportedError(
                [f"device: {device!r}, but torch sees no CUDA GPU on this host (or CUDA_VISIBLE_DEVICES hides them)"],
                context="PagedAttention",
                alternatives=["device='cpu' (the reference backend)", "device=None (the tensors' device)"],
            )
        if resolved.index is not None and resolved.index >= count:
            raise ValidationError(
                [f"device: {device!r}; this host has {count} CUDA device{'s' if count > 1 else ''}"],
                context="PagedAttention",
            )
    return canonical_device(resolved)


def check_plan(attn: Any, page_table: Any, seq_lens_kv: Any, q_lens: Any) -> torch.device:
    """``PagedAttention.plan``'s arguments checked by name; the step's device."""
    problems = []
    given = [("page_table", page_table, 2), ("seq_lens_kv", seq_lens_kv, 1)]
    for name, t, rank in given + ([("q_lens", q_lens, 1)] if q_lens is not None else []):
        if not isinstance(t, torch.Tensor):
            problems.append(f"{name}: {type(t).__name__}; expected an int32 tensor")
        elif t.dtype != torch.int32 or t.dim() != rank:
            problems.append(f"{name}: {t.dtype} of shape {list(t.shape)}; expected a {rank}-D int32 tensor")
    for name, t, _ in given + ([("q_lens", q_lens, 1)] if q_lens is not None else []):
        if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "cuda"):
            problems.append(f"{name}: on {t.device}; PagedAttention plans from CPU or CUDA tensors")
    if problems:
        raise ValidationError(problems, context="PagedAttention.plan")
    batch, pages = page_table.shape
    if seq_lens_kv.shape[0] != batch:
        problems.append(f"seq_lens_kv: {seq_lens_kv.shape[0]} lengths for {batch} page-table rows")
    if q_lens is not None and q_lens.shape[0] != batch:
        problems.append(f"q_lens: {q_lens.shape[0]} lengths for {batch} page-table rows")
    if batch < 1 or pages < 1:
        problems.append(f"page_table: shape {list(page_table.shape)}; needs at least one sequence and one page")
    if attn.max_batch is not None and batch > attn.max_batch:
        problems.append(f"page_table: {batch} sequences, above max_batch={attn.max_batch}")
    if attn.max_pages_per_seq is not None and pages > attn.max_pages_per_seq:
        problems.append(f"page_table: {pages} pages per sequence, above max_pages_per_seq={attn.max_pages_per_seq}")
    device = attn.device if attn.device is not None else page_table.device
    for name, t in (("page_table", page_table), ("seq_lens_kv", seq_lens_kv), ("q_lens", q_lens)):
        # host tensors are copied to the step's device; a GPU tensor must be on it already
        if t is not None and t.device.type != "cpu" and t.device != device:
            runs = "this PagedAttention runs" if attn.device is not None else "the page table is"
            problems.append(f"{name}: on {t.device}; {runs} on {device}")
    if not problems and not page_table.is_cuda:
        limit = pages * attn.page_size
        negative = page_table < 0
        if not seq_lens_kv.is_cuda:  # slots past a sequence's pages are never read: padding may be anything
            negative &= read_slots(seq_lens_kv, pages, attn.page_size)
        if negative.any():
            row, col = (int(i) for i in torch.nonzero(negative)[0])
            problems.append(f"page_table: page {int(page_table[row, col])} at [{row}, {col}] is negative")
        bad = (seq_lens_kv < 0) | (seq_lens_kv > limit)  # 0: an empty slot, whose output is zeros
        if bad.any():
            at = int(torch.nonzero(bad)[0])
            problems.append(
                f"seq_lens_kv: sequence {at} has length {int(seq_lens_kv[at])}; allowed 0..{limit} "
                f"({pages} pages of {attn.page_size})"
            )
        elif q_lens is not None and not q_lens.is_cuda and ((q_lens < 0) | (q_lens > seq_lens_kv)).any():
            at = int(torch.nonzero((q_lens < 0) | (q_lens > seq_lens_kv))[0])
            problems.append(
                f"q_lens: sequence {at} has {int(q_lens[at])} new tokens; allowed 0..seq_lens_kv[{at}]="
                f"{int(seq_lens_kv[at])} (the new tokens are the last of its cache)"
            )
    if problems:
        raise ValidationError(problems, context="PagedAttention.plan")
    return device


def read_slots(seq_lens_kv: torch.Tensor, pages: int, page_size: int) -> torch.Tensor:
    """Boolean ``[B, pages]``: the page-table slots each sequence reads (its length's pages)."""
    needed = (seq_lens_kv.to(torch.int64).clamp(0, pages * page_size) + page_size - 1) // page_size
    return torch.arange(pages, device=seq_lens_kv.device).view(1, -1) < needed.view(-1, 1)


def unread_slots_zeroed(page_table: torch.Tensor, seq_lens_kv: torch.Tensor, page_size: int) -> torch.Tensor:
    """A host page table with page 0 in the slots no sequence reads: they may hold padding (-1, a
    page past the cache) as a GPU takes them (clamped there), and the checks then see only the
    pages read. The caller's table is not written."""
    if page_table.is_cuda or seq_lens_kv.is_cuda:
        return page_table
    read = read_slots(seq_lens_kv, page_table.shape[1], page_size)
    return torch.where(read, page_table, torch.zeros((), dtype=page_table.dtype))


def check_run(attn: Any, q: Any, k_cache: Any, v_cache: Any, out: Any, step: Step) -> None:
    """``PagedAttention.run``'s tensors checked by name against the instance and its planned step.
    A step's layers repeat one geometry: what passed once passes again unchecked."""
    key = geometry_of(q, k_cache, v_cache, out)
    if key is not None and key in step.checked:
        return
    _check_run(attn, q, k_cache, v_cache, out, step)
    if key is not None:
        step.checked.add(key)


def geometry_of(q: Any, k_cache: Any, v_cache: Any, out: Any) -> tuple | None:
    """What ``check_run`` reads of plain tensors (None for anything else: checked every time)."""
    tensor = torch.Tensor
    if type(q) is not tensor or type(k_cache) is not tensor or type(v_cache) is not tensor:
        return None
    if out is not None and type(out) is not tensor:
        return None
    key = tuple((t.shape, t.dtype, t.device, t.stride(-1)) for t in (q, k_cache, v_cache))
    # out's whole layout and grad: an expanded view or a leaf that requires grad is refused by name
    grad = out is not None and out.requires_grad and torch.is_grad_enabled()
    return key if out is None else (*key, (out.shape, out.dtype, out.device, out.stride(), grad))


def _check_run(attn: Any, q: Any, k_cache: Any, v_cache: Any, out: Any, step: Step) -> None:
    problems = []
    q_rank = 3 if step.prefill else 4
    for name, t, rank in (("q", q, q_rank), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4)):
        if not isinstance(t, torch.Tensor) or t.dim() != rank:
            form = (
                "a packed [T, H_q, D] tensor (the step was planned with q_lens)"
                if name == "q" and rank == 3
                else "a 4-D tensor"
            )
            problems.append(f"{name}: expected {form}, got {getattr(t, 'shape', type(t).__name__)}")
        elif t.dtype != (attn.dtype if name == "q" else attn.kv_dtype):
            wanted = attn.dtype if name == "q" else attn.kv_dtype
            problems.append(
                f"{name}: dtype {t.dtype}; this PagedAttention takes {wanted}"
                + (" caches (kv_dtype)" if name != "q" and attn.kv_dtype != attn.dtype else "")
            )
        elif t.device != step.device:
            problems.append(f"{name}: on {t.device}; the step was planned on {step.device}")
    if problems:
        raise ValidationError(problems, context="PagedAttention.run")
    heads, dim = q.shape[-2 if step.prefill else 1], q.shape[-1]
    if heads != attn.num_q_heads or dim != attn.head_dim:
        problems.append(f"q: {heads} heads of {dim}; expected {attn.num_q_heads} heads of {attn.head_dim}")
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
    for name, t, dim in (("k_cache", k_cache, attn.head_dim), ("v_cache", v_cache, attn.head_dim_v)):
        expected = (
            [None, attn.num_kv_heads, attn.page_size, dim]
            if attn.kv_layout == "NHPD"
            else [None, attn.page_size, attn.num_kv_heads, dim]
        )
        if list(t.shape[1:]) != expected[1:]:
            problems.append(
                f"{name}: shape {list(t.shape)}; expected [num_pages, {', '.join(map(str, expected[1:]))}] "
                f"({attn.kv_layout})"
            )
        elif t.stride(-1) != 1 and t.shape[-1] != 1:  # the kernels and cuDNN read rows of D
            problems.append(f"{name}: strides {list(t.stride())}; the head dim must be contiguous (stride 1)")
    if v_cache.shape[0] != k_cache.shape[0]:
        problems.append(f"v_cache: {v_cache.shape[0]} pages, k_cache has {k_cache.shape[0]}")
    largest = step.largest_page
    if largest is not None and largest[0] >= k_cache.shape[0]:
        page, row, entry = largest
        pages = k_cache.shape[0]
        problems.append(
            f"page_table: sequence {row}, entry {entry} is page {page}; the cache has {pages} "
            f"page{'s' if pages != 1 else ''}"
        )
    shape = [*q.shape[:-1], attn.head_dim_v]
    if out is not None and (not isinstance(out, torch.Tensor) or list(out.shape) != shape or out.dtype != q.dtype):
        problems.append(f"out: expected a {q.dtype} tensor of shape {shape}")
    elif out is not None:
        if out.device != q.device:
            problems.append(f"out: on {out.device}; q is on {q.device}")
        if overlaps(TensorSpec.of(out)):
            problems.append(
                f"out: strides {list(out.stride())} for shape {list(out.shape)} make elements overlap (an "
                "expanded view?); run() writes every element: give it a tensor of its own memory"
            )
        if out.requires_grad and out.is_leaf and torch.is_grad_enabled():  # as torch's out= refuses it
            problems.append("out: a leaf tensor that requires grad; run() writes into it in place: pass out.detach()")
    if problems:
        raise ValidationError(problems, context="PagedAttention.run")
