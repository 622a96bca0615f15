"""Turning what user code returned or raised into rollout fields.

Shared by every source and the gateway's harness source: a verifier or environment
score becomes ``(reward, components)`` only when it is a finite number or a non-empty
mapping of finite numbers; anything else raises, and the source records the error on
the rollout (status with ``error`` set), never a reward of 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from dew.core._checks import is_real

__all__ = ["error_text", "parse_reward"]


def error_text(exc: BaseException) -> str:
    """``"TypeName: message"`` (or the name alone, for an exception with no message), as
    a rollout's ``error`` records an exception."""
    message = str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def parse_reward(out: object) -> tuple[float, dict[str, float]]:
    """A verifier's float, or mapping of named parts, as (reward, components)."""
    if isinstance(out, Mapping):
        if not out:
            # An empty mapping would sum to a reward of 0 that no check produced.
            raise ValueError("verifier returned an empty mapping of reward components")
        parts: dict[str, float] = {}
        for name, value in out.items():
            if not is_real(value):
                raise ValueError(f"reward component {name!r} is {value!r}, not a number")
            if not math.isfinite(_float(value)):
                raise ValueError(f"reward component {name!r} is {value!r:.60}, not finite")
            parts[str(name)] = float(value)
        total = float(sum(parts.values()))
        if not math.isfinite(total):
            raise ValueError(f"reward components sum to {total}, not a finite number")
        return total, parts
    if not is_real(out):
        raise ValueError(f"verifier returned {out!r}; expected a number or a mapping of numbers")
    if not math.isfinite(_float(out)):
        raise ValueError(f"verifier returned {out!r:.60}, not a finite number")
    return float(out), {}


def _float(value: object) -> float:
    """A real number as a float; one too large for a float (a huge int) is infinite."""
    try:
        return float(value)  # type: ignore[arg-type]
    except (OverflowError, ValueError):
        return math.inf
