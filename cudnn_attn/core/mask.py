"""How scores are formed, as problem fields: the softmax scale, the causal variants, and
``ScoreOptions`` (scale, causal, window, ALiBi, padding, dropout), one frozen group of every
``AttentionProblem``. The keywords users spell them with are parsed in ``recording/keywords.py``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

# cuDNN reads window lengths and sequence lengths as int32.
MAX_LENGTH = 2**31 - 1


def default_scale(d_qk: int) -> float:
    """The softmax scale when none is given: 1 / sqrt(head dim), as everywhere."""
    return 1.0 / math.sqrt(max(d_qk, 1))


class Causal(str, enum.Enum):
    NONE = "none"
    TOP_LEFT = "top_left"
    BOTTOM_RIGHT = "bottom_right"


@dataclass(frozen=True)
class ScoreOptions:
    """How q @ k^T becomes the scores softmax sees: a group of fields of every problem."""

    attn_scale: float = 1.0
    causal: Causal = Causal.NONE
    sliding_window: int | None = None
    alibi: bool = False
    padding: bool = False
    dropout_p: float = 0.0

    @property
    def has_dropout(self) -> bool:
        return self.dropout_p > 0.0

    @property
    def masks_scores(self) -> bool:
        """Whether some score can be masked out (causal, window or padding)."""
        return self.causal is not Causal.NONE or self.sliding_window is not None or self.padding
