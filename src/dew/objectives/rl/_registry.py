"""Name-or-function registries: how a knob such as ``estimator`` accepts either a
registered name or a user's function with the same signature."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., object])

__all__ = ["display_name", "resolve"]


def resolve(registry: Mapping[str, F], value: str | F, param: str, signature: str) -> F:
    """The function registered under ``value``, or ``value`` itself when it is callable;
    ``ValueError`` naming ``param``, the registered names and ``signature`` otherwise."""
    if isinstance(value, str):
        if value in registry:
            return registry[value]
    elif callable(value):
        return value
    raise ValueError(
        f"{param}={value!r} is not one of {sorted(registry)} nor a callable {signature}"
    )


def display_name(value: str | Callable[..., object]) -> str:
    """How messages name a knob's value: the registered name, or the function's name."""
    return value if isinstance(value, str) else getattr(value, "__name__", repr(value))
