"""Number checks that refuse a bool: JSON's and YAML's ``true`` is a Python bool, and a bool is an int (True == 1),
so ``isinstance(v, int)`` alone took ``true`` as a count of 1. Imports nothing of ours, so every layer can use it
(as ``_words``)."""

from __future__ import annotations

import math
import numbers


def is_int(v) -> bool:
    """A Python int, not a bool (a numpy integer is not one: see ``is_integral``)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_integral(v) -> bool:
    """An int or another ``numbers.Integral`` (a numpy integer), not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_real(v) -> bool:
    """An int or a float, not a bool; inf and nan included (see ``is_number``)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_number(v) -> bool:
    """A finite int or float, not a bool."""
    return is_real(v) and math.isfinite(v)
