"""The arguments of ``context_parallel_sdpa``: this rank's own problems, then agreement across ranks.

Local rules (each a line naming the argument): q/k/v are 4-D ``[B, H, S_shard, D]`` fp16/bf16/fp32
tensors of one dtype and device (3-D ``[T_shard, H, D]`` with ``cu_seqlens`` for packed
documents, each document's length a multiple of its chunks); K/V heads equal Q's or, with
``enable_gqa``, divide them; q, k and v hold the same positions (one shard length); a causal
zigzag shard splits into two equal chunks; known ``mode``/``layout``; ``window_size`` is a
causal window ``(left, 0)`` or none; ``sinks`` one logit per query head. Nested (ragged)
shards and windows with another right bound are refused as unsupported. Then one small
all-gather (``agreement.agree``, a short row per call) makes every rank raise alike when any rank
refused its arguments or ranks differ in shapes, dtype, flags or documents; on every call, so a
rank whose shard changed alone is caught too.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..core.dtypes import FLOATING_IO, dtype_name
from ..core.mask import Causal, default_scale, window_band
from ..core.score_inputs import check_sinks
from ..errors import ValidationError, shown
from .agreement import Field, agree, dtype_field, known, shape_fields
from .chunks import LAYOUTS, layout_problems
from .documents import Documents, cu_problems, host_lengths
from .process_group import Members

MODES = ("p2p", "all_gather")
CONTEXT = "context_parallel_sdpa"


@dataclass(frozen=True)
class Checked:
    """A call's arguments once every rank agreed: the scale, whether causal (a window is), the
    window's left bound (None: none) and packed shards' documents (None: dense)."""

    scale: float
    is_causal: bool
    left: int | None = None
    documents: Documents | None = None


def _typed(value: Any) -> Hashable:
    """``value`` with its type, and its items' (a key that tells 1 from True and 2.0 from 2)."""
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_typed(item) for item in value))
    return (type(value), value)


def checked(
    q: Any,
    k: Any,
    v: Any,
    m: Members,
    is_causal: Any,
    scale: Any,
    mode: Any,
    enable_gqa: Any,
    layout: Any,
    *,
    cu_seqlens: Any = None,
    max_seqlen: Any = None,
    window_size: Any = (-1, -1),
    sinks: Any = None,
) -> Checked:
    """The call resolved, once every rank's arguments are known good; raises otherwise.

    Example::

        c = checked(q, k, v, members(group, CONTEXT), True, None, "p2p", False, "zigzag")
    """
    packed = cu_seqlens is not None
    lengths = _lengths(cu_seqlens)
    key: tuple | None = (
        m.group,
        m.world,
        *(_geometry(t) for t in (q, k, v)),
        # With their types: True == 1 and (2.0, 0) == (2, 0), yet only one of each is valid.
        *(_typed(a) for a in (is_causal, scale, mode, enable_gqa, layout)),
        lengths,
        *(_typed(a) for a in (max_seqlen, window_size)),
        _geometry(sinks),
    )
    try:
        steady = known(key)  # every rank agreed on this signature before: only the short exchange
    except TypeError:  # an unhashable argument: never agreed, so it is checked (and refused) below
        key, steady = None, False
    unsupported: list[str] = []
    local: list[str] = []
    if not steady:
        unsupported = _unsupported(q, k, v, window_size)
        # Refused or not, this rank still joins the exchange: the others must learn of it (``agree``).
        local = unsupported or _problems(
            q, k, v, m, is_causal, scale, mode, enable_gqa, layout, window_size, cu_seqlens
        )
        if not local and packed:
            local = cu_problems(cu_seqlens, m.world, layout, q.shape[0], max_seqlen)
        elif not local and max_seqlen is not None:
            why = "it bounds packed documents (dense shards take none)"
            local = [f"max_seqlen: {shown(max_seqlen)} without cu_seqlens; {why}"]
        if not local:
            local = _score_term_problems(q, window_size, sinks)
    resolved = _resolved(q, scale, is_causal, window_size, lengths, m, layout) if not local else None

    def fields() -> list[Field]:
        made = []
        for name, t in (("q", q), ("k", k), ("v", v)):
            shape = t.shape if isinstance(t, torch.Tensor) and not t.is_nested else ()
            made += shape_fields(name, shape)
            made.append(dtype_field(name, t.dtype if isinstance(t, torch.Tensor) else torch.uint8))
        ok = resolved is not None
        return [
            *made,
            Field("is_causal", int(bool(is_causal)) if ok else -1),
            Field("enable_gqa", int(bool(enable_gqa)) if ok else -1),
            Field("mode", MODES.index(mode) if ok else -1, lambda c: repr(MODES[c])),
            Field("layout", LAYOUTS.index(layout) if ok else -1, lambda c: repr(LAYOUTS[c])),
            Field("scale", _bits(resolved.scale) if resolved else 0, lambda c: repr(_float(c))),
            Field("window_size: left bound", resolved.left if resolved and resolved.left is not None else -1),
            Field("sinks: given", int(sinks is not None)),
            Field("cu_seqlens: documents", len(lengths) if ok and lengths is not None else -1),
            Field("cu_seqlens: checksum of the lengths", _checksum(lengths) if ok else -1),
        ]

    agree(m, key, local, fields, CONTEXT, local_unsupported=bool(unsupported))
    assert resolved is not None  # agree raised otherwise
    return resolved


