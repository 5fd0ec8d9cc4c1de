"""``cudnn_attn.heur_mode``: the frontend's heuristic modes, accepted for drop-in code.

The library always asks cuDNN for mode A with FALLBACK behind it; the modes a caller passes
to ``create_execution_plans`` are accepted and need not be changed.
"""

from __future__ import annotations

import enum


class heur_mode(enum.Enum):  # noqa: N801 - the frontend's spelling
    A = "A"
    B = "B"
    FALLBACK = "FALLBACK"
