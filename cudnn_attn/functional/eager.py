"""The eager path of ``cudnn_attn.sdpa``: a flat key straight to a prepared run.

The first call of a signature is checked in full and prepares its runs (``problems.py``).
Its key (shapes, strides, dtypes, devices, flags, aliasing) then proves the geometry of every
later call with that key, so those pay a tuple, a lock-free dict lookup and the plans' own
launches: no re-validation, no placeholder tensors, no custom-op dispatch. Which engine runs a
signature is ``ops.dispatch.select_call``'s choice: torch's own kernels (its cuDNN attention op
for training calls it serves, its SDPA kernel for what cuDNN lacks) run the call themselves;
otherwise the graphs run it, training through the one training seam (``runtime/training.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.mask import Causal, default_scale
from ..errors import ShapeMismatchError, UnsupportedError, ValidationError
from ..ops.dispatch import select_call
from ..ops.torch.call import Call
from ..runtime import backend_choice
from ..runtime.interop import in_layout_of
from ..runtime.keyed import KeyedCache
from ..runtime.prepared import PreparedRun
from ..runtime.training import differentiable
from . import problems
from .arguments import (
    ARGUMENT_NAMES,
    broadcast,
    broadcast_shapes,
    causal_kind,
    check_arguments,
    dense,
    mask_as_bias,
    materialised,
)

MAX_ENTRIES = 512
_prepared = KeyedCache(MAX_ENTRIES)  # flat key -> Prepared, or torch's kernel running the call
_SCALARS = (float, int, type(None))
_CAUSAL = (bool, Causal)  # a bool, or the variant a CausalBias mask stands for


def run(
    query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: Any, is_causal: Any, scale: Any, enable_gqa: Any
) -> torch.Tensor | None:
    """The call's output, or None where this path does not apply (not plain 4-D tensors)."""
    if type(query) is not torch.Tensor or type(key) is not torch.Tensor or type(value) is not torch.Tensor:
        return None
    if type(scale) not in _SCALARS or type(dropout_p) not in _SCALARS or query.dim() != 4:
        return None  # the full path checks (and refuses) anything else
    if type(is_causal) not in _CAUSAL or type(enable_gqa) is not bool:
        return None
    if attn_mask is not None and type(attn_mask) is not torch.Tensor:
        return None
    train = torch.is_grad_enabled() and (
        query.requires_grad
        or key.requires_grad
        or value.requires_grad
        or (attn_mask is not None and attn_mask.requires_grad)
    )
    mask = None if attn_mask is None else (attn_mask.shape, attn_mask.stride(), attn_mask.dtype, attn_mask.device)
    flat = (
        query.shape,
        query.stride(),
        query.dtype,
        query.device,
        key.shape,
        key.stride(),
        key.dtype,
        key.device,
        value.shape,
        value.stride(),
        value.dtype,
        value.device,
        mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        query is key,
        key is value,
        query is value,
        train,
        backend_choice.chosen(),
    )
    entry = _prepared.get(flat)
    if entry is None:
        entry = _prepared.put(
            flat, _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, train)
        )
    return entry(query, key, value, attn_mask)


def _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, train) -> Any:
    """Check the call in full and choose its engine: torch's kernel running the call, or a
    ``Prepared`` with its forward graph (the backward's comes with the first backward)."""
    shapes = broadcast_shapes(query, key, value, enable_gqa)
    if shapes is not None:  # torch broadcasts size-1 dims: the shapes found once per signature

        def broadcast_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> Any:
            return run(*broadcast((q, k, v), shapes), mask, dropout_p, is_causal, scale, enable_gqa)

        return broadcast_run
    check_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    causal = causal_kind(is_causal)
    call = Call(query, key, value, attn_mask, float(dropout_p), causal, scale, enable_gqa, train)
    choice = select_call(call, backend_choice.chosen())
    if choice.as_graph:
        problems.check_as_graph(query, key, value, attn_mask, dropout_p, causal, scale, train)
    if choice.run is not None:
        return choice.run
    entry = Prepared(
        backend=choice.backend,
        scale=float(scale) if scale is not None else default_scale(query.shape[-1]),
        causal=causal,
        dropout_p=float(dropout_p),
        train=train,
        materialise=tuple(materialised(t) is not t for t in (query, key, value)),
    )
    q, k, v = entry.layouts(query, key, value)
    bias = None if attn_mask is None else mask_as_bias(attn_mask, q, k.shape[-2])
    # Templates of the seed's geometry: drawing a seed here would shift torch's generator.
    seed, offset = (torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)) if dropout_p else (None, None)
    try:
        entry.forward_run = problems.forward_run(
            q, k, v, bias, entry.scale, causal, entry.dropout_p, seed, offset, train, entry.backend
        )
    except (ValidationError, UnsupportedError, ShapeMismatchError) as error:
        raise error.renamed(ARGUMENT_NAMES, context="sdpa") from None
    entry.plain = bias is None and not entry.dropout_p  # (q, k, v) alone
    return entry


