"""An attention sink folded into a result computed without it, from its log-sum-exp.

A sink is one more term of each softmax denominator that weighs no value (gpt-oss's learned
per-head logit), so a sink-less result ``O`` with log-sum-exp ``L`` becomes, exactly::

    L' = logaddexp(L, sink);   O' = O * exp(L - L')

A row that sees no key (``L = -inf``, ``O = 0``) keeps ``O = 0`` and gets ``L' = sink``, as the
reference backend gives. Where a kernel cannot take the sink itself (cuDNN's decode kernels,
paged decode after a split-KV merge), this runs after it: a few elementwise ops on the device,
no host sync, safe inside a CUDA graph.
"""

from __future__ import annotations

import torch


def add_sink(o: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> None:
    """Fold ``sink`` into ``o`` and ``lse``, in place. ``o``: ``[..., H, S, D]`` (any strides,
    any float dtype); ``lse``: float32 of ``o``'s shape with a last dim of 1; ``sink``: float32,
    broadcasting to ``lse`` (``[1, H, 1, 1]``)."""
    merged, weight = _folded(lse, sink)
    o.copy_(o.float() * weight)
    lse.copy_(merged)


def add_sink_fp8(outputs: dict[str, torch.Tensor], scale_o: torch.Tensor, sink: torch.Tensor) -> None:
    """The same for an FP8 attention's outputs (``o`` as stored, ``O * scale_o`` in FP8; ``stats``;
    ``amax_o``, ``amax_s`` where present), in place. O is re-quantised (round to nearest even, as
    every cast to FP8 on the GPU; the factor is at most 1, so nothing saturates); Amax_O becomes
    the folded O's before that rounding, Amax_S the sink-less one times the largest factor (an
    upper bound: the sink-less row maxima are not among the outputs)."""
    o, lse = outputs["o"], outputs["stats"]
    merged, weight = _folded(lse, sink)
    scaled = o.float() * weight
    o.copy_(scaled)
    if "amax_o" in outputs:
        outputs["amax_o"].copy_((scaled.abs().amax() / scale_o.float()).reshape(outputs["amax_o"].shape))
    if "amax_s" in outputs:
        outputs["amax_s"].mul_(weight.amax())
    lse.copy_(merged)


def sink_gradient(
    o: torch.Tensor, d_o: torch.Tensor, stats: torch.Tensor, sink: torch.Tensor, descale: torch.Tensor | float = 1.0
) -> torch.Tensor:
    """d loss / d sink, ``[1, H, 1, 1]`` in ``stats``' dtype: the sink's column of the softmax
    gradient. Its probability is ``exp(sink - stats)`` and it weighs no value, so its score's
    gradient is ``P_sink * (0 - D)``, ``D = rowsum(dO * O) * descale`` (FP8: descale_dO * descale_O;
    dropout is already inside O). Needs only the forward's O and stats: a backward run without
    the sink, given the stats that include it, makes dQ, dK, dV, and this makes the rest."""
    # exp(sink - L) <= 1 where L holds the sink; a row with no key and no sink (L = -inf) gives
    # +inf, set to 0: few launches, as this runs once per backward of every sink layer.
    p_sink = torch.exp(sink.to(stats.dtype) - stats).nan_to_num_(nan=float("nan"), posinf=0.0)
    if not (isinstance(descale, float) and descale == 1.0):
        p_sink = p_sink * (descale.reshape(()) if isinstance(descale, torch.Tensor) else descale)
    return weighted_row_dot(d_o, o, p_sink[..., 0]).neg_().view(1, -1, 1, 1)


# bf16 matrix products with a float32 result (``torch.bmm(..., out_dtype=)``): not in every torch >= 2.4
_BMM_TO_FLOAT32 = "dtype" in torch.ops.aten.bmm.overloads()


def weighted_row_dot(d_o: torch.Tensor, o: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``sum over batch and rows of weight * rowsum(dO * O)`` per head, ``[H]`` in ``weight``'s
    dtype; ``d_o``, ``o``: ``[B, H, S, D]`` (any strides), ``weight``: ``[B, H, S]``.

    bf16 on the GPU: the product in bf16 (each element rounded once, no float32 copies), then one
    batched matrix-vector product per head with the weights (rounded to bf16), accumulated in
    float32. Summing the product over D with torch's reduction instead reads at a tenth of the
    memory's speed (64-element rows): the whole took 0.39 ms against 0.15 at gpt-oss's B2 H64
    S8k d64 on an H200."""
    if d_o.dtype == o.dtype == torch.bfloat16 and d_o.is_cuda and weight.dtype == torch.float32 and _BMM_TO_FLOAT32:
        product = torch.mul(d_o, o)
        b, h, s, d = product.shape
        if product.stride(3) == 1 and (b == 1 or product.stride(0) == s * product.stride(2)):
            rows, w = product.transpose(0, 1).reshape(h, b * s, d), weight.transpose(0, 1).reshape(h, 1, b * s)
        elif product.stride(3) == 1 and product.stride(0) == h * product.stride(1):
            rows, w = product.view(b * h, s, d), weight.reshape(b * h, 1, s)
        else:  # no batch of [rows, D] matrices without a copy
            return (product.sum(-1, dtype=weight.dtype) * weight).sum((0, 2))
        per_column = torch.bmm(w.to(torch.bfloat16), rows, out_dtype=torch.float32)
        return per_column.view(-1, h, d).sum((0, 2))
    return (_row_dot(d_o, o, weight.dtype) * weight).sum((0, 2))


def packed_sink_gradient(
    o: torch.Tensor,
    d_o: torch.Tensor,
    stats: torch.Tensor,
    sink: torch.Tensor,
    starts: torch.Tensor,
    descale: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """``sink_gradient`` of packed rows: ``o``/``d_o`` ``[T, H, D]``, sequence b's rows from
    ``starts[b]`` (int64 ``[B + 1]``, the total last), its stats at ``stats[b, :, :len_b]`` of
    ``[B, H, max_q, 1]``. Per token, with no padded copy of O, dO or the stats."""
    tokens = o.shape[0]
    row = torch.arange(tokens, device=o.device)
    sequence = (torch.searchsorted(starts, row, right=True) - 1).clamp(0, stats.shape[0] - 1)
    position = (row - starts[sequence]).clamp(0, stats.shape[2] - 1)
    inside = row < starts[-1]  # rows past the last sequence belong to none
    lse = stats[sequence, :, position, 0]  # [T, H]
    lse = torch.where(inside[:, None], lse, float("-inf"))
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    p_sink = torch.where(torch.isneginf(lse), torch.zeros_like(lse), torch.exp(sink.to(stats.dtype).view(1, -1) - safe))
    if not (isinstance(descale, float) and descale == 1.0):
        p_sink = p_sink * (descale.reshape(()) if isinstance(descale, torch.Tensor) else descale)
    # [T, H, D] as one batch of T rows per head ([1, H, T, D])
    d_o_rows, o_rows = d_o.transpose(0, 1).unsqueeze(0), o.transpose(0, 1).unsqueeze(0)
    return weighted_row_dot(d_o_rows, o_rows, p_sink.transpose(0, 1).unsqueeze(0)).neg_().view(1, -1, 1, 1)


def _row_dot(d_o: torch.Tensor, o: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``rowsum(dO * O)`` in ``dtype``. bf16 operands multiply in bf16 (each product rounded
    once, no float32 copies of O and dO: a third of the bytes) and sum in ``dtype``; fp16 ones
    (a loss-scaled dO times O can pass fp16's range) and FP8 ones go through ``dtype``."""
    if d_o.dtype == o.dtype == torch.bfloat16:
        return torch.mul(d_o, o).sum(-1, dtype=dtype)
    return (d_o.to(dtype) * o.to(dtype)).sum(-1)


def _folded(lse: torch.Tensor, sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(L', exp(L - L')): 0 where the row sees no key (L = -inf), and where it sees neither key
    nor sink (L' = -inf too)."""
    merged = torch.logaddexp(lse, sink)
    weight = torch.where(torch.isneginf(merged), 0.0, torch.exp(lse - merged))
    return merged, weight
