"""``cudnn_attn.varlen_sdpa``: packed variable-length batches (FlashAttention's varlen interface).

Sequences of different lengths are packed back to back, ``q`` ``[T_q, H, D]`` and ``k``/``v``
``[T_k, H_kv, D]``, with ``cu_seqlens_*`` (``[B + 1]``, from 0) marking where each starts::

    out = cudnn_attn.varlen_sdpa(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=True)

The signature is FlashAttention's ``flash_attn_varlen_func`` (its positional order, ``causal``,
``softmax_scale``, ``softcap``, ``deterministic``, ``return_attn_probs``) with torch's keywords
beside it (``core/varlen_keywords.py`` resolves the two spellings); fewer K/V heads than query
heads is grouped-query attention, as in FlashAttention. ``return_lse=True`` also returns the
log-sum-exp per token, ``[H, T_q]`` float32 (``lse_by_token``).

No padding is computed: cuDNN's ragged (THD) attention skips it, which is where a mixed-length
batch gains over padded attention. ``is_causal`` aligns the causal mask top-left per sequence
(query i sees keys 0..i of its own sequence); FlashAttention's ``causal`` aligns it bottom-right
(query i of L sees keys 0..i + S - L), the same mask wherever L = S. ``window_size=(left, right)``
keeps keys ``i + S - L - left .. i + S - L + right`` (-1: no bound), measured from the bottom-right
diagonal as FlashAttention's, causal or not; beside torch's ``is_causal`` it measures from the
top-left diagonal (keys ``i - left .. i``).

Plans: a ragged plan depends on the number of sequences and on the longest length, not on
the packing. Both are rounded up to buckets (powers of two; missing sequences are empty), so a
training run with a new packing every step builds a handful of plans, not one per step.

Bad ``cu_seqlens`` are refused with a ``ValidationError`` when they are on the CPU. On a GPU
checking their values would cost a host sync on every call: there the plan clamps each length
into ``[0, max_seqlen]`` and cuts sequences at the packed tensors' end on the device, so bad
values give wrong rows for the sequences they describe, never an access out of bounds.
Output rows past ``cu_seqlens_q[-1]`` (and gradient rows no sequence covers) are zero.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .core import varlen_keywords
from .core.constructors import backward_problem, forward_problem
from .core.derived import derived
from .core.mask import Causal, ScoreOptions, default_scale
from .core.problem import AttentionProblem, TensorSpec
from .core.score_inputs import check_sinks, sink_token
from .core.score_mod import ScoreModifier
from .core.softcap import softcap_modifier
from .core.varlen_checks import check_call
from .errors import ShapeMismatchError, UnsupportedError, ValidationError
from .runtime import backend_choice
from .runtime.interop import in_layout_of
from .runtime.keyed import KeyedCache
from .runtime.prepared import PreparedRun, prepare
from .runtime.training import differentiable

SMALLEST_BUCKET = 16
MAX_RUNS = 512
_runs = KeyedCache(MAX_RUNS)  # by the problem a plan is built for (see _prepared)


def varlen_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    *,
    is_causal: bool | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
) -> Any:  # the output, or a tuple with return_lse/return_attn_probs (as FlashAttention's)
    """Attention over packed variable-length sequences, differentiable; FlashAttention's
    ``flash_attn_varlen_func`` signature (positional order and keywords) and torch's keywords.

    Args:
        q: ``[T_q, H, D]`` fp16/bf16, the sequences' queries back to back.
        k: ``[T_k, H_kv, D]``. ``H_kv`` must divide ``H``: fewer K/V heads is grouped-query
            attention (GQA/MQA), inferred as FlashAttention does (query head ``h`` reads K/V head
            ``h // (H / H_kv)``); ``enable_gqa`` is accepted, not needed.
        v: ``[T_k, H_kv, D_v]``.
        cu_seqlens_q: int32 ``[B + 1]``, where each query sequence starts (from 0).
        cu_seqlens_k: int32 ``[B + 1]``, where each key sequence starts (from 0).
        max_seqlen_q: the longest query sequence (an int).
        max_seqlen_k: the longest key sequence (an int).
        dropout_p: attention dropout probability (training).
        softmax_scale: the scores' scale, FlashAttention's name; None: ``1 / sqrt(D)``.
        scale: torch's name for ``softmax_scale`` (give one, or both with one value).
        causal: FlashAttention's causal mask, aligned bottom-right per sequence (query ``i`` of
            a sequence with ``L`` queries and ``S`` keys sees keys ``0 .. i + S - L``).
        is_causal: torch's causal mask, aligned top-left (keys ``0 .. i``). The two are the same
            wherever a sequence has as many queries as keys; give one of them.
        window_size: ``(left, right)``: query ``i`` of a sequence with ``L`` queries and ``S``
            keys keeps keys ``i + S - L - left .. i + S - L + right``, FlashAttention's
            bottom-right band, whether or not ``causal`` is given (any negative: no bound on that side; a
            right bound of 0 is causal, and ``causal=True`` sets it to 0). Beside ``is_causal``
            the band is measured from the top-left diagonal (``i - left .. i``).
        softcap: logit soft-capping, scores ``cap * tanh(s / cap)`` (Gemma-2's); None or 0.0: off.
            On cuDNN 9.19 with causal self-attention only (``cu_seqlens_q is cu_seqlens_k``): it
            applies no sequence-length mask beside a score modifier and misreads one's
            per-sequence tensors, so other calls are refused by name; the reference backend runs
            them.
        alibi_slopes: FlashAttention's per-head ALiBi slopes: ``UnsupportedError`` (cuDNN's ALiBi
            takes no slopes; ``Graph.sdpa(use_alibi_mask=True)`` has the standard ones).
        deterministic: a deterministic backward (cuDNN's deterministic algorithm; the forward
            is always deterministic).
        return_attn_probs: FlashAttention's flag: return ``(out, lse, None)``. The probabilities
            are not materialised (FlashAttention's are for testing only); ``None`` stands in.
        block_table: FlashAttention's paged K/V: ``UnsupportedError``, ``PagedAttention`` serves it.
        enable_gqa: torch's GQA flag, accepted; the head counts already say it.
        sinks: attention sinks, a logit per query head (``[H]``), learnable as in ``sdpa``.
        return_lse: return ``(out, lse)``.

    Returns:
        ``out`` ``[T_q, H, D_v]`` in q's dtype (rows past ``cu_seqlens_q[-1]`` are zero); with
        ``return_lse``/``return_attn_probs`` also ``lse``: float32 ``[H, T_q]``, the natural-log
        sum of ``exp(scale * q.k)`` over the keys each query sees (and its sink), as
        FlashAttention's varlen ``softmax_lse``; ``-inf`` where a query sees no key and for rows
        no sequence covers. ``lse`` is not differentiable (``lse.requires_grad`` is False):
        gradients flow through ``out``.

    Raises:
        ValidationError: malformed tensors, ``cu_seqlens``, flags, or an alias and its torch name
            given with different values (both named).
        UnsupportedError: what cuDNN cannot run (with the reason and what would work).

    Example:
        ```python
        import torch

        import cudnn_attn

        q = torch.randn(7, 4, 64, dtype=torch.bfloat16)  # two sequences: 3 and 4 tokens
        kv = torch.randn(7, 2, 64, dtype=torch.bfloat16)  # 2 K/V heads: GQA, inferred
        cu = torch.tensor([0, 3, 7], dtype=torch.int32)
        out, lse = cudnn_attn.varlen_sdpa(q, kv, kv, cu, cu, 4, 4, causal=True, return_lse=True)
        assert out.shape == (7, 4, 64) and lse.shape == (4, 7)  # lse: float32 [H, T_q]
        ```
    """
    call = varlen_keywords.resolve(
        causal=causal,
        is_causal=is_causal,
        softmax_scale=softmax_scale,
        scale=scale,
        window_size=window_size,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        deterministic=deterministic,
        return_attn_probs=return_attn_probs,
        return_lse=return_lse,
        block_table=block_table,
        same_lengths=varlen_keywords.same_lengths(cu_seqlens_q, cu_seqlens_k),
    )
    result = varlen_attention(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal=call.causal,
        window_left=call.window_left,
        window_right=call.window_right,
        window_bottom_right=call.window_bottom_right,
        scale=call.scale,
        dropout_p=dropout_p,
        enable_gqa=True,
        sinks=sinks,
        softcap=call.softcap,
        deterministic=call.deterministic,
        return_lse=call.returns > 1,
        context="varlen_sdpa",
    )
    if call.returns == 3:
        return (*result, None)
    return result


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: str | None = None,
    window_left: int | None = None,
    window_right: int | None = None,
    window_bottom_right: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    context: str = "varlen_attention",
) -> Any:
    """The varlen door the other doors share (nested tensors, transformers): ``causal`` is
    None, ``"top_left"`` or ``"bottom_right"`` (each sequence's last query row sees its last
    key, as decoding with a cache needs); ``window_left``: keys more than this many positions
    left of the diagonal are masked; ``window_right`` (without ``causal``): keys more than this
    many positions right of it are masked; ``window_bottom_right`` (without ``causal``): the
    diagonal is each sequence's bottom-right one (FlashAttention's), else its top-left one;
    ``deterministic``: cuDNN's deterministic backward. Returns
    ``out``, or ``(out, lse)`` with ``return_lse`` (``varlen_sdpa`` says what each holds)."""
    check_call(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal,
        window_left,
        window_right,
        dropout_p,
        enable_gqa,
        context,
    )
    q_rows = q.shape[0]
    if q_rows == 0 or k.shape[0] == 0:  # FlashAttention's: every sequence empty on that side
        q, k, v = (_padding_row_if_empty(t) for t in (q, k, v))
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)  # NumPy's ints too
    if not cu_seqlens_q.is_cuda:  # host lengths cost nothing to read: the tile spans the longest
        # sequence, not a generous max_seqlen (the reference's time grows with its square)
        max_seqlen_q = min(max_seqlen_q, _longest(cu_seqlens_q))
        max_seqlen_k = min(max_seqlen_k, _longest(cu_seqlens_k))
    bounded = window_left is not None or window_right is not None
    batch = cu_seqlens_q.shape[0] - 1
    slots = bucket(batch, 1)
    # Derived once per content of each cu_seqlens (every layer of a step passes the same ones).
    lengths_q, lengths_k = (derived(cu, _lengths, slots) for cu in (cu_seqlens_q, cu_seqlens_k))
    options = _Options(
        ScoreOptions(
            attn_scale=float(scale) if scale is not None else default_scale(q.shape[-1]),
            causal=Causal(causal or "none"),
            sliding_window=None if window_left is None else window_left + 1,
            padding=True,  # packed sequences are read through their lengths
            dropout_p=float(dropout_p),
            right_bound=window_right,
            bottom_right=bool(window_bottom_right) and causal is None and bounded,
        ),
        bucket(max_seqlen_q, SMALLEST_BUCKET),
        bucket(max_seqlen_k, SMALLEST_BUCKET),
        deterministic=bool(deterministic),
        lse=bool(return_lse),
    )
    if dropout_p > 0:
        options.rng = (torch.randint(0, 2**62, (1,), dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    if sinks is not None:
        check_sinks(sinks, q.shape[1], q.device, context=context)
        if dropout_p:
            raise UnsupportedError(["dropout_p with sinks: not supported yet"], context=context)
    if softcap is not None:
        if dropout_p:
            raise UnsupportedError(["dropout_p with softcap: not supported yet"], context=context)
        offsets = None
        if options.scores.aligned_bottom_right:  # each sequence's diagonal: the modifier reads S_kv - S_q
            offsets = lengths_k - lengths_q
            options.score_inputs["score_input_0"] = offsets
        try:
            same = varlen_keywords.same_lengths(cu_seqlens_q, cu_seqlens_k)
            options.modifier, options.scores = softcap_modifier(
                softcap,
                options.scores,
                options.max_q,
                options.max_k,
                same,
                None if offsets is None else TensorSpec.of(offsets),
            )
        except ValidationError as error:
            raise ValidationError(error.problems, context=context) from None
        except UnsupportedError as error:
            raise UnsupportedError(error.problems, context=context) from None
    # Read here: inside the autograd function grad mode is off, and its needs_input_grad says
    # nothing of it (a call under no_grad needs no stats and no backward).
    options.train = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks))
    try:
        found = differentiable(_VarlenCall(options, sinks), q, k, v, lengths_q, lengths_k, sinks, cu_seqlens_q)
    except (ValidationError, UnsupportedError, ShapeMismatchError) as error:
        raise error.renamed(_NAMES, context=context) from None
    if q.shape[0] == q_rows:
        return found
    return (found[0][:q_rows], found[1][:, :q_rows]) if isinstance(found, tuple) else found[:q_rows]


def _padding_row_if_empty(t: torch.Tensor) -> torch.Tensor:
    """``t`` with one zero row where it holds no token: a padding row past the last sequence,
    read by none, so that a batch with no query or no key tokens runs (its outputs and LSE are
    cut back to the real rows)."""
    return torch.cat([t, t.new_zeros(1, *t.shape[1:])]) if t.shape[0] == 0 else t


_NAMES = {
    "seq_len_q": "cu_seqlens_q",
    "seq_len_kv": "cu_seqlens_k",
    "use_padding_mask": "cu_seqlens_q/cu_seqlens_k",
    "sink_token": "sinks",
    "score_mod": "softcap",
    "max_seq_len_q": "max_seqlen_q",
    "max_seq_len_kv": "max_seqlen_k",
    "sliding_window_length": "window_size",
    "dropout": "dropout_p",
    "attn_scale": "scale",
}


class _Options:
    """A call's score options, its bucketed maximum lengths, its dropout seed and offset, whether
    its backward is deterministic and whether it returns the log-sum-exp."""

    def __init__(self, scores: ScoreOptions, max_q: int, max_k: int, deterministic: bool = False, lse: bool = False):
        self.scores, self.max_q, self.max_k = scores, max_q, max_k
        self.deterministic, self.lse = deterministic, lse
        self.train = False  # whether the call needs gradients (its stats and backward)
        self.rng: tuple[torch.Tensor, torch.Tensor] | None = None
        self.modifier: ScoreModifier | None = None  # softcap's, holding the causal mask and window
        self.score_inputs: dict[str, torch.Tensor] = {}  # the modifier's inputs, by role

    def inputs(self, **tensors: torch.Tensor | None) -> dict[str, torch.Tensor]:
        tensors.update(self.score_inputs)
        if self.rng is not None:
            tensors.update(dropout_seed=self.rng[0], dropout_offset=self.rng[1])
        return {role: t for role, t in tensors.items() if t is not None}

    def rng_specs(self) -> tuple[TensorSpec | None, TensorSpec | None]:
        if self.rng is None:
            return None, None
        return TensorSpec.of(self.rng[0]), TensorSpec.of(self.rng[1])


_backward_prepared: weakref.WeakSet[PreparedRun] = weakref.WeakSet()  # forward runs whose backward is prepared


class _VarlenCall:
    """One packed call as the training seam runs it (``runtime/training.py``): inputs
    ``(q, k, v, lengths_q, lengths_k, sinks, cu_seqlens_q)``, outputs ``out`` (and the LSE by
    token, no gradient through it, with ``options.lse``)."""

    def __init__(self, options: _Options, sinks: torch.Tensor | None):
        self.options = options
        self.sink_meta = None if sinks is None else (sinks.shape, sinks.dtype)
        self.non_differentiable: tuple[int, ...] = (1,) if options.lse else ()

    def forward(self, inputs: tuple) -> tuple[tuple[torch.Tensor, ...], tuple, None]:
        q, k, v, lengths_q, lengths_k, sinks, cu_seqlens_q = inputs
        options = self.options
        train = options.train
        sink = sink_token(sinks, q)
        run = _forward_run(q, k, v, lengths_q, lengths_k, options, train or options.lse, sink)
        out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)  # every row written
        outputs = run.run(
            options.inputs(q=q, k=k, v=v, seq_len_q=lengths_q, seq_len_kv=lengths_k, sink_token=sink), {"o": out}
        )
        if train and run not in _backward_prepared:
            # The backward's plan, prepared with the forward's first run of a geometry: what it
            # cannot run is refused here, not after a forward the caller has built on.
            _backward_run(q, k, v, out, out, outputs["stats"], lengths_q, lengths_k, options, sink)
            _backward_prepared.add(run)
        saved = (q, k, v, out, outputs["stats"], lengths_q, lengths_k, sink) if train else ()
        if not options.lse:
            return (out,), saved, None
        return (out, lse_by_token(outputs["stats"], cu_seqlens_q, q.shape[0])), saved, None

    def backward(self, saved: tuple, state: None, grads: tuple, needs: tuple[bool, ...]) -> tuple:
        q, k, v, out, stats, lengths_q, lengths_k, sink = saved
        d_out = in_layout_of(grads[0], out)
        run = _backward_run(q, k, v, out, d_out, stats, lengths_q, lengths_k, self.options, sink)
        found = {
            role: torch.zeros_like(t) for role, t in zip(("grad_q", "grad_k", "grad_v"), (q, k, v))
        }  # rows no sequence covers stay zero
        inputs = self.options.inputs(
            q=q, k=k, v=v, o=out, grad_o=d_out, stats=stats, seq_len_q=lengths_q, seq_len_kv=lengths_k, sink_token=sink
        )
        written = run.run(inputs, found)
        meta = self.sink_meta
        d_sink = None if meta is None else written["grad_sink"].reshape(meta[0]).to(meta[1])
        return (*found.values(), None, None, d_sink, None)


def _spec(t: torch.Tensor) -> TensorSpec:
    return TensorSpec.of(t)


def _forward_run(q, k, v, lengths_q, lengths_k, options: _Options, train: bool, sink=None) -> PreparedRun:
    problem = forward_problem(
        _spec(q),
        _spec(k),
        _spec(v),
        options.scores,
        stats=train,
        seq_len_q=_spec(lengths_q),
        seq_len_kv=_spec(lengths_k),
        max_seq_len_q=options.max_q,
        max_seq_len_kv=options.max_k,
        dropout_seed=options.rng_specs()[0],
        dropout_offset=options.rng_specs()[1],
        sink_token=None if sink is None else _spec(sink),
        score_mod=options.modifier,
    )
    return _prepared(problem, lengths_q, lengths_k)


def _backward_run(q, k, v, out, d_out, stats, lengths_q, lengths_k, options: _Options, sink=None) -> PreparedRun:
    problem = backward_problem(
        _spec(q),
        _spec(k),
        _spec(v),
        _spec(out),
        _spec(d_out),
        _spec(stats),
        options.scores,
        seq_len_q=_spec(lengths_q),
        seq_len_kv=_spec(lengths_k),
        max_seq_len_q=options.max_q,
        max_seq_len_kv=options.max_k,
        dropout_seed=options.rng_specs()[0],
        dropout_offset=options.rng_specs()[1],
        sink_token=None if sink is None else _spec(sink),
        score_mod=options.modifier,
        deterministic=options.deterministic,
    )
    return _prepared(problem, lengths_q, lengths_k)


def _prepared(problem: AttentionProblem, lengths_q: torch.Tensor, lengths_k: torch.Tensor) -> PreparedRun:
    """The run of ``problem``'s plan, kept by the problem the plan is built for: one run serves
    every packing of a geometry (the plan reads the token counts from its inputs). The lengths'
    values are checked when a geometry is first prepared, as a graph's build checks them; later
    calls on a GPU are clamped on the device instead (see the module's docstring)."""
    key = (problem.for_plan(), backend_choice.chosen())
    run = _runs.get(key)
    if run is None:
        run = _runs.put(key, prepare(problem, values={"seq_len_q": lengths_q, "seq_len_kv": lengths_k}))
    return run


def lse_by_token(stats: torch.Tensor, cu_seqlens_q: torch.Tensor, tokens: int) -> torch.Tensor:
    """The packed tokens' log-sum-exp, float32 ``[H, tokens]`` (FlashAttention's varlen layout),
    from the plan's padded stats ``[slots, H, S_max, 1]``: token ``t`` of sequence ``b`` is row
    ``t - cu_seqlens_q[b]``. Tokens no sequence covers get -inf. No host sync: the indices are
    made on the device and clamped into the stats."""
    cu = cu_seqlens_q.to(torch.int64)
    batch = cu.shape[0] - 1
    token = torch.arange(tokens, device=stats.device)
    seq = torch.searchsorted(cu[1:], token, right=True)  # the sequence holding each token
    covered = (seq < batch) & (token >= cu[0])
    seq = seq.clamp(max=batch - 1)
    row = (token - cu[seq]).clamp(0, stats.shape[2] - 1)
    lse = stats[seq, :, row, 0]  # [tokens, H]
    return torch.where(covered.unsqueeze(1), lse, float("-inf")).t().contiguous()


def _longest(cu_seqlens: torch.Tensor) -> int:
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def _lengths(cu_seqlens: torch.Tensor, slots: int) -> torch.Tensor:
    """Each sequence's length (int32 ``[slots, 1, 1, 1]``), empty sequences after the last."""
    lengths = torch.zeros(slots, 1, 1, 1, dtype=torch.int32, device=cu_seqlens.device)
    lengths.view(-1)[: cu_seqlens.shape[0] - 1].copy_(cu_seqlens[1:] - cu_seqlens[:-1])
    return lengths


def bucket(n: int, smallest: int = SMALLEST_BUCKET) -> int:
    """The power of two at or above ``n`` (at least ``smallest``): a plan serves every packing
    whose counts fall in its bucket (context parallelism's packed calls bucket the same way)."""
    return max(smallest, 1 << (max(n, 1) - 1).bit_length())
