"""The reference backend: every feature, in plain PyTorch, on CPU or GPU.

It brings every layout to dense [B, H, S, D] (unpacking THD, gathering paged caches),
runs ``math.py`` (imported as ``reference_math``) in float32 (float64 on request), and writes the results back in
the outputs' own layouts. Its "plan" precomputes what depends on the problem alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from ...core import ragged, validation
from ...core.bounds import clamped, upper_bounds, value_problems
from ...core.problem import AttentionProblem, KVCacheLayout
from ...core.roles import FP8_BACKWARD_AMAXES, FP8_BACKWARD_SCALES, FP8_SCALES, ROLES, offset_role, sequence_lengths
from ...core.sink_fold import sink_gradient
from ...errors import ValidationError
from ..base import RunInputs
from . import dropout, masks, score_mod
from . import fp8 as reference_fp8
from . import math as reference_math


class ReferenceBackend:
    """Runs anything that validates; on any device torch runs on."""

    name = "reference"
    tunable = False  # one way to run a problem
    stores_plans = False  # a plan is the problem alone

    def __init__(self, compute_dtype: torch.dtype = torch.float32):
        self.compute_dtype = compute_dtype

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        return validation.unrunnable(problem)

    def plan_key(self, problem: AttentionProblem) -> tuple:
        return (str(self.compute_dtype),)

    def build(self, problem: AttentionProblem, *, autotune: bool = False, store: Any = None) -> ReferencePlan:
        """The reference has one way to run a problem: nothing to tune, nothing worth storing."""
        return ReferencePlan(problem, self.compute_dtype)

    def from_blob(self, problem: AttentionProblem, blob: bytes) -> ReferencePlan:
        """A serialized graph's plan: the problem is all a reference plan holds (``blob`` is empty)."""
        return ReferencePlan(problem, self.compute_dtype)

    def to_blob(self, plan: Any) -> bytes:
        return b""


