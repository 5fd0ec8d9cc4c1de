"""The mask, scale, length and dropout keywords: one definition shared by every op.

``MaskKeywords`` lists the keywords as users give them (the cuDNN frontend's names and
spellings). ``parse_keywords`` turns them into ``ScoreOptions``, the typed group of problem
fields that says how scores are formed, plus the tensors the graph must bind as inputs.
Parsing never raises for bad input: each problem becomes one line of ``Parsed.errors``.

Ops take the keywords as ``**mask``; ``publishes_mask_keywords`` adds them to the op's
signature, so ``help(g.sdpa)`` and editors list every keyword.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ..core.finite import finite_real
from ..core.mask import MAX_LENGTH, Causal, ScoreOptions
from ..errors import shown
from .handles import TensorHandle


@dataclass(frozen=True)
class MaskKeywords:
    """Every mask/scale/length/dropout keyword an attention op accepts, as given."""

    attn_scale: Any = None
    use_causal_mask: Any = False
    use_causal_mask_bottom_right: Any = False
    sliding_window_length: Any = None
    diagonal_alignment: Any = None
    diagonal_band_left_bound: Any = None
    diagonal_band_right_bound: Any = None
    attn_bias: Any = None
    bias: Any = None  # the frontend's alias of attn_bias
    use_alibi_mask: Any = False
    use_padding_mask: Any = False
    seq_len_q: Any = None
    seq_len_kv: Any = None
    max_seq_len_q: Any = None
    max_seq_len_kv: Any = None
    dropout: Any = None
    dropout_seed: Any = None
    dropout_offset: Any = None
    # The frontend's keywords with no effect on the result here (code passes them on every call).
    implementation: Any = None  # attention_implementation: cuDNN's heuristics choose the engine
    max_total_seq_len_q: Any = None  # packed token totals: a workspace bound the plans do not need
    max_total_seq_len_kv: Any = None
    rng_dump: Any = None  # sdpa_backward's debug output: not supported yet (None is taken; sdpa's is a parameter)
    sink_token: Any = None  # attention sinks: a float32 [1, H_q, 1, 1] tensor, one logit per head
    # The FP8 ops' own spellings of the band: aliases of sliding_window_length and the diagonal band bounds.
    sliding_window: Any = None
    left_bound: Any = None
    right_bound: Any = None
    # Score modifiers: callbacks (graph, tensor) -> tensor building a pointwise subgraph on the
    # scores and, backward, on their gradient (recording/score_mod.py traces them).
    score_mod: Any = None
    score_mod_bprop: Any = None
    # The frontend's keywords for what is not run here: their defaults are taken (code passes them
    # on every call); any other value is refused with the reason (NOT_RUN_HERE).
    block_mask: Any = None
    score_max: Any = None
    score_sum_exp: Any = None
    unfuse_fma: Any = False
    cu_seq_len_q: Any = None
    cu_seq_len_kv: Any = None
    stats_use_log2: Any = False
    paged_attention_k_table: Any = None  # sdpa_fp8's: sdpa and sdpa_with_paged_cache take their own
    paged_attention_v_table: Any = None
    paged_attention_max_seq_len_kv: Any = None


ALIASES = (
    ("sliding_window", "sliding_window_length"),
    ("left_bound", "diagonal_band_left_bound"),
    ("right_bound", "diagonal_band_right_bound"),
)
NOT_RUN_HERE = {
    "block_mask": "block-sparse tile masks need cuDNN's unified engine (cuDNN >= 9.14); not supported here",
    "score_max": "the softmax partials (score_max, score_sum_exp) as outputs are not supported here; use Stats",
    "score_sum_exp": "the softmax partials (score_max, score_sum_exp) as outputs are not supported here; use Stats",
    "unfuse_fma": "a Blackwell (sm100) engine option; not supported here",
    "cu_seq_len_q": "cumulative sequence lengths need cuDNN >= 9.24; give seq_len_q with ragged offsets",
    "cu_seq_len_kv": "cumulative sequence lengths need cuDNN >= 9.24; give seq_len_kv with ragged offsets",
    "stats_use_log2": "base-2 Stats need cuDNN >= 9.27 or a Blackwell engine; not supported here",
    "paged_attention_k_table": "FP8 attention over paged caches is not supported here",
    "paged_attention_v_table": "FP8 attention over paged caches is not supported here",
}  # paged_attention_max_seq_len_kv: taken, and read only with the tables


KEYWORDS = tuple(f.name for f in dataclasses.fields(MaskKeywords))
# The ops' own keywords, named when given to another op.
HINTS = {
    "fn": "sdpa_fp8's name for a score modifier; sdpa and sdpa_backward take score_mod",
    "dSink_token": "sdpa_backward and sdpa_fp8_backward take it (the sink's gradient)",
}


@dataclass
class Parsed:
    """What the keywords say: the options, the inputs to bind, and every problem found."""

    options: ScoreOptions
    scale_given: bool  # False: the scale is the default, resolved once q's head dim is known
    max_seq_len_q: int | None
    max_seq_len_kv: int | None
    tensors: dict[str, Any] = field(default_factory=dict)  # role -> tensor to bind as an input
    runtime: dict[str, int] = field(default_factory=dict)  # int dropout seed/offset, passed by value
    errors: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)  # valid, but not run here: UnsupportedError
    score_mod: Any = None  # the traced ScoreModifier (its input specs are set when the problem is assembled)


def collect_keywords(given: dict[str, Any], op: str, hints: dict[str, str] | None = None) -> MaskKeywords | list[str]:
    """``given`` as ``MaskKeywords``, or the lines naming each keyword ``op`` does not take."""
    unknown = [name for name in given if name not in KEYWORDS]
    if unknown:
        hints = {**HINTS, **(hints or {})}
        return [f"{name}: not a keyword of {op}" + (f"; {hints[name]}" if name in hints else "") for name in unknown]
    return MaskKeywords(**given)


def parse_keywords(given: MaskKeywords, *, ragged: bool) -> Parsed:
    """Parse ``given``; ``ragged``: q is THD, which implies the padding mask."""
    errors: list[str] = []
    given = _resolved_aliases(given, errors)
    tensors: dict[str, Any] = {}
    scale: float | None = 1.0
    if isinstance(given.attn_scale, TensorHandle):  # a graph tensor: its value is read at each run
        tensors["scale_tensor"] = given.attn_scale
    else:
        scale = _scale(given.attn_scale, errors)
    unsupported: list[str] = []
    causal, right_bound, bottom_right = _band(given, errors)
    window = _window(given, errors)
    if given.attn_bias is not None and given.bias is not None:
        errors.append("attn_bias: given twice (attn_bias= and its alias bias=); give one")
    bias = given.attn_bias if given.attn_bias is not None else given.bias
    for role, value in (
        ("bias", bias),
        ("seq_len_q", given.seq_len_q),
        ("seq_len_kv", given.seq_len_kv),
        ("sink_token", given.sink_token),
    ):
        if value is not None:
            tensors[role] = value
    dropout_p, runtime = _dropout(given, tensors, errors)
    options = ScoreOptions(
        attn_scale=scale if scale is not None else 1.0,
        causal=causal,
        sliding_window=window,
        alibi=_flag(given.use_alibi_mask, "use_alibi_mask", errors),
        padding=_flag(given.use_padding_mask, "use_padding_mask", errors) or ragged,
        dropout_p=dropout_p,
        right_bound=right_bound,
        bottom_right=bottom_right and (window is not None or right_bound is not None),
    )
    _frontend_keywords(given, errors, unsupported)
    return Parsed(
        unsupported=unsupported,
        options=options,
        scale_given=scale is not None,
        max_seq_len_q=_length(given.max_seq_len_q, "max_seq_len_q", errors),
        max_seq_len_kv=_length(given.max_seq_len_kv, "max_seq_len_kv", errors),
        tensors=tensors,
        runtime=runtime,
        errors=errors,
    )


def _frontend_keywords(given: MaskKeywords, errors: list[str], unsupported: list[str]) -> None:
    implementation = getattr(given.implementation, "name", given.implementation)
    if implementation not in (None, "AUTO", "COMPOSITE", "UNIFIED"):
        errors.append(f"implementation: {given.implementation!r}; allowed AUTO, COMPOSITE or UNIFIED")
    for name in ("max_total_seq_len_q", "max_total_seq_len_kv"):
        _length(getattr(given, name), name, errors)
    if given.rng_dump is not None:
        unsupported.append("rng_dump: the dropout keep-mask as an output is not supported yet")
    defaults = {f.name: f.default for f in dataclasses.fields(MaskKeywords)}
    for name, reason in NOT_RUN_HERE.items():
        value = getattr(given, name)
        if value is not None and value is not defaults[name]:
            unsupported.append(f"{name}: {reason}")


def _resolved_aliases(given: MaskKeywords, errors: list[str]) -> MaskKeywords:
    """``given`` with the FP8 ops' spellings moved to the names the parser reads."""
    changes: dict[str, Any] = {}
    for alias, name in ALIASES:
        value = getattr(given, alias)
        if value is None:
            continue
        if getattr(given, name) is not None:
            errors.append(f"{alias}: given with its alias {name}; give one")
        changes[name], changes[alias] = value, None
    return dataclasses.replace(given, **changes) if changes else given


