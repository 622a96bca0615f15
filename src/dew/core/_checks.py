"""Argument checks shared by the core records (and the engines that build on them)."""

from __future__ import annotations

import numbers
import operator

__all__ = ["as_int", "is_real"]


def as_int(value: object, name: str) -> int:
    """``value`` as an int (Python or numpy integer); ``ValueError`` naming ``name`` for
    anything else, bools included."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None


def is_real(value: object) -> bool:
    """A real number that is not a bool."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real)