class ReferencePlan:
    """Holds the problem alone: masks and ALiBi are made per block of rows at run time, so a
    plan costs no memory whatever the sequence length."""

    workspace_size = 0
    nbytes = 0

    def __init__(self, problem: AttentionProblem, compute_dtype: torch.dtype = torch.float32):
        self.problem = problem
        # float64 inputs are computed in float64, as torch's SDPA computes them.
        self.compute_dtype = torch.float64 if problem.q.dtype == torch.float64 else compute_dtype
        self._bounds = upper_bounds(problem)

    def __call__(
        self,
        inputs: RunInputs,
        outputs: Mapping[str, torch.Tensor],
        *,
        stream: Any = None,
        workspace: torch.Tensor | None = None,
        handle: Any = None,
        dropout_keep: torch.Tensor | None = None,
    ) -> None:
        if not torch._C._is_any_autocast_enabled():  # the one-call check: nearly every call
            self._run(inputs, outputs, dropout_keep)
            return
        kind = torch.device(self.problem.q.device).type
        # Under a caller's autocast its float32 matmuls ran in bf16 in the forward and in float32 in
        # the backward (outside the block): the backward's probabilities were no longer normalised.
        with torch.autocast(kind, enabled=False) if torch.amp.is_autocast_available(kind) else contextlib.nullcontext():
            self._run(inputs, outputs, dropout_keep)

    def _run(self, inputs: RunInputs, outputs: Mapping[str, torch.Tensor], dropout_keep: torch.Tensor | None) -> None:
        p = self.problem
        inputs = self._checked(inputs, outputs)
        dense = self._dense_inputs(inputs)
        terms = self._terms(inputs, dropout_keep)
        if p.is_fp8:
            self._fp8(inputs, dense, terms, outputs)
        elif p.is_forward:
            o, stats = reference_math.forward(dense["q"], dense["k"], dense["v"], terms)
            self._write(outputs["o"], o, inputs, "o")
            if "stats" in outputs:
                self._write(outputs["stats"], stats, inputs, "stats")
            if "rng_dump" in outputs:  # this backend's own keep-mask (1 kept, 0 dropped): not cuDNN's Philox draws
                keep = terms.keep
                outputs["rng_dump"].copy_(keep if keep is not None else torch.ones_like(outputs["rng_dump"]))
        else:
            d_bias = outputs.get("grad_bias")
            d_q, d_k, d_v, d_b = reference_math.backward(
                dense["q"],
                dense["k"],
                dense["v"],
                dense["o"],
                dense["grad_o"],
                dense["stats"],
                terms,
                bias_shape=tuple(d_bias.shape) if d_bias is not None else None,
            )
            self._write(outputs["grad_q"], d_q, inputs, "grad_q")
            self._write(outputs["grad_k"], d_k, inputs, "grad_k")
            self._write(outputs["grad_v"], d_v, inputs, "grad_v")
            if d_bias is not None and d_b is not None:
                d_bias.copy_(d_b)
            if "grad_sink" in outputs:
                assert terms.sink is not None, "validation: dSink_token needs sink_token"
                d_sink = sink_gradient(dense["o"], dense["grad_o"], dense["stats"], terms.sink)
                outputs["grad_sink"].copy_(d_sink)

    # The frontend's plan helpers: the reference backend has one plan.
    def plan_count(self) -> int:
        return 1

    def plan_name_at(self, index: int) -> str:
        return "reference"

    def at_index(self, index: int) -> ReferencePlan:
        return self

    def _fp8(self, inputs: RunInputs, dense: dict, terms: reference_math.ScoreTerms, outputs: Mapping) -> None:
        """FP8 nodes, emulated as cuDNN computes them (``reference_fp8``): dense holds the FP8
        values widened to the compute dtype; scales, casts and amaxes follow the op."""
        p, dt = self.problem, self.compute_dtype
        scales = {role: _as_tensor(inputs[role]) for role in (*FP8_SCALES, *FP8_BACKWARD_SCALES) if role in inputs}
        if p.is_forward:
            o, stats, amax_s, amax_o = reference_fp8.forward_fp8(
                dense["q"],
                dense["k"],
                dense["v"],
                *(scales[role] for role in FP8_SCALES),
                terms=terms,
                out_dtype=p.o.dtype,
                p_dtype=p.q.dtype,
                compute_dtype=dt,
            )
            self._write(outputs["o"], o, inputs, "o")
            if "stats" in outputs:
                self._write(outputs["stats"], stats, inputs, "stats")
            for role, amax in (("amax_s", amax_s), ("amax_o", amax_o)):
                if role in outputs:
                    outputs[role].copy_(amax)
            return
        assert p.grad_q is not None and p.grad_o is not None
        d_q, d_k, d_v, *amaxes = reference_fp8.backward_fp8(
            dense["q"],
            dense["k"],
            dense["v"],
            dense["o"],
            dense["grad_o"],
            dense["stats"],
            *(scales[role] for role in FP8_BACKWARD_SCALES),
            terms=terms,
            grad_dtype=p.grad_q.dtype,
            p_dtype=p.q.dtype,
            ds_dtype=p.grad_o.dtype,
            compute_dtype=dt,
        )
        self._write(outputs["grad_q"], d_q, inputs, "grad_q")
        self._write(outputs["grad_k"], d_k, inputs, "grad_k")
        self._write(outputs["grad_v"], d_v, inputs, "grad_v")
        if "grad_sink" in outputs:
            assert terms.sink is not None, "validation: dSink_token needs sink_token"
            descale = (scales["descale_o"].to(dt) * scales["descale_grad_o"].to(dt)).reshape(())
            d_sink = sink_gradient(dense["o"], dense["grad_o"], dense["stats"], terms.sink, descale)
            outputs["grad_sink"].copy_(d_sink)
        for role, amax in zip(FP8_BACKWARD_AMAXES, amaxes):
            if role in outputs:
                outputs[role].copy_(amax)

    def _checked(self, inputs: RunInputs, outputs: Mapping[str, torch.Tensor]) -> RunInputs:
        """Integer inputs checked where they live on the host (an error names bad values);
        on a GPU clamped on the device instead, as the cuDNN path does (no sync per call)."""
        checked = (*self._bounds, *(offset_role(role) for role in self.problem.offset_tensors))
        ints = {role: t for role in checked if isinstance(t := inputs.get(role), torch.Tensor)}
        if all(t.device.type == "cpu" for t in ints.values()):
            # the packed tensors too: their sequences are judged against the memory bound
            bound = {
                r: t
                for r in ragged.packed_roles(self.problem)
                if isinstance(t := inputs.get(r, outputs.get(r)), torch.Tensor)
            }
            found = value_problems(self.problem, {**ints, **bound}) + ragged.packed_offset_problems(
                self.problem, inputs, outputs
            )
            if found:
                raise ValidationError(found, context=self.problem.describe())
            return inputs
        return clamped(self.problem, inputs, self._bounds, outputs)

    # ---- inputs to dense ----------------------------------------------------------------

    def _dense_inputs(self, inputs: RunInputs) -> dict[str, torch.Tensor]:
        p, dt = self.problem, self.compute_dtype
        dense: dict[str, torch.Tensor] = {}
        for role in ("q", "k", "v", "o", "grad_o"):
            t = inputs.get(role)
            if not isinstance(t, torch.Tensor):
                continue
            lengths = ROLES[role].lengths
            assert lengths is not None, "the role table gives every sequence tensor its lengths"
            s_max = p.s_q if lengths == "seq_len_q" else p.s_kv
            if p.is_paged and role in ("k", "v"):
                table = self._table(inputs, "page_table_k" if role == "k" else "page_table_v")
                dense[role] = gather_pages(t, table, p.kv_cache_layout, p.s_kv).to(dt)
            elif role in p.offset_tensors:
                dense[role] = ragged.gather_rows(
                    t, _as_tensor(inputs[offset_role(role)]), _lengths_or_none(inputs, lengths), getattr(p, role)
                ).to(dt)
            elif p.is_thd:
                dense[role] = unpack_thd(t.to(dt), _as_tensor(inputs[lengths]), s_max)
            else:
                dense[role] = t.to(dt)
            if p.options.padding and isinstance(inputs.get(lengths), torch.Tensor):
                # What lies past a sequence's length is never read: whatever it holds (NaN
                # included) must not reach the results, as on cuDNN.
                valid = torch.arange(s_max, device=t.device).view(1, 1, -1, 1) < _as_tensor(inputs[lengths]).view(
                    -1, 1, 1, 1
                ).to(t.device)
                dense[role] = dense[role].masked_fill(~valid, 0.0)
        if "stats" in inputs and not p.is_forward:
            stats = _as_tensor(inputs["stats"])
            if "stats" in p.offset_tensors:
                stats = ragged.gather_rows(
                    stats, _as_tensor(inputs["stats_offset"]), _lengths_or_none(inputs, "seq_len_q"), p.stats
                )
            dense["stats"] = stats.to(dt)
        return dense

    def _table(self, inputs: RunInputs, role: str) -> torch.Tensor:
        """A page table, packed ones (the caller's ragged offsets) gathered to [B, 1, n, 1]."""
        table = _as_tensor(inputs[role])
        if role in self.problem.offset_tensors:
            table = ragged.gather_rows(table, _as_tensor(inputs[offset_role(role)]), None)
        return table

    def _terms(self, inputs: RunInputs, dropout_keep: torch.Tensor | None) -> reference_math.ScoreTerms:
        p, dt = self.problem, self.compute_dtype
        bias = inputs.get("bias")
        bias = bias.to(dt) if isinstance(bias, torch.Tensor) else None
        alibi = None
        if p.options.alibi:

            def alibi(rows: range) -> torch.Tensor:
                return masks.alibi_bias(p.h_q, rows, p.s_kv, dt, p.device)

        lengths_q, lengths_kv = _lengths_or_none(inputs, "seq_len_q"), _lengths_or_none(inputs, "seq_len_kv")

        def allowed(rows: range) -> torch.Tensor | None:
            return masks.allowed_scores(p, lengths_q, lengths_kv, p.device, rows)

        keep = dropout_keep
        if p.has_dropout and keep is None:
            shape = (p.batch, p.h_q, p.s_q, p.s_kv)
            keep = dropout.keep_mask(
                dropout.scalar(inputs.get("dropout_seed")),
                dropout.scalar(inputs.get("dropout_offset")),
                shape,
                p.options.dropout_p,
                p.device,
            )
        modifier = modifier_grad = None
        if p.score_mod is not None:
            tensors = [_as_tensor(inputs[f"score_input_{i}"]) for i in range(len(p.score_mod.inputs))]
            modifier = score_mod.forward_fn(p.score_mod, tensors)
            modifier_grad = score_mod.backward_fn(p.score_mod, tensors)
        return reference_math.ScoreTerms(
            scale=float(inputs["scale_tensor"]) if p.scale_tensor is not None else p.options.attn_scale,
            bias=bias,
            alibi=alibi,
            allowed=allowed,
            keep=keep,
            dropout_p=p.options.dropout_p,
            sink=_as_tensor(inputs["sink_token"]).to(dt) if p.sink_token else None,
            modifier=modifier,
            modifier_grad=modifier_grad,
        )

    # ---- dense to outputs --------------------------------------------------------------

    def _write(self, out: torch.Tensor, dense: torch.Tensor, inputs: RunInputs, role: str) -> None:
        p = self.problem
        lengths = sequence_lengths(role)
        if role in p.offset_tensors:  # the caller's ragged offsets: each sequence's real rows only
            ragged.scatter_rows(
                out, dense, _as_tensor(inputs[offset_role(role)]), _lengths_or_none(inputs, lengths), getattr(p, role)
            )
        elif p.is_thd and role != "stats":
            out.copy_(pack_thd(dense, _as_tensor(inputs[lengths]), out.shape[0]))
        else:
            out.copy_(dense)


