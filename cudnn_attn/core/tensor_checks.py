"""The layout rules of every tensor of a problem: ranks, empty dimensions, strides, overlap.

Part of ``validation.problems``: each check appends lines naming the argument to ``found``
and says whether the tensors are laid out well enough for the later checks to read them.
"""

from __future__ import annotations

import torch

from .problem import AttentionProblem, TensorSpec
from .roles import user_name


def check_ranks(p: AttentionProblem, found: list[str]) -> bool:
    """Every tensor's rank, and no empty dimension but torch's empty calls; appends to ``found``."""
    before = len(found)
    if p.q.rank not in (3, 4):
        found.append(
            f"q: rank {p.q.rank} (shape {list(p.q.shape)}); q must be 4-D [B, H, S, D] "
            "or 3-D [T, H, D] for ragged (THD) inputs"
        )
        return False
    kv_rank = 4 if p.is_paged else p.q.rank
    what = (
        "a 4-D paged cache" if p.is_paged else ("3-D [T, H, D] like q" if p.q.rank == 3 else "4-D [B, H, S, D] like q")
    )
    for role in ("k", "v"):
        spec = getattr(p, role)
        if spec.rank != kv_rank:
            found.append(f"{role}: rank {spec.rank} (shape {list(spec.shape)}); expected {what}")
    for role in ("o", "grad_o", "grad_q"):
        spec = getattr(p, role)
        if spec is not None and spec.rank != p.q.rank:
            found.append(
                f"{user_name(role)}: rank {spec.rank} (shape {list(spec.shape)}); expected rank {p.q.rank} like q"
            )
    for role in ("grad_k", "grad_v"):
        spec = getattr(p, role)
        if spec is not None and spec.rank != p.q.rank:
            found.append(f"{user_name(role)}: rank {spec.rank}; expected rank {p.q.rank} like {role[-1]}")
    for role in ("stats", "bias", "grad_bias"):
        spec = getattr(p, role)
        if spec is not None and spec.rank != 4:
            found.append(f"{user_name(role)}: rank {spec.rank} (shape {list(spec.shape)}); expected 4-D")
    # torch's SDPA takes an empty batch or sequence (its output is empty, or zeros for S_kv = 0):
    # dense q/k/v may have them, and the tensors made from their sizes (O, stats, gradients, bias).
    empty_ok = _empty_dims_allowed(p)
    for role, spec in p.tensor_specs().items():
        if any(s < 0 for s in spec.shape) or any(s == 0 for s in spec.shape) and role not in empty_ok:
            found.append(
                f"{_role_of(p, spec)}: shape {list(spec.shape)} has an empty dimension; every dimension must be >= 1"
            )
            break
    if not found[before:] and empty_ok and any(n == 0 for n in (*p.q.shape[-1:], *p.v.shape[-1:], p.h_q, p.h_k)):
        found.append(f"q: shape {list(p.q.shape)}; heads and head dims must be >= 1 (only B, S_q, S_kv may be 0)")
    return len(found) == before


# Roles whose dims follow the dense problem's B, S_q and S_kv alone.
_EMPTY_ROLES = frozenset(
    ("q", "k", "v", "o", "stats", "grad_o", "grad_q", "grad_k", "grad_v", "bias", "grad_bias", "rng_dump")
)


def _empty_dims_allowed(p: AttentionProblem) -> frozenset[str]:
    """The roles that may hold an empty dimension: only in a dense (not ragged, not paged, not
    FP8) problem, where B, S_q or S_kv = 0 is torch's empty call."""
    if p.q.rank != 4 or p.is_thd or p.is_paged or p.is_fp8 or p.offset_tensors:
        return frozenset()
    return _EMPTY_ROLES


def check_strides(p: AttentionProblem, found: list[str], outputs: tuple[str, ...]) -> bool:
    """Strides match the ranks, the head dim is contiguous, ``outputs`` (roles) never overlap
    themselves; appends to ``found``."""
    ok = True
    for role, spec in p.tensor_specs().items():
        if len(spec.stride) != len(spec.shape):
            found.append(
                f"{user_name(role)}: {len(spec.stride)} strides {list(spec.stride)} for shape {list(spec.shape)}; "
                "give one stride per dimension"
            )
            ok = False
        elif any(s < 0 for s in spec.stride):
            found.append(f"{user_name(role)}: negative stride in {list(spec.stride)}; strides must be >= 0")
            ok = False
    if not ok:
        return False
    for role in ("q", "k", "v", "o", "grad_o", "grad_q", "grad_k", "grad_v", "bias", "grad_bias"):
        spec = getattr(p, role)
        if spec is not None and spec.shape and spec.stride[-1] != 1 and spec.shape[-1] != 1:
            found.append(
                f"{user_name(role)}: last stride {spec.stride[-1]} (strides {list(spec.stride)}); "
                "the head dimension must be contiguous (stride 1): call .contiguous() or permute a contiguous tensor"
            )
    if p.rng_dump is not None:
        want = (p.batch, p.h_q, p.s_q, p.s_kv)
        if tuple(p.rng_dump.shape) != want or p.rng_dump.dtype != torch.float32 or not p.is_forward:
            found.append(f"rng_dump: {p.rng_dump.describe()}; the forward's dropout keep-mask is float32 {list(want)}")
    for role in outputs:
        spec = getattr(p, role)
        # With ragged offsets the batch stride is unused: sequences are placed by the offsets.
        if spec is not None and role not in p.offset_tensors and overlaps(spec):
            found.append(
                f"{user_name(role)}: strides {list(spec.stride)} for shape {list(spec.shape)} make elements overlap; "
                "an output needs a layout where every element has its own memory"
            )
    return True


def overlaps(spec: TensorSpec) -> bool:
    """Whether two elements of ``spec`` share memory (dims of size 1 never address memory)."""
    dims = sorted((stride, size) for stride, size in zip(spec.stride, spec.shape) if size > 1)
    extent = 1  # elements spanned by the dims inside the current one
    for stride, size in dims:
        if stride < extent:
            return True
        extent = stride * size
    return False


def _role_of(p: AttentionProblem, spec: TensorSpec) -> str:
    for role, candidate in p.tensor_specs().items():
        if candidate is spec:
            return user_name(role)
    return "tensor"
