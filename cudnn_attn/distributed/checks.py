"""The arguments of ``context_parallel_sdpa``: this rank's own problems, then agreement across ranks.

Local rules (each a line naming the argument): q/k/v are 4-D ``[B, H, S_shard, D]`` fp16/bf16
tensors of one dtype and device; K/V heads equal Q's or, with ``enable_gqa``, divide them;
q, k and v hold the same positions (one shard length); a causal zigzag shard splits into two
equal chunks; known ``mode``/``layout``. Packed (THD) or padded shards are refused as
unsupported. Then one small all-gather (``agreement.agree``, once per signature) makes every
rank raise alike when any rank refused its arguments or ranks differ in shapes, dtype or flags.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch
import torch.distributed as dist

from ..core.dtypes import FLOATING_IO, dtype_name
from ..core.mask import default_scale
from ..errors import shown
from .agreement import Field, agree, dtype_field, known, shape_fields
from .layout import LAYOUTS, layout_problems
from .process_group import Members, collective_device

MODES = ("p2p", "all_gather")
CONTEXT = "context_parallel_sdpa"


def checked(q: Any, k: Any, v: Any, m: Members, is_causal: Any, scale: Any, mode: Any, enable_gqa: Any,
            layout: Any) -> float:  # fmt: skip
    """The softmax scale to use, once every rank's arguments are known good; raises otherwise.

    Example::

        scale = checked(q, k, v, members(group, CONTEXT), True, None, "p2p", False, "zigzag")
    """
    key: tuple | None = (
        m.group,
        m.world,
        *(_geometry(t) for t in (q, k, v)),
        is_causal,
        scale,
        mode,
        enable_gqa,
        layout,
    )
    try:
        if known(key):  # the steady state: every rank agreed on this signature before
            return _scale(q, scale)
    except TypeError:  # an unhashable argument: never agreed, so it is checked (and refused) below
        key = None
    unsupported = _unsupported(q, k, v)
    # Refused or not, this rank still joins the exchange: the others must learn of it (``agree``).
    local = unsupported or _problems(q, k, v, m, is_causal, scale, mode, enable_gqa, layout)
    resolved = _scale(q, scale) if not local else 0.0
    fields = []
    for name, t in (("q", q), ("k", k), ("v", v)):
        shape = t.shape if isinstance(t, torch.Tensor) else ()
        fields += shape_fields(name, shape)
        fields.append(dtype_field(name, t.dtype if isinstance(t, torch.Tensor) else torch.uint8))
    fields += [
        Field("is_causal", int(bool(is_causal)) if not local else -1),
        Field("enable_gqa", int(bool(enable_gqa)) if not local else -1),
        Field("mode", MODES.index(mode) if not local else -1, lambda c: repr(MODES[c])),
        Field("layout", LAYOUTS.index(layout) if not local else -1, lambda c: repr(LAYOUTS[c])),
        Field("scale", _bits(resolved), lambda c: repr(_float(c))),
    ]
    agree(m, key, local, fields, collective_device(m, q), CONTEXT, local_unsupported=bool(unsupported))
    return resolved


def _geometry(t: Any) -> tuple:
    return (t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else (type(t),)


def _unsupported(q: Any, k: Any, v: Any) -> list[str]:
    """What is well formed elsewhere in the library but not sharded here: packed/ragged shards."""
    problems = []
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.is_nested:
            problems.append(f"{name}: a nested (ragged) tensor; context parallelism takes dense [B, H, S_shard, D]")
        elif isinstance(t, torch.Tensor) and t.dim() == 3:
            problems.append(
                f"{name}: 3-D {list(t.shape)}; packed (THD) and padded shards are not supported by context "
                "parallelism: give dense [B, H, S_shard, D] shards of equal length"
            )
    return problems


def _problems(q, k, v, m: Members, is_causal, scale, mode, enable_gqa, layout) -> list[str]:
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
    tensors = {"q": q, "k": k, "v": v}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            problems.append(f"{name}: {type(t).__name__}; expected a torch tensor")
        elif t.dtype not in FLOATING_IO:
            problems.append(f"{name}: dtype {dtype_name(t.dtype)}; expected float16 or bfloat16")
        elif t.dim() != 4:
            problems.append(f"{name}: {t.dim()}-D (shape {list(t.shape)}); expected a shard [B, H, S_shard, D]")
    if problems:
        return problems
    if len({q.dtype, k.dtype, v.dtype}) > 1:
        problems.append(f"k/v: dtypes {dtype_name(k.dtype)}/{dtype_name(v.dtype)}; q is {dtype_name(q.dtype)}, "
                        "they must match")  # fmt: skip
    if len({q.device, k.device, v.device}) > 1:
        problems.append(f"k/v: on {k.device}/{v.device}; q is on {q.device}, put them on one device")
    backend = str(dist.get_backend(m.group))
    if not q.is_cuda and "gloo" not in backend:
        problems.append(f"q: on {q.device}; the group's backend {backend!r} moves CUDA tensors only")
    elif q.is_cuda and "nccl" not in backend:
        problems.append(f"q: on {q.device}; CUDA shards need an NCCL group (the group's backend is {backend!r})")
    b, h, s, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        problems.append(f"k/v: batch {k.shape[0]}/{v.shape[0]}; q's is {b}, they must match")
    if k.shape[2] != s or v.shape[2] != s:
        problems.append(
            f"k/v: shard length {k.shape[2]}/{v.shape[2]}; q's is {s}: q, k and v must hold the same positions"
        )
    if k.shape[3] != d:
        problems.append(f"k: head dim {k.shape[3]} differs from q's {d}; q and k must share it")
    h_kv = k.shape[1]
    if v.shape[1] != h_kv:
        problems.append(f"v: {v.shape[1]} heads; k has {h_kv}, they must match")
    elif h_kv != h and not enable_gqa:
        problems.append(f"k: {h_kv} heads differ from q's {h}; pass enable_gqa=True for GQA/MQA")
    elif h_kv == 0 or h % h_kv:
        problems.append(f"k: {h_kv} heads do not divide q's {h}; GQA needs H_q % H_kv == 0")
    if is_causal and layout == "zigzag" and s % 2:
        problems.append(
            f"q: shard length {s} is odd; a causal zigzag shard holds two equal chunks (rank r: chunks r and "
            f"2W-1-r of 2W), so the full sequence must be a multiple of {2 * m.world}"
        )
    return problems


def _scale(q: torch.Tensor, scale: Any) -> float:
    return float(scale) if scale is not None else default_scale(q.shape[-1])


def _bits(value: float) -> int:
    """A float as the int64 of its IEEE bits: compared exactly across ranks."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]