def _as_tensor(value: torch.Tensor | int) -> torch.Tensor:
    assert isinstance(value, torch.Tensor), "the graph passes tensors for tensor roles"
    return value


def _lengths_or_none(inputs: RunInputs, role: str) -> torch.Tensor | None:
    value = inputs.get(role)
    return value if isinstance(value, torch.Tensor) else None


# ---- layout conversions ------------------------------------------------------------------


def sequence_offsets(lengths: torch.Tensor) -> list[int]:
    """Exclusive prefix sum: where each packed sequence starts."""
    values = lengths.reshape(-1).to("cpu", torch.int64).tolist()
    offsets, running = [], 0
    for n in values:
        offsets.append(running)
        running += n
    return offsets


def unpack_thd(packed: torch.Tensor, lengths: torch.Tensor, s_max: int) -> torch.Tensor:
    """[T, H, D] packed tokens -> [B, H, S_max, D], zero past each sequence's end."""
    counts = lengths.reshape(-1).to("cpu", torch.int64).tolist()
    out = packed.new_zeros(len(counts), packed.shape[1], s_max, packed.shape[2])
    for b, (start, n) in enumerate(zip(sequence_offsets(lengths), counts)):
        out[b, :, :n] = packed[start : start + n].transpose(0, 1)
    return out


