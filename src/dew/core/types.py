"""The records every layer of dew shares: tasks, rollout keys, calls, rollouts, sessions.

A *source* starts a *session* for a ``(task, key)`` pair; the session runs one rollout
(one or more model calls) and resolves to a :class:`Rollout` whose ``status`` says how
it ended. Failures become data only here, at the session boundary: a source that cannot
run a rollout reports ``INFRA_ERROR`` with ``error`` set, never a reward.

This module imports nothing else of dew, so the engine, the sources, the gateway and
the scheduler can all speak it without importing each other.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol, runtime_checkable

from dew.core._checks import as_int

__all__ = [
    "Call",
    "Rollout",
    "RolloutKey",
    "Session",
    "SessionSource",
    "Status",
    "Task",
    "cancelled_rollout",
    "simulated_rollout",
]

_EMPTY: Mapping[str, Any] = MappingProxyType({})


class Status(enum.Enum):
    """How a rollout ended."""

    COMPLETED = "completed"  # ran to its end; scored by the verifier
    AGENT_ERROR = "agent_error"  # the policy did something invalid; still scored
    TRUNCATED = "truncated"  # cut by a length, turn, context or wall-clock limit
    INFRA_ERROR = "infra_error"  # the environment, harness or verifier broke; never scored
    CANCELLED = "cancelled"  # stopped on request; never scored


@dataclass(frozen=True)
class Task:
    """One unit of work. ``id`` is what a source looks the task up by."""

    id: str
    data: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)

    def __reduce__(self) -> tuple[Any, ...]:
        # Picklable (a reward worker process gets its task) though the empty default
        # is a read-only mapping proxy, which pickle refuses.
        return (Task, (self.id, dict(self.data)))


class RolloutKey(NamedTuple):
    """The scheduler's label for one attempt at one sample of one group.

    A named tuple rather than a dataclass: keys are hashed on every event the
    scheduler handles, and a tuple hashes and compares in C.
    """

    group: int
    sample: int
    attempt: int

    def __str__(self) -> str:
        return f"rollout(group={self.group}, sample={self.sample}, attempt={self.attempt})"


@dataclass(frozen=True, eq=False)
class Call:
    """One model call inside a rollout, recorded token-exactly.

    ``log_probs[i]`` is the behavior log-probability of ``completion[i]`` under the
    distribution it was actually sampled from (temperature-scaled and filtered).
    ``version`` is the weights version that served the call; a call that spanned a
    weight push reports the oldest. ``support[i]``, when present, lists the token ids
    the filtered sampler could have drawn at step ``i`` (top-k / top-p).
    ``finish_reason`` is ``"stop"`` (a stop token, kept in ``completion``) or
    ``"length"`` (``max_tokens`` reached), as an engine reports it.

    Token sequences may be lists, tuples or 1-D numpy arrays; they are not copied.
    Validation happens when the call is put into a :class:`Rollout`, so the error can
    name the rollout.
    """

    prompt: Sequence[int]
    completion: Sequence[int]
    log_probs: Sequence[float]
    version: int
    temperature: float = 1.0
    support: Sequence[Sequence[int]] | None = None
    finish_reason: str | None = None


@dataclass(frozen=True, eq=False)
class Rollout:
    """What a session resolves to.

    ``reward`` is the verifier's score (``None`` when it never ran), ``components``
    its parts. ``truncation`` says why a ``TRUNCATED`` rollout was cut (``"length"``,
    ``"turns"``, ``"context"``, ``"wall_clock"``). ``submitted`` and ``finished`` are
    monotonic seconds stamped by the scheduler.

    Construction validates everything a source could get wrong and raises
    ``ValueError`` naming the rollout key and the field.
    """

    key: RolloutKey
    task: Task
    status: Status
    calls: Sequence[Call] = ()
    reward: float | None = None
    components: Mapping[str, float] = field(default_factory=lambda: _EMPTY)
    truncation: str | None = None
    error: str | None = None
    submitted: float | None = None
    finished: float | None = None

    def __post_init__(self) -> None:
        key = self.key
        if not isinstance(key, RolloutKey):
            raise ValueError(f"Rollout.key must be a RolloutKey, got {key!r}")
        if not isinstance(self.status, Status):
            raise ValueError(f"{key}: unknown status {self.status!r}; expected a Status member")
        if self.reward is not None:
            if not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
                raise ValueError(
                    f"{key}: reward must be a finite number or None, got {self.reward!r}"
                )
        for name, value in self.components.items():
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{key}: reward component {name!r} must be finite, got {value!r}")
        if self.status is Status.TRUNCATED and not self.truncation:
            raise ValueError(f"{key}: a TRUNCATED rollout needs truncation set to its cause")
        if self.status in _SCORED and not self.calls:
            raise ValueError(f"{key}: status {self.status.name} needs at least one call")
        for i, call in enumerate(self.calls):
            _check_call(call, key, i)
        # Read on every staleness check, so computed once; the dataclass is frozen.
        object.__setattr__(self, "_oldest", min((c.version for c in self.calls), default=None))

    @property
    def completion_tokens(self) -> int:
        calls = self.calls
        if len(calls) == 1:  # the common case, read per rollout by the scheduler's metrics
            return len(calls[0].completion)
        return sum(len(c.completion) for c in calls)

    @property
    def oldest_version(self) -> int | None:
        """The oldest weights version among the calls, or None without calls."""
        return self._oldest  # type: ignore[attr-defined]


_SCORED = frozenset({Status.COMPLETED, Status.AGENT_ERROR, Status.TRUNCATED})


def simulated_rollout(
    key: RolloutKey,
    task: Task,
    status: Status,
    calls: tuple[Call, ...],
    reward: float | None,
    truncation: str | None,
) -> Rollout:
    """A Rollout built without validation, for simulations that made every part.

    The planner builds one per simulated completion from a shared call it checked
    once; running the constructor's checks on each would repeat that work per event.
    The fields are set exactly as the constructor sets them.
    """
    r = object.__new__(Rollout)
    object.__setattr__(
        r,
        "__dict__",
        {
            "key": key,
            "task": task,
            "status": status,
            "calls": calls,
            "reward": reward,
            "components": _EMPTY,
            "truncation": truncation,
            "error": None,
            "submitted": None,
            "finished": None,
            "_oldest": calls[0].version
            if len(calls) == 1
            else min((c.version for c in calls), default=None),
        },
    )
    return r


def _bad_call(key: RolloutKey, i: int, problem: str) -> ValueError:
    return ValueError(f"{key}: calls[{i}]{problem}")


def _check_call(call: Call, key: RolloutKey, i: int) -> None:
    # Error text is only built on failure: this runs for every finished rollout.
    if not isinstance(call, Call):
        raise _bad_call(key, i, f" must be a Call, got {type(call).__name__}")
    n = len(call.completion)
    if n == 0:
        raise _bad_call(key, i, ".completion is empty; a call produces at least one token")
    if len(call.prompt) == 0:
        raise _bad_call(key, i, ".prompt is empty")
    if len(call.log_probs) != n:
        raise _bad_call(
            key, i, f".log_probs has {len(call.log_probs)} entries but completion has {n} tokens"
        )
    try:
        version = as_int(call.version, ".version")
    except ValueError as e:
        raise _bad_call(key, i, str(e)) from None
    if version < 0:
        raise _bad_call(key, i, f".version must be >= 0, got {version}")
    if not (call.temperature > 0 and math.isfinite(call.temperature)):
        raise _bad_call(key, i, f".temperature must be positive and finite, got {call.temperature}")
    if call.support is not None:
        if len(call.support) != n:
            raise _bad_call(
                key, i, f".support has {len(call.support)} rows but completion has {n} tokens"
            )
        for t, (tok, row) in enumerate(zip(call.completion, call.support, strict=True)):
            if len(row) == 0:
                raise _bad_call(key, i, f".support[{t}] is empty")
            if tok not in row:
                raise _bad_call(key, i, f".support[{t}] does not contain the sampled token {tok}")


# --------------------------------------------------------------------------- protocols


@runtime_checkable
class Session(Protocol):
    """Handle of one running rollout."""

    def cancel(self) -> None:
        """Ask the rollout to stop; returns at once and may be called any number of times."""

    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> Rollout:
        """Block until done; return the rollout or raise what the source raised."""

    def add_done_callback(self, fn: Callable[[Session], None]) -> None:
        """Call ``fn(session)`` once when done (at once if already done), from any thread."""


@runtime_checkable
class SessionSource(Protocol):
    """Where rollouts come from. ``start`` must not block."""

    def start(self, task: Task, key: RolloutKey) -> Session: ...


def cancelled_rollout(task: Task, key: RolloutKey, calls: Sequence[Call] = ()) -> Rollout:
    """The ``CANCELLED`` rollout of a session stopped on request.

    ``calls`` are what it had made by then, kept for inspection: a cancelled rollout is
    never scored.
    """
    return Rollout(key=key, task=task, status=Status.CANCELLED, calls=calls, error="cancelled")
