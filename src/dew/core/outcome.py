"""Turning what user code returned or raised into rollout fields.

Shared by every source and the gateway's harness source: a verifier or environment
score becomes ``(reward, components)`` only when it is a finite number or a non-empty
mapping of finite numbers; anything else raises, and the source records the error on
the rollout (status with ``error`` set), never a reward of 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["error_text", "parse_reward"]


def error_text(exc: BaseException) -> str:
    """``"TypeName: message"``, as a rollout's ``error`` records an exception."""
    return f"{type(exc).__name__}: {exc}"


def parse_reward(out: object) -> tuple[float, dict[str, float]]:
    """A verifier's float, or mapping of named parts, as (reward, components)."""
    if isinstance(out, Mapping):
        if not out:
            # An empty mapping would sum to a reward of 0 that no check produced.
            raise ValueError("verifier returned an empty mapping of reward components")
        parts: dict[str, float] = {}
        for name, value in out.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"reward component {name!r} is {value!r}, not a number")
            if not math.isfinite(value):
                raise ValueError(f"reward component {name!r} is {value!r}, not finite")
            parts[str(name)] = float(value)
        return float(sum(parts.values())), parts
    if isinstance(out, bool) or not isinstance(out, (int, float)):
        raise ValueError(f"verifier returned {out!r}; expected a number or a mapping of numbers")
    if not math.isfinite(out):
        raise ValueError(f"verifier returned {out!r}, not a finite number")
    return float(out), {}