def pack_thd(dense: torch.Tensor, lengths: torch.Tensor, tokens: int) -> torch.Tensor:
    """[B, H, S_max, D] -> [T, H, D] packed tokens (tokens past the last sequence are 0)."""
    counts = lengths.reshape(-1).to("cpu", torch.int64).tolist()
    out = dense.new_zeros(tokens, dense.shape[1], dense.shape[3])
    for b, (start, n) in enumerate(zip(sequence_offsets(lengths), counts)):
        out[start : start + n] = dense[b, :, :n].transpose(0, 1)
    return out


def gather_pages(
    cache: torch.Tensor, table: torch.Tensor | int, layout: KVCacheLayout | None, s_kv: int
) -> torch.Tensor:
    """A paged cache and its page table -> dense [B, H_kv, S_kv, D]. Indices are clamped into
    the cache, as a GPU clamps them: the slots past a sequence's length may hold padding (-1, a
    page past the cache), and the pages it does read were checked where the values were at hand."""
    table = _as_tensor(table)
    table = table.reshape(table.shape[0], -1).to(device=cache.device, dtype=torch.int64)
    table = table.clamp(0, cache.shape[0] - 1)
    pages = cache[table]  # [B, n, P, H, D] (NPHD) or [B, n, H, P, D] (NHPD)
    if layout is KVCacheLayout.NHPD:
        pages = pages.transpose(2, 3)  # -> [B, n, P, H, D]
    b, n, page_size, h, d = pages.shape
    tokens = pages.reshape(b, n * page_size, h, d)[:, :s_kv]
    return tokens.transpose(1, 2)
