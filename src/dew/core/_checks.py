"""Argument checks shared by the core records (and the engines that build on them)."""

from __future__ import annotations

import numbers
import operator

__all__ = ["as_int", "is_real"]


def as_int(value: object, name: str, *, minimum: int | None = None) -> int:
    """``value`` as an int (Python or numpy integer); ``ValueError`` naming ``name`` for
    anything else, bools included, and for an int below ``minimum`` when one is given."""
    want = "an int" if minimum is None else f"an int >= {minimum}"
    if isinstance(value, bool):
        raise ValueError(f"{name} must be {want}, got {value!r}")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be {want}, got {value!r}") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be {want}, got {value!r}")
    return number


def is_real(value: object) -> bool:
    """A real number that is not a bool."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real)