def _resolved(q, scale, is_causal, window_size, lengths, m: Members, layout) -> Checked:
    _, left, _ = window_band(window_size, Causal.NONE)
    left = None if left is None else left - 1
    causal = bool(is_causal) or tuple(window_size)[1] == 0
    docs = None if lengths is None else Documents(lengths, m.world, layout)
    return Checked(_scale(q, scale), causal, left, docs)


def _lengths(cu: Any) -> tuple[int, ...] | None:
    """The documents' lengths when ``cu_seqlens`` is a well-formed tensor (None otherwise)."""
    if not isinstance(cu, torch.Tensor) or cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1:
        return None
    return host_lengths(cu) if cu.shape[0] >= 2 else None


def _checksum(lengths: tuple[int, ...] | None) -> int:
    return -1 if lengths is None else zlib.crc32(repr(lengths).encode())


def _geometry(t: Any) -> tuple:
    if not isinstance(t, torch.Tensor):
        return (type(t),)
    # A nested tensor has no sizes to read: keyed by its kind, it is refused by name below.
    return ("nested", t.dtype, t.device) if t.is_nested else (t.shape, t.dtype, t.device)


def _unsupported(q: Any, k: Any, v: Any, window_size: Any) -> list[str]:
    """What is well formed elsewhere in the library but not sharded here: nested shards, windows
    other than causal ones."""
    problems = []
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.is_nested:
            problems.append(
                f"{name}: a nested (ragged) tensor; context parallelism takes dense [B, H, S_shard, D] "
                "shards, or packed [T_shard, H, D] ones with cu_seqlens"
            )
    try:
        causal, left, right = window_band(window_size, Causal.NONE)
    except ValueError:
        return problems  # malformed: refused as such (_score_term_problems)
    if right is not None or (left is not None and causal is Causal.NONE):
        problems.append(
            f"window_size: {tuple(window_size)}; context parallelism takes a causal sliding window (left, 0) or none"
        )
    return problems


def _score_term_problems(q: torch.Tensor, window_size: Any, sinks: Any) -> list[str]:
    problems = []
    try:
        window_band(window_size, Causal.NONE)
    except ValueError as error:
        problems.append(str(error))
    if sinks is not None:
        try:
            check_sinks(sinks, q.shape[1], q.device)
        except ValidationError as error:
            problems += error.problems
    return problems


