"""Whether an argument is a finite real number, as scales must be: a Python or NumPy real, not a
bool, and finite, where ``float()`` of a huge int (``10**400``) overflows rather than giving inf;
and whether it is an int, Python's or NumPy's."""

from __future__ import annotations

import math
import numbers
from typing import Any


def integer(value: Any) -> bool:
    """True for an int, Python's or NumPy's (bools excluded), as torch's int arguments take them."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def flag(value: Any) -> bool:
    """A yes/no argument as torch's take them: a bool, or the ints 0 and 1 (a string is neither)."""
    return isinstance(value, (bool, int)) and value in (0, 1)


def finite_real(value: Any) -> bool:
    """True for a finite real number (bools excluded)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False
