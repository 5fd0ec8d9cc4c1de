"""How scores are formed, as problem fields: the softmax scale, the causal variants, and
``ScoreOptions`` (scale, the diagonal band: causal, left and right bounds and their alignment,
ALiBi, padding, dropout), one frozen group of every ``AttentionProblem``. The keywords users spell them with are parsed in ``recording/keywords.py``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from .finite import integer

# cuDNN reads window lengths and sequence lengths as int32.
MAX_LENGTH = 2**31 - 1


def default_scale(d_qk: int) -> float:
    """The softmax scale when none is given: 1 / sqrt(head dim), as everywhere."""
    return 1.0 / math.sqrt(max(d_qk, 1))


class Causal(str, enum.Enum):
    """A causal mask's variant: none, top-left (query ``i`` sees keys ``j <= i``) or bottom-right
    (aligned to the last key: ``j <= i + S_kv - S_q``, for decode and chunked prefill).

    Example:
        ```python
        import cudnn_attn

        assert cudnn_attn.Causal("bottom_right") is cudnn_attn.Causal.BOTTOM_RIGHT
        ```
    """

    NONE = "none"
    TOP_LEFT = "top_left"
    BOTTOM_RIGHT = "bottom_right"


@dataclass(frozen=True)
class ScoreOptions:
    """How q @ k^T becomes the scores softmax sees: a group of fields of every problem."""

    attn_scale: float = 1.0
    causal: Causal = Causal.NONE  # a right bound of 0, on the top-left or bottom-right diagonal
    sliding_window: int | None = None  # the left bound W: key j visible iff j > d(i) - W
    alibi: bool = False
    padding: bool = False
    dropout_p: float = 0.0
    right_bound: int | None = None  # R >= 1 without causal: key j visible iff j <= d(i) + R
    bottom_right: bool = False  # bounds without a causal variant measure from i + S_kv - S_q

    @property
    def has_dropout(self) -> bool:
        return self.dropout_p > 0.0

    @property
    def aligned_bottom_right(self) -> bool:
        """Whether the diagonal d(i) the bounds measure from is i + S_kv - S_q (else i)."""
        return self.causal is Causal.BOTTOM_RIGHT or self.bottom_right

    @property
    def has_band(self) -> bool:
        """Whether a diagonal bound is set (causal, window or right bound)."""
        return self.causal is not Causal.NONE or self.sliding_window is not None or self.right_bound is not None

    @property
    def masks_scores(self) -> bool:
        """Whether some score can be masked out (a diagonal bound or padding)."""
        return self.has_band or self.padding


def unbounded_window(window_size: object) -> bool:
    """Whether ``window_size`` is FlashAttention's "no window": two ints, both negative."""
    return (
        isinstance(window_size, (tuple, list))
        and len(window_size) == 2
        and all(integer(w) and w < 0 for w in window_size)
    )


NO_BOUND = 2**31 - 1  # a window bound at least this far bounds no sequence


def window_bounds(window_size: object) -> tuple[int, int]:
    """FlashAttention's ``window_size=(left, right)`` as two ints, a bound past any sequence
    (lengths are int32) read as none (-1), as FlashAttention reads a bound past S_kv (one past
    int64 reached the masks as an overflow). Raises ``ValueError`` naming what is wrong."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or not all(integer(w) for w in window_size):
        raise ValueError(f"window_size: {window_size!r}; expected (left, right), each an int (negative: no bound)")
    left, right = (int(w) for w in window_size)
    return (-1 if left >= NO_BOUND else left), (-1 if right >= NO_BOUND else right)


def window_band(window_size: object, causal: Causal) -> tuple[Causal, int | None, int | None]:
    """FlashAttention's ``window_size=(left, right)`` (query i keeps keys ``i - left .. i + right``,
    any negative: no bound, as FlashAttention reads it) beside ``causal``, as
    ``(causal, sliding_window, right_bound)``: a right bound of 0 is causal (top-left where
    ``causal`` names no alignment). Raises ``ValueError`` naming what is wrong (the doors
    re-raise it as their ``ValidationError``)."""
    left, right = window_bounds(window_size)
    if right > 0 and causal is not Causal.NONE:
        raise ValueError(f"window_size: right bound {right} with a causal mask (which is a right bound of 0)")
    if right == 0 and causal is Causal.NONE:
        causal = Causal.TOP_LEFT
    return causal, (None if left < 0 else left + 1), (right if right > 0 else None)