def _problems(q, k, v, m: Members, is_causal, scale, mode, enable_gqa, layout, window_size, cu_seqlens) -> list[str]:
    problems: list[str] = []
    if not isinstance(mode, str) or mode not in MODES:
        problems.append(f"mode: {shown(mode)}; expected one of {', '.join(map(repr, MODES))}")
    problems += layout_problems(layout)
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if not isinstance(flag, bool):
            problems.append(f"{name}: {shown(flag)}; expected True or False")
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0
    ):
        problems.append(f"scale: {shown(scale)}; expected a positive finite float or None (1/sqrt(head dim))")
    packed = cu_seqlens is not None
    want = "packed [T_shard, H, D] (with cu_seqlens)" if packed else "a shard [B, H, S_shard, D]"
    tensors = {"q": q, "k": k, "v": v}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            problems.append(f"{name}: {type(t).__name__}; expected a torch tensor")
        elif t.dtype not in FLOATING_IO:
            problems.append(f"{name}: dtype {dtype_name(t.dtype)}; expected float16, bfloat16 or float32")
        elif t.dim() == 3 and not packed:
            problems.append(
                f"{name}: 3-D (shape {list(t.shape)}); packed [T_shard, H, D] shards need cu_seqlens, "
                "the whole packed sequence's (dense shards are [B, H, S_shard, D])"
            )
        elif t.dim() != (3 if packed else 4):
            problems.append(f"{name}: {t.dim()}-D (shape {list(t.shape)}); expected {want}")
    if problems:
        return problems
    if len({q.dtype, k.dtype, v.dtype}) > 1:
        problems.append(
            f"k/v: dtypes {dtype_name(k.dtype)}/{dtype_name(v.dtype)}; q is {dtype_name(q.dtype)}, they must match"
        )
    if len({q.device, k.device, v.device}) > 1:
        problems.append(f"k/v: on {k.device}/{v.device}; q is on {q.device}, put them on one device")
    backend = str(dist.get_backend(m.group))
    if q.device.type not in ("cpu", "cuda"):  # meta, ...: no collective moves them
        problems.append(f"q: on {q.device}; shards live on a CUDA device (NCCL) or the CPU (gloo)")
    elif not q.is_cuda and "gloo" not in backend:
        problems.append(f"q: on {q.device}; the group's backend {backend!r} moves CUDA tensors only")
    elif q.is_cuda and "nccl" not in backend:
        problems.append(f"q: on {q.device}; CUDA shards need an NCCL group (the group's backend is {backend!r})")
    seq, heads, dim = (0, 1, 2) if packed else (2, 1, 3)
    s, h, d = q.shape[seq], q.shape[heads], q.shape[dim]
    if not packed and (k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]):
        problems.append(f"k/v: batch {k.shape[0]}/{v.shape[0]}; q's is {q.shape[0]}, they must match")
    if k.shape[seq] != s or v.shape[seq] != s:
        problems.append(
            f"k/v: shard length {k.shape[seq]}/{v.shape[seq]}; q's is {s}: q, k and v must hold the same positions"
        )
    if k.shape[dim] != d:
        problems.append(f"k: head dim {k.shape[dim]} differs from q's {d}; q and k must share it")
    h_kv = k.shape[heads]
    if v.shape[heads] != h_kv:
        problems.append(f"v: {v.shape[heads]} heads; k has {h_kv}, they must match")
    elif h_kv != h and not enable_gqa:
        problems.append(f"k: {h_kv} heads differ from q's {h}; pass enable_gqa=True for GQA/MQA")
    elif h_kv == 0 or h % h_kv:
        problems.append(f"k: {h_kv} heads do not divide q's {h}; GQA needs H_q % H_kv == 0")
    causal = is_causal or isinstance(window_size, (tuple, list)) and len(window_size) == 2 and window_size[1] == 0
    if not packed and causal and layout == "zigzag" and s % 2:
        problems.append(
            f"q: shard length {s} is odd; a causal zigzag shard holds two equal chunks (rank r: chunks r and "
            f"2W-1-r of 2W), so the full sequence must be a multiple of {2 * m.world}"
        )
    if packed and s == 0:
        problems.append("q: no tokens; a packed shard needs at least one")
    return problems


def _scale(q: torch.Tensor, scale: Any) -> float:
    return float(scale) if scale is not None else default_scale(q.shape[-1])


def _bits(value: float) -> int:
    """A float as the int64 of its IEEE bits: compared exactly across ranks."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]