def stats_requested(is_inference: Any, generate_stats: Any, errors: list[str]) -> bool:
    """Whether stats are generated: the frontend's two spellings, which must agree."""
    for name, value in (("is_inference", is_inference), ("generate_stats", generate_stats)):
        if value is not None and (not isinstance(value, (bool, int)) or value not in (0, 1)):
            errors.append(f"{name}: {value!r}; expected True or False")
            return False
    if is_inference is not None and generate_stats is not None and bool(is_inference) == bool(generate_stats):
        errors.append(
            f"generate_stats: {generate_stats} contradicts is_inference={is_inference}; "
            "stats are generated exactly when not in inference (give one of the two)"
        )
    if generate_stats is not None:
        return bool(generate_stats)
    return not is_inference if is_inference is not None else False


def flag_true(flag: Any) -> bool:
    """Whether a flag keyword is set (``True`` or ``1``; anything else is reported where it is checked)."""
    return flag is True or (type(flag) is int and flag == 1)


# ---- one keyword each -------------------------------------------------------------------


def _flag(value: Any, name: str, errors: list[str]) -> bool:
    if value is None:
        return False
    if not isinstance(value, (bool, int)) or value not in (0, 1):
        errors.append(f"{name}: {shown(value)}; expected True or False")
        return False
    return bool(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _length(value: Any, name: str, errors: list[str]) -> int | None:
    if value is None:
        return None
    if not _is_int(value) or not 1 <= value <= MAX_LENGTH:
        errors.append(f"{name}: {shown(value)}; expected an int in 1..{MAX_LENGTH}")
        return None
    return value


def _scale(value: Any, errors: list[str]) -> float | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.device.type == "meta":
            errors.append(f"attn_scale: tensor of shape {list(value.shape)}; give a float or a one-element real tensor")
            return None
        value = value.item()
    if not finite_real(value):  # NumPy's reals taken as floats are
        errors.append(f"attn_scale: {shown(value)}; expected a finite float")
        return None
    return float(value)


def _alignment_name(value: Any) -> str | None:
    if value is None:
        return None
    name = getattr(value, "name", value)
    return str(name).upper()


def _band(given: MaskKeywords, errors: list[str]) -> tuple[Causal, int | None, bool]:
    """The diagonal band's causal variant, right bound beyond the diagonal (R >= 1) and whether
    the bounds measure from the bottom-right diagonal, as the frontend reads its keywords."""
    top = _flag(given.use_causal_mask, "use_causal_mask", errors)
    bottom = _flag(given.use_causal_mask_bottom_right, "use_causal_mask_bottom_right", errors)
    if top and bottom:
        errors.append(
            "use_causal_mask: both use_causal_mask and use_causal_mask_bottom_right are set; choose one diagonal"
        )
    alignment = _alignment_name(given.diagonal_alignment)
    if alignment not in (None, "TOP_LEFT", "BOTTOM_RIGHT"):
        errors.append(f"diagonal_alignment: {given.diagonal_alignment!r}; allowed TOP_LEFT or BOTTOM_RIGHT")
        alignment = None
    right = given.diagonal_band_right_bound
    beyond = None
    if right is not None:
        if not _is_int(right) or not 0 <= right <= MAX_LENGTH:
            errors.append(f"diagonal_band_right_bound: {shown(right)}; expected an int >= 0")
        elif top or bottom:
            if right != 0:
                errors.append(f"diagonal_band_right_bound: {right} with a causal mask; causal is a right bound of 0")
        elif right == 0:
            top, bottom = alignment != "BOTTOM_RIGHT", alignment == "BOTTOM_RIGHT"
        else:
            beyond = int(right)
    # An alignment with no bound at all masks nothing, as in the frontend.
    causal = Causal.BOTTOM_RIGHT if bottom else (Causal.TOP_LEFT if top else Causal.NONE)
    return causal, beyond, causal is Causal.NONE and alignment == "BOTTOM_RIGHT"


def _window(given: MaskKeywords, errors: list[str]) -> int | None:
    window, left = given.sliding_window_length, given.diagonal_band_left_bound
    if window is not None and left is not None and window != left:
        errors.append(
            f"sliding_window_length: {shown(window)} disagrees with diagonal_band_left_bound={shown(left)}; give one"
        )
    value, name = (window, "sliding_window_length") if window is not None else (left, "diagonal_band_left_bound")
    if value is None:
        return None
    if not _is_int(value) or not 1 <= value <= MAX_LENGTH:
        errors.append(f"{name}: {shown(value)}; must be an int >= 1 (and <= {MAX_LENGTH})")  # the one given
        return None
    return value


def _dropout(given: MaskKeywords, tensors: dict[str, Any], errors: list[str]) -> tuple[float, dict[str, int]]:
    value, seed, offset = given.dropout, given.dropout_seed, given.dropout_offset
    p: Any = 0.0
    if isinstance(value, (tuple, list)):
        if len(value) == 3:
            p, tuple_seed, tuple_offset = value
            if seed is not None or offset is not None:
                errors.append(
                    "dropout: a (p, seed, offset) tuple and dropout_seed/dropout_offset are both given; give one"
                )
            seed, offset = tuple_seed, tuple_offset
        else:
            errors.append(
                f"dropout: a tuple of {len(value)} items; give a probability or a (p, seed, offset) tuple "
                "(custom (mask, scale) dropout is not supported)"
            )
    elif value is not None:
        p = value
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        errors.append(f"dropout: probability {shown(p)}; allowed 0 <= p < 1")
        return 0.0, {}
    runtime: dict[str, int] = {}
    for role, rng in (("dropout_seed", seed), ("dropout_offset", offset)):
        if rng is None or not p:
            continue
        if _is_int(rng):
            if not -(2**63) <= rng < 2**63:
                errors.append(f"{role}: {rng}; must fit in int64")
            else:
                runtime[role] = rng
        elif isinstance(rng, bool) or isinstance(rng, (float, complex, str)):
            errors.append(f"{role}: {shown(rng)}; expected an int or a one-element int64 tensor")
        else:
            tensors[role] = rng
    return float(p), runtime


# ---- publishing the keywords in op signatures ------------------------------------------------

F = TypeVar("F", bound=Callable[..., Any])


def publishes_mask_keywords(method: F) -> F:
    """Replace the op's ``**mask`` in its signature by every keyword of ``MaskKeywords``."""
    signature = inspect.signature(method)
    params = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    taken = {p.name for p in params}
    extra = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
        for f in dataclasses.fields(MaskKeywords)
        if f.name not in taken
    ]
    split = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.KEYWORD_ONLY), len(params))
    method.__signature__ = signature.replace(parameters=params[:split] + extra + params[split:])  # type: ignore[attr-defined]
    return method