class Prepared:
    """One call signature: its forward run, and its backward runs as they are needed, on the
    graphs of ``backend`` (the dispatch's choice)."""

    def __init__(self, backend: Any, scale: float, causal: Causal, dropout_p: float, train: bool, materialise: tuple):
        self.backend, self.scale, self.causal, self.dropout_p, self.train = backend, scale, causal, dropout_p, train
        self.materialise = materialise if any(materialise) else None
        self.forward_run: PreparedRun | None = None
        self.plain = False
        self.backward_runs: dict[bool, PreparedRun] = {}  # by bias_grad

    def layouts(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.materialise is None:
            return q, k, v
        return tuple(dense(t) if m else t for t, m in zip((q, k, v), self.materialise))  # empty ones too

    def rng(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A fresh dropout seed from torch's default generator (so torch.manual_seed repeats it)."""
        return torch.randint(0, 2**62, (1,), dtype=torch.int64), torch.zeros(1, dtype=torch.int64)

    def __call__(self, query, key, value, attn_mask) -> torch.Tensor:
        q, k, v = self.layouts(query, key, value)
        if self.plain:  # (q, k, v) alone, the common case: straight to the plan
            if self.train:
                return differentiable(self, q, k, v, None, None, None)
            return self.forward_run.run_ordered((q, k, v))[0]  # type: ignore[union-attr]
        bias = None if attn_mask is None else mask_as_bias(attn_mask, q, k.shape[-2])
        rng = self.rng() if self.dropout_p else None
        if self.train:
            return differentiable(self, q, k, v, bias, *(rng or (None, None)))
        return self.run_forward(q, k, v, bias, rng)[0]

    # ---- Trainable (runtime/training.py): inputs (q, k, v, bias, seed, offset) ----------------

    non_differentiable: tuple[int, ...] = ()

    def forward(self, inputs: tuple) -> tuple[tuple[torch.Tensor], tuple, None]:
        q, k, v, bias, seed, offset = inputs
        out, stats = self.run_forward(q, k, v, bias, None if seed is None else (seed, offset))
        return (out,), (q, k, v, bias, out, stats, seed, offset), None

    def backward(self, saved: tuple, state: None, grads: tuple, needs: tuple[bool, ...]) -> tuple:
        q, k, v, bias, out, stats, seed, offset = saved
        bias_grad = bias is not None and needs[3]
        found = self.run_backward(q, k, v, out, grads[0], stats, bias, seed, offset, bias_grad)
        return found[0], found[1], found[2], (found[3] if bias_grad else None), None, None

    # ---- the runs ---------------------------------------------------------------------------

    def run_forward(self, q, k, v, bias, rng) -> list[torch.Tensor]:
        assert self.forward_run is not None
        if self.plain:
            return self.forward_run.run_ordered((q, k, v))
        return self.forward_run.run_ordered([t for t in (q, k, v, bias, *(rng or ())) if t is not None])

    def run_backward(self, q, k, v, out, d_out, stats, bias, seed, offset, bias_grad: bool) -> list[torch.Tensor]:
        d_out = in_layout_of(d_out, out)
        run = self.backward_runs.get(bias_grad)
        if run is None:
            run = self.backward_runs[bias_grad] = problems.backward_run(
                q,
                k,
                v,
                out,
                d_out,
                stats,
                bias,
                self.scale,
                self.causal,
                self.dropout_p,
                seed,
                offset,
                bias_grad,
                self.backend,
            )
        return run.run_ordered(problems.backward_inputs(q, k, v, out, d_out, stats, bias, self.dropout_p, seed, offset))


def clear() -> None:
    _prepared.clear()
