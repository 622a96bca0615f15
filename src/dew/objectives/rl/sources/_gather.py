"""Gathering: which finished completions of a group are scored together, and when.

A :class:`~dew.objectives.rl.sources.GroupVerifier` scores a group's completions in one
call, as TRL calls a reward function with a whole batch. A group's completions finish
at different times; the scheduler admits a group only once ``expect`` of its samples
(its ``groups``) are in, so holding the early ones until then costs the group nothing,
and the verifier gets the batch it was written for. Samples started beyond ``expect``
(``oversample``) are not waited for once ``expect`` completions are in.

This is the bookkeeping only: a plain state machine, no threads, no clock (the source
calls it under its own lock). Keys are whatever the caller uses for one rollout
attempt; ``group`` is the group they belong to; ``retry`` marks a later attempt of a
sample.

Invariants:

* every item handed to :meth:`Gathering.generated` comes back exactly once: in one
  flush (the list :meth:`generated` or :meth:`dropped` returns) or from
  :meth:`Gathering.withdraw`;
* a group flushes as soon as items wait and either ``expect`` of them wait, or none of
  the group is generating and ``expect`` of its attempts have ended (finished or
  dropped); with ``expect`` None, as soon as none is generating;
* a retry started when its group holds nothing is a group of its own (``expect`` 1):
  the others were scored already;
* a group with nothing generating and nothing waiting is forgotten, so the state
  holds only groups in flight.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["Gathering"]

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


@dataclass
class _Group(Generic[K, T]):
    expect: int | None
    generating: set[K] = field(default_factory=set)
    waiting: dict[K, T] = field(default_factory=dict)
    ended: int = 0  # attempts that finished or were dropped

    def ready(self) -> bool:
        if not self.waiting:
            return False
        if self.expect is None:
            return not self.generating
        return len(self.waiting) >= self.expect or (
            not self.generating and self.ended >= self.expect
        )


class Gathering(Generic[K, T]):
    """Completions held per group until the group is in (see the module docstring)."""

    def __init__(self, expect: int | None = None) -> None:
        if expect is not None and expect < 1:
            raise ValueError(f"expect must be >= 1, got {expect}")
        self.expect = expect
        self._groups: dict[Hashable, _Group[K, T]] = {}

    def started(self, group: Hashable, key: K, *, retry: bool = False) -> None:
        """``key`` of ``group`` is generating."""
        state = self._groups.get(group)
        if state is None:
            state = self._groups[group] = _Group(1 if retry else self.expect)
        state.generating.add(key)

    def generated(self, group: Hashable, key: K, item: T) -> list[T]:
        """``key`` finished with ``item``: what to score now (empty: wait for more)."""
        state = self._groups[group]
        state.generating.remove(key)
        state.ended += 1
        state.waiting[key] = item
        return self._flush(group, state)

    def dropped(self, group: Hashable, key: K) -> list[T]:
        """``key`` ended without a completion (aborted, lost, never sent): what its
        group's waiting completions can be scored as now."""
        state = self._groups[group]
        state.generating.remove(key)
        state.ended += 1
        return self._flush(group, state)

    def withdraw(self, group: Hashable, key: K) -> T | None:
        """``key``'s item if it still waits (it leaves: its rollout was cancelled)."""
        state = self._groups.get(group)
        if state is None or key not in state.waiting:
            return None
        item = state.waiting.pop(key)
        self._forget_if_idle(group, state)
        return item

    def __len__(self) -> int:
        """Groups in flight."""
        return len(self._groups)

    def _flush(self, group: Hashable, state: _Group[K, T]) -> list[T]:
        out: list[T] = []
        if state.ready():
            out = list(state.waiting.values())
            state.waiting.clear()
        self._forget_if_idle(group, state)
        return out

    def _forget_if_idle(self, group: Hashable, state: _Group[K, T]) -> None:
        if not state.generating and not state.waiting:
            del self._groups[group]
