"""cuDNN's FP8 scaled-dot-product attention, forward and backward, in plain PyTorch.

The emulation oracle for ``sdpa_fp8`` / ``sdpa_fp8_backward``: dense ``[B, H, S, D]`` tensors,
query rows in blocks (``math.row_blocks``), intermediates in float32 (or float64).
Every fp8 tensor is used as its raw (scaled) values; each matmul result is descaled after the
matmul, each fp8 result is made as ``quantise(x * scale)``, and each amax is taken in float32
*before* that scale, exactly as cuDNN's graph places its nodes.

Forward (``scale``/``descale`` are float32 [1, 1, 1, 1]; ``@`` on raw fp8 values)::

    S      = (Q @ K^T) * attn_scale * descale_q * descale_k
    S      = fn(S)  (+ bias), masked entries -> -inf    (fn: the score modifier, if any)
    P      = softmax(S);  stats = max + log(sum exp)  (natural log, float32 [B, H, S_q, 1];
             a sink is one more term of the sum, weighing no value)
    P      = P * keep / (1 - p)                     (dropout, if any)
    amax_S = max|P|                                 (before scale_s)
    P8     = quantise(P * scale_s)                  (to Q's fp8 dtype)
    O      = (P8 @ V) * descale_s * descale_v
    amax_O = max|O|                                 (before scale_o)
    O_out  = quantise(O * scale_o)                  (O's dtype: e4m3, e5m2; fp16/bf16 on Blackwell)

Backward (P recomputed from the forward's stats, not renormalised)::

    D      = rowsum(dO * O) * descale_dO * descale_O        (raw fp8 dO and O)
    S      = as above;  P = exp(S - stats);  Pd = P * keep / (1 - p)
    dV     = (quantise(Pd * scale_s)^T @ dO) * descale_s * descale_dO   (P8 in Q's dtype)
    dPd    = (dO @ V^T) * descale_dO * descale_v;  dP = dPd * keep / (1 - p)
    dS     = (dP - D) * P * attn_scale;  amax_dP = max|dS|   ("dP" in cuDNN's naming)
    dS8    = quantise(dS * scale_dP)                          (to dO's fp8 dtype)
    dQ     = (dS8 @ K) * descale_dP * descale_k
    dK     = (dS8^T @ Q) * descale_dP * descale_q              (summed over a GQA group)
    amax_dX = max|dX| (after the GQA sum, before scale);  dX_out = quantise(dX * scale_dX)
    dSink  = -sum over batch and rows of exp(sink - stats) * D   (``core.sink_fold.sink_gradient``)

``quantise`` rounds to nearest even and saturates to the largest finite value (448 for
e4m3, 57344 for e5m2; NaN stays NaN): on the GPU every f32 -> fp8 conversion is a PTX
``cvt.rn.satfinite`` (``.satfinite`` is mandatory for fp8 destinations).

Sources (read, not guessed):

- cudnn-frontend ``include/cudnn_frontend/node/scaled_dot_product_flash_attention.h``
  (``CompositeSDPANode::expand_node``: bmm1, attn_scale, descale_q, descale_k, bias, masks,
  softmax with Stats, dropout, ``amax_s``, ``scale_s``, cast to Q's dtype, ``matmul_fp8``),
  ``node/matmul_fp8.h`` (matmul, GQA sum, descale_a, descale_b, amax, scale_c),
  ``node/sdpa_fp8_bwd.h`` (``SDPAFP8BackwardNode``: the backward above; dS is cast to dO's
  dtype), ``node/sdpa_support_surface.h`` (FP8: no bias, fp16/bf16 O only on Blackwell with
  cuDNN >= 9.13), ``docs/operations/Attention.md`` (v1.10, "Scaled Dot Product Attention FP8"),
  ``test/python/sdpa/fp8_ref.py`` (NVIDIA's own reference; its forward quantises per block of
  128 keys the *unnormalised* exp(S - running max): ``online_block`` below).
- TransformerEngine ``transformer_engine/common/fused_attn/fused_attn_fp8.cu`` (fp16/bf16 O and
  dQKV use scale 1 and descale_O 1) and ``pytorch/attention/dot_product_attention/backends.py``
  (``FP8EmulationFunc``: the softmax output, after dropout, is what is quantised).

Fully masked rows follow the library's convention (docs/semantics.md): O = 0, stats = -inf,
zero gradients. cuDNN rejects a bias with FP8; it is kept here because the math is the same.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .math import BlockTerms, ScoreTerms, _expand_kv, _reduce_groups, row_blocks, warm_exp

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FP8_DTYPES = tuple(FP8_MAX)

Scale = torch.Tensor | float


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 format."""
    if dtype not in FP8_MAX:
        raise ValueError(f"{dtype} is not an fp8 format ({', '.join(map(str, FP8_DTYPES))})")
    return FP8_MAX[dtype]


