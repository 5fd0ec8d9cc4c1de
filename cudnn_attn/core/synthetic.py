"""Fresh random tensors for a problem: what autotuning, ``cache warm`` and benchmarks run on.

Never zeros (they hide unwritten outputs and can run faster than real data). Sequence
lengths are full, page tables a random permutation of the pages, dropout seeds fixed.
"""

from __future__ import annotations

import torch

from .problem import AttentionProblem, TensorSpec
from .roles import BACKWARD_OUTPUTS, FORWARD_OUTPUTS, FP8_AMAXES, FP8_BACKWARD_AMAXES, FP8_BACKWARD_SCALES, FP8_SCALES


def empty(spec: TensorSpec, device: torch.device | str | None = None) -> torch.Tensor:
    return torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=device or spec.device)


def random_like(spec: TensorSpec, generator: torch.Generator | None = None) -> torch.Tensor:
    t = empty(spec)
    if t.dtype.is_floating_point:
        # Fill the storage the view addresses (packed layouts included), not just the view.
        flat = torch.randn(t.untyped_storage().nbytes() // t.element_size(), generator=generator)
        t.set_(flat.to(device=t.device, dtype=t.dtype).untyped_storage(), 0, t.shape, t.stride())
    return t


def run_tensors(p: AttentionProblem, seed: int = 0) -> tuple[dict, dict]:
    """(inputs, outputs) by role, ready for a plan's ``__call__``."""
    gen = torch.Generator().manual_seed(seed)
    inputs: dict = {}
    for role in ("q", "k", "v", "o", "grad_o", "bias"):
        spec = getattr(p, role)
        if spec is not None and (role != "o" or not p.is_forward):
            inputs[role] = random_like(spec, gen)
    if not p.is_forward and p.stats is not None:
        inputs["stats"] = (torch.rand(p.stats.shape, generator=gen) + 4.0).to(p.stats.device)  # plausible log-sum-exps
    if p.seq_len_q is not None:
        inputs["seq_len_q"] = torch.full(p.seq_len_q.shape, _full_length(p, "q"), dtype=torch.int32, device=p.device)
    if p.seq_len_kv is not None:
        inputs["seq_len_kv"] = torch.full(p.seq_len_kv.shape, _full_length(p, "kv"), dtype=torch.int32, device=p.device)
    for role in ("page_table_k", "page_table_v"):
        spec = getattr(p, role)
        if spec is not None:
            pages = p.k.shape[0]  # tables may address more pages than the cache holds: pages repeat
            perm = torch.randperm(pages, generator=gen).repeat(-(-spec.numel // pages))[: spec.numel]
            inputs[role] = perm.view(spec.shape).to(device=p.device, dtype=torch.int32)
    if p.has_dropout:
        inputs["dropout_seed"], inputs["dropout_offset"] = 1234, 0
    if p.scale_tensor is not None:
        inputs["scale_tensor"] = torch.full(
            p.scale_tensor.shape, p.d_qk**-0.5, dtype=torch.float32, device=p.scale_tensor.device
        )
    for role in (*FP8_SCALES, *FP8_BACKWARD_SCALES):  # FP8: unit scales (random data is in range)
        spec = getattr(p, role)
        if spec is not None:
            inputs[role] = torch.ones(spec.shape, dtype=spec.dtype, device=p.device)
    outputs = {}
    for role in (*FORWARD_OUTPUTS, *FP8_AMAXES) if p.is_forward else (*BACKWARD_OUTPUTS, *FP8_BACKWARD_AMAXES):
        spec = getattr(p, role)
        if spec is not None:
            outputs[role] = empty(spec)
    return inputs, outputs


def _full_length(p: AttentionProblem, side: str) -> int:
    if p.is_thd and not (side == "kv" and p.is_paged):  # lengths must fit the packed token count
        tokens = p.q.shape[0] if side == "q" else p.k.shape[0]
        return min(p.s_q if side == "q" else p.s_kv, tokens // p.batch)
    return p.s_q if side == "q" else p.s_kv
