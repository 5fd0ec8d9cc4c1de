"""Whether an argument is a finite real number, as scales must be: a Python or NumPy real, not a
bool, and finite, where ``float()`` of a huge int (``10**400``) overflows rather than giving inf."""

from __future__ import annotations

import math
import numbers
from typing import Any


def finite_real(value: Any) -> bool:
    """True for a finite real number (bools excluded)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False