def quantise(x: torch.Tensor, scale: Scale, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` in ``dtype``: fp8 rounds to nearest even and saturates to +-max finite
    (NaN stays NaN), as cuDNN's ``cvt.rn.satfinite`` does; other dtypes are a plain cast."""
    y = x * _scalar(scale, x)
    if dtype in FP8_MAX:
        limit = FP8_MAX[dtype]
        y = y.clamp(-limit, limit)  # torch's own cast overflows to inf/NaN on some versions
    return y.to(dtype)


def dequantise(x: torch.Tensor, descale: Scale, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x * descale`` in ``dtype`` (the fp8 values are exact there)."""
    y = x.to(dtype)
    return y * _scalar(descale, y)


def forward_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    descale_q: Scale,
    descale_k: Scale,
    descale_v: Scale,
    descale_s: Scale,
    scale_s: Scale,
    scale_o: Scale,
    *,
    attn_scale: float | None = None,
    bias: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    terms: ScoreTerms | None = None,
    out_dtype: torch.dtype | None = None,
    p_dtype: torch.dtype | None = None,
    compute_dtype: torch.dtype = torch.float32,
    online_block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """cuDNN's ``sdpa_fp8``. Returns ``(O, stats, amax_s, amax_o)``: O in ``out_dtype``,
    stats ``[B, H, S_q, 1]`` and the amaxes ``[1, 1, 1, 1]`` in ``compute_dtype``.

    q, k, v hold fp8 values (fp8 tensors, or any float tensor holding them); K/V heads may
    divide Q's (GQA). The score terms are either ``terms`` (a ``math.ScoreTerms``:
    masks and ALiBi made per block of rows) or ``attn_scale`` (default 1), ``bias``,
    ``allowed`` (bool, broadcastable to [B, H, S_q, S_kv], False = masked), ``keep`` (dropout
    keep-mask [B, H, S_q, S_kv]) and ``dropout_p``. ``p_dtype`` (P's fp8 format) defaults to
    q's dtype, ``out_dtype`` to ``p_dtype``. ``online_block`` (e.g. 128) quantises instead, per
    block of that many keys, ``exp(S - running row max)`` and normalises O at the end, as
    cudnn-frontend's test reference models the flash kernel (rescale threshold 0); stats and
    amax_S stay the graph's. attn_scale and every scale are taken as float32, as cuDNN holds them.
    """
    ct = compute_dtype
    warm_exp(ct, q.device)
    p_dtype = _fp8_dtype(p_dtype, q, "p_dtype")
    out_dtype = p_dtype if out_dtype is None else out_dtype
    terms = _score_terms(terms, attn_scale, bias, allowed, keep, dropout_p)
    b, heads, s_q, _ = q.shape
    qf = q.to(ct)
    kf, vf = _expand_kv(k.to(ct), heads), _expand_kv(v.to(ct), heads)
    sc = _Scalars(
        qf,
        attn_scale=terms.scale,
        descale_q=descale_q,
        descale_k=descale_k,
        descale_v=descale_v,
        descale_s=descale_s,
        scale_s=scale_s,
        scale_o=scale_o,
    )
    o = torch.empty(b, heads, s_q, vf.shape[-1], dtype=out_dtype, device=q.device)
    stats = torch.empty(b, heads, s_q, 1, dtype=ct, device=q.device)
    amax_s = torch.zeros((), dtype=ct, device=q.device)
    amax_o = torch.zeros((), dtype=ct, device=q.device)
    for rows in row_blocks(s_q, b * heads * kf.shape[2]):
        block = slice(rows.start, rows.stop)
        part = terms.block(rows)
        s = _scores(qf[:, :, block], kf, part, sc)
        p, lse = _softmax(s, terms.sink)
        p_d = _dropped(p, part.keep, sc.dropout_scale(part))
        amax_s = torch.maximum(amax_s, _amax(p_d))
        if online_block is None:
            p8 = quantise(p_d, sc.scale_s, p_dtype).to(ct)
            o_part = torch.matmul(p8, vf) * sc.descale_s * sc.descale_v
        else:
            o_part = _online_output(s, part, vf, sc, p_dtype, online_block, terms.sink)
        amax_o = torch.maximum(amax_o, _amax(o_part))
        o[:, :, block] = quantise(o_part, sc.scale_o, out_dtype)
        stats[:, :, block] = lse
    return o, stats, amax_s.reshape(1, 1, 1, 1), amax_o.reshape(1, 1, 1, 1)


def backward_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    d_o: torch.Tensor,
    stats: torch.Tensor,
    descale_q: Scale,
    descale_k: Scale,
    descale_v: Scale,
    descale_o: Scale,
    descale_do: Scale,
    descale_s: Scale,
    descale_dp: Scale,
    scale_s: Scale,
    scale_dq: Scale,
    scale_dk: Scale,
    scale_dv: Scale,
    scale_dp: Scale,
    *,
    attn_scale: float | None = None,
    bias: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    terms: ScoreTerms | None = None,
    grad_dtype: torch.dtype | None = None,
    p_dtype: torch.dtype | None = None,
    ds_dtype: torch.dtype | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """cuDNN's ``sdpa_fp8_backward``. Returns ``(dQ, dK, dV, amax_dQ, amax_dK, amax_dV, amax_dP)``:
    gradients in ``grad_dtype`` (default ``p_dtype``), amaxes ``[1, 1, 1, 1]`` in ``compute_dtype``.

    o is the forward's output as stored (fp8 with its descale_o; fp16/bf16 with descale_o 1),
    d_o the fp8 output gradient, stats the forward's. ``p_dtype`` (P's fp8 format) defaults to
    q's dtype, ``ds_dtype`` (dS's, cuDNN's "dP") to d_o's. Score terms as in ``forward_fp8``.
    dK, dV are summed over each GQA group before their amax and scale.
    """
    ct = compute_dtype
    warm_exp(ct, q.device)
    p_dtype = _fp8_dtype(p_dtype, q, "p_dtype")
    ds_dtype = _fp8_dtype(ds_dtype, d_o, "ds_dtype")
    grad_dtype = p_dtype if grad_dtype is None else grad_dtype
    terms = _score_terms(terms, attn_scale, bias, allowed, keep, dropout_p)
    b, heads, s_q, _ = q.shape
    kv_heads_k, kv_heads_v = k.shape[1], v.shape[1]
    qf, dof = q.to(ct), d_o.to(ct)
    kf, vf = _expand_kv(k.to(ct), heads), _expand_kv(v.to(ct), heads)
    sc = _Scalars(
        qf,
        attn_scale=terms.scale,
        descale_q=descale_q,
        descale_k=descale_k,
        descale_v=descale_v,
        descale_o=descale_o,
        descale_do=descale_do,
        descale_s=descale_s,
        descale_dp=descale_dp,
        scale_s=scale_s,
        scale_dq=scale_dq,
        scale_dk=scale_dk,
        scale_dv=scale_dv,
        scale_dp=scale_dp,
    )
    delta = (dof * o.to(ct)).sum(-1, keepdim=True) * sc.descale_do * sc.descale_o
    lse_all = stats.to(ct)
    d_q = torch.empty(q.shape, dtype=grad_dtype, device=q.device)
    d_k = torch.zeros(kf.shape, dtype=ct, device=q.device)  # raw dS8^T @ Q, per query head
    d_v = torch.zeros(vf.shape, dtype=ct, device=q.device)  # raw P8^T @ dO, per query head
    amax_dq = torch.zeros((), dtype=ct, device=q.device)
    amax_dp = torch.zeros((), dtype=ct, device=q.device)
    for rows in row_blocks(s_q, b * heads * kf.shape[2]):
        block = slice(rows.start, rows.stop)
        part = terms.block(rows)
        drop = sc.dropout_scale(part)
        s = _scores(qf[:, :, block], kf, part, sc)
        lse = lse_all[:, :, block]
        # P from the forward's stats, as fused kernels do; masked and empty rows give 0.
        p = torch.exp(s - torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse))
        p = torch.where(torch.isneginf(s), torch.zeros_like(p), p)
        p8 = quantise(_dropped(p, part.keep, drop), sc.scale_s, p_dtype).to(ct)
        d_v += torch.matmul(p8.transpose(-1, -2), dof[:, :, block])
        d_p = torch.matmul(dof[:, :, block], vf.transpose(-1, -2)) * sc.descale_do * sc.descale_v
        d_s = (_dropped(d_p, part.keep, drop) - delta[:, :, block]) * p * sc.attn_scale
        amax_dp = torch.maximum(amax_dp, _amax(d_s))
        ds8 = quantise(d_s, sc.scale_dp, ds_dtype).to(ct)
        dq_part = torch.matmul(ds8, kf) * sc.descale_dp * sc.descale_k
        amax_dq = torch.maximum(amax_dq, _amax(dq_part))
        d_q[:, :, block] = quantise(dq_part, sc.scale_dq, grad_dtype)
        d_k += torch.matmul(ds8.transpose(-1, -2), qf[:, :, block])
    dk_full = _reduce_groups(d_k, kv_heads_k) * sc.descale_dp * sc.descale_q
    dv_full = _reduce_groups(d_v, kv_heads_v) * sc.descale_s * sc.descale_do
    return (
        d_q,
        quantise(dk_full, sc.scale_dk, grad_dtype),
        quantise(dv_full, sc.scale_dv, grad_dtype),
        amax_dq.reshape(1, 1, 1, 1),
        _amax(dk_full).reshape(1, 1, 1, 1),
        _amax(dv_full).reshape(1, 1, 1, 1),
        amax_dp.reshape(1, 1, 1, 1),
    )


# ---- helpers ------------------------------------------------------------------------------


def _scalar(value: Scale, like: torch.Tensor) -> torch.Tensor:
    """A scale as cuDNN holds it (float32, one element), as a 0-d tensor of ``like``'s dtype."""
    t = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if t.numel() != 1:
        raise ValueError(f"a scale must have one element, got shape {tuple(t.shape)}")
    return t.reshape(()).to(like.dtype)


class _Scalars:
    """The named scales and descales of one call, as 0-d tensors in the compute dtype."""

    def __init__(self, like: torch.Tensor, **values: Scale):
        self._like = like
        for name, value in values.items():
            setattr(self, name, _scalar(value, like))

    def __getattr__(self, name: str) -> torch.Tensor:  # only for names not set: a bug
        raise AttributeError(f"no scale named {name!r}")

    def dropout_scale(self, part: BlockTerms) -> torch.Tensor | None:
        if part.keep is None or part.dropout_p == 0.0:
            return None
        return _scalar(1.0 / (1.0 - part.dropout_p), self._like)  # float32, as cuDNN's node


def _fp8_dtype(given: torch.dtype | None, tensor: torch.Tensor, name: str) -> torch.dtype:
    dtype = tensor.dtype if given is None else given
    if dtype not in FP8_MAX:
        raise ValueError(f"{name}: {dtype} is not an fp8 format; pass {name}= when the input is not fp8")
    return dtype


def _score_terms(
    terms: ScoreTerms | None,
    attn_scale: float | None,
    bias: torch.Tensor | None,
    allowed: torch.Tensor | None,
    keep: torch.Tensor | None,
    dropout_p: float,
) -> ScoreTerms:
    if terms is not None:
        if attn_scale is not None or bias is not None or allowed is not None or keep is not None or dropout_p:
            raise ValueError("pass either terms= or attn_scale/bias/allowed/keep/dropout_p, not both")
        return terms
    bias4 = None if bias is None else _as_4d(bias)
    allowed4 = None if allowed is None else _as_4d(allowed)
    return ScoreTerms(
        scale=1.0 if attn_scale is None else float(attn_scale),
        bias=bias4,
        allowed=None if allowed4 is None else _row_slicer(allowed4),
        keep=keep,
        dropout_p=dropout_p,
    )


def _as_4d(x: torch.Tensor) -> torch.Tensor:
    if x.dim() > 4:
        raise ValueError(f"expected at most 4 dims, got shape {tuple(x.shape)}")
    return x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))


def _row_slicer(mask: torch.Tensor) -> Callable[[range], torch.Tensor]:
    def rows_of(rows: range) -> torch.Tensor:
        return mask if mask.shape[2] == 1 else mask[:, :, rows.start : rows.stop]

    return rows_of


def _scores(q: torch.Tensor, k: torch.Tensor, part: BlockTerms, sc: _Scalars) -> torch.Tensor:
    """(q @ k^T) * attn_scale * descale_q * descale_k, the modifier, + bias, masked entries -inf
    (graph order)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * sc.attn_scale * sc.descale_q * sc.descale_k
    if part.modifier is not None:
        s = torch.broadcast_to(part.modifier(s, part.rows), s.shape)
    if part.bias is not None:
        s = s + part.bias.to(s.dtype)
    if part.allowed is not None:
        s = s.masked_fill(~part.allowed, float("-inf"))
    return s


def _softmax(s: torch.Tensor, sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, stats = max + log(sum exp)); fully masked rows give P = 0 and stats = -inf (with a
    sink, one more score weighing no value: P = 0 and stats = the sink)."""
    row_max = s.amax(-1, keepdim=True)
    if sink is not None:
        row_max = torch.maximum(row_max, sink.to(s.dtype))
    empty = torch.isneginf(row_max)
    row_max = torch.where(empty, torch.zeros_like(row_max), row_max)
    e = torch.exp(s - row_max)
    row_sum = e.sum(-1, keepdim=True)
    if sink is not None:
        row_sum = row_sum + torch.exp(sink.to(s.dtype) - row_max)
    p = e / torch.where(empty, torch.ones_like(row_sum), row_sum)
    lse = torch.where(empty, torch.full_like(row_max, float("-inf")), row_max + torch.log(row_sum))
    return p, lse


def _dropped(x: torch.Tensor, keep: torch.Tensor | None, scale: torch.Tensor | None) -> torch.Tensor:
    return x if keep is None or scale is None else x * keep.to(x.dtype) * scale


def _amax(x: torch.Tensor) -> torch.Tensor:
    return x.abs().amax() if x.numel() else torch.zeros((), dtype=x.dtype, device=x.device)


def _online_output(
    s: torch.Tensor,
    part: BlockTerms,
    v: torch.Tensor,
    sc: _Scalars,
    p_dtype: torch.dtype,
    block: int,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """O of one block of rows the flash way: per block of keys, quantise exp(S - running max)
    (dropped), accumulate rescaled, divide by the running sum at the end (0 for empty rows). A
    sink starts the running max and sum (the frontend's reference does the same)."""
    if block < 1:
        raise ValueError(f"online_block must be positive, got {block}")
    drop = sc.dropout_scale(part)
    m = torch.full_like(s[..., :1], float("-inf"))
    total = torch.zeros_like(m)
    if sink is not None:
        m = torch.broadcast_to(sink.to(s.dtype), m.shape).clone()
        total = torch.where(torch.isneginf(m), total, torch.ones_like(total))
    acc = s.new_zeros(s.shape[:-1] + (v.shape[-1],))
    for start in range(0, s.shape[-1], block):
        cols = slice(start, min(start + block, s.shape[-1]))
        s_blk = s[..., cols]
        m_new = torch.maximum(m, s_blk.amax(-1, keepdim=True))
        finite = ~torch.isneginf(m_new)
        correction = torch.where(finite, torch.exp(m - torch.where(finite, m_new, torch.zeros_like(m_new))), 1.0)
        acc, total = acc * correction, total * correction
        p_blk = torch.exp(s_blk - torch.where(finite, m_new, torch.zeros_like(m_new)))
        total = total + p_blk.sum(-1, keepdim=True)
        keep = None if part.keep is None else part.keep[..., cols]
        p8 = quantise(_dropped(p_blk, keep, drop), sc.scale_s, p_dtype).to(s.dtype)
        acc = acc + torch.matmul(p8, v[..., cols, :]) * sc.descale_s * sc.descale_v
        m = m_new
    return acc / torch.where(total == 0, torch.ones_like(total), total)
