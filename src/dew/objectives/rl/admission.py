"""The scheduler's bookkeeping as a plain state machine: no threads, no clock, no I/O.

Public so that other drivers can run the same rules: the real scheduler
(:mod:`dew.objectives.rl.scheduler`) drives it from its own thread against a source,
and the planner (:mod:`dew.plan.planner`) drives it from an engine model in simulated
time. Both build it from the one :class:`~dew.objectives.rl.config.SchedulerConfig`.

The driver feeds it events — a batch registered, a trainer call,
a weight push, a session finished, the clock passing a deadline, a reopened stream —
and carries out the :class:`Start` and :class:`Cancel` actions it returns. Time is
always passed in, so tests can drive every rule exactly.

Vocabulary: a *batch* is one registered task batch; each task becomes a *group* of
``groups + oversample`` *samples*; each run of a sample is an *attempt*, labelled by
a :class:`RolloutKey`. A group is *complete* once ``groups`` of its samples are
admitted; it is *abandoned* once it can no longer get there; it is *dropped* when
``admit`` other groups of its batch completed first.

Invariants (checked by the hypothesis state-machine test):

* every key handed out in a ``Start`` ends exactly once: consumed (packed or cut),
  failed (infra error, cancelled by the source, timeout, unscored; resubmitted while
  attempts remain), resubmitted as stale, cancelled (surplus, stale, abandoned,
  dropped, reopened, closed) or discarded (finished, but its group was abandoned or
  dropped, or the stream reopened);
* only the current attempt of a running sample can finish; anything else — a
  superseded attempt, a result after a cancel — is ignored, so nothing is admitted
  twice;
* a sample never fails more than ``max_attempts`` times; a group keeps
  ``min(needed + oversample, startable)`` samples running until it resolves;
* a group is handed to the trainer at most once, and never when abandoned or dropped.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

from dew.core import Rollout, RolloutKey, Status, Task
from dew.objectives.rl.config import SchedulerConfig
from dew.objectives.rl.truncation import Truncation, truncation_policy

__all__ = ["Admission", "Cancel", "Consumed", "Start"]


class Start(NamedTuple):  # named tuples: one is made per start and per cancel
    """Start ``task`` as attempt ``key`` on the source."""

    task: Task
    key: RolloutKey


class Cancel(NamedTuple):
    """Cancel the running attempt ``key``; whatever it returns later is ignored."""

    key: RolloutKey


Action = Start | Cancel
_tuple_new = tuple.__new__


class _S(Enum):
    IDLE = 0  # waiting to be (re)started
    RUNNING = 1
    ADMITTED = 2
    EXHAUSTED = 3  # out of attempts
    SURPLUS = 4  # cancelled because the group completed; may be revived


class _G(Enum):
    RUNNING = 0
    COMPLETE = 1
    ABANDONED = 2
    DROPPED = 3


# The members as module constants: on Python 3.11 reading ``_S.RUNNING`` goes through a
# descriptor (about ten times a global's cost), and the hot paths read them per sample.
_IDLE, _RUNNING, _ADMITTED = _S.IDLE, _S.RUNNING, _S.ADMITTED
_EXHAUSTED, _SURPLUS = _S.EXHAUSTED, _S.SURPLUS
_G_RUNNING, _G_COMPLETE, _G_ABANDONED, _G_DROPPED = (
    _G.RUNNING,
    _G.COMPLETE,
    _G.ABANDONED,
    _G.DROPPED,
)
_COMPLETED, _AGENT_ERROR, _TRUNCATED = Status.COMPLETED, Status.AGENT_ERROR, Status.TRUNCATED
_INFRA_ERROR, _CANCELLED = Status.INFRA_ERROR, Status.CANCELLED


@dataclass(eq=False, slots=True)
class _Sample:
    index: int
    group: _Group
    attempt: int = -1  # no attempt yet
    failures: int = 0
    state: _S = _IDLE
    cause: str | None = None  # why the next start is a resubmission
    version: int = 0  # served version at the current attempt's submission
    rollout: Rollout | None = None
    key: RolloutKey | None = None  # of the current attempt, once started


@dataclass(eq=False, slots=True)
class _Group:
    gid: int
    task: Task
    batch: _Batch
    samples: list[_Sample]
    admitted: list[int] = field(default_factory=list)  # sample indices, finish order
    state: _G = _G_RUNNING
    order: int = -1  # completion order, for packing in admission order


@dataclass(eq=False)
class _Batch:
    seq: int
    tasks: Sequence[Task]
    handle: Any
    groups: list[_Group] = field(default_factory=list)
    submitted: bool = False
    # Groups by state, kept by _set_state: ready() is asked after every finish event,
    # and a count answers it without walking the batch's groups.
    running: int = 0
    complete: int = 0


def _set_state(g: _Group, state: _G) -> None:
    """The one place a group changes state after it is built (keeps its batch's counts)."""
    b = g.batch
    if g.state is _G_RUNNING:
        b.running -= 1
    elif g.state is _G_COMPLETE:
        b.complete -= 1
    if state is _G_RUNNING:
        b.running += 1
    elif state is _G_COMPLETE:
        b.complete += 1
    g.state = state


_ERRORS_KEPT = 64  # failed attempts remembered between two trainer calls (the latest)


@dataclass
class Consumed:
    """What a trainer call takes: complete groups in admission order, and the rest."""

    groups: list[list[Rollout]]
    abandoned: list[Task]
    dropped: list[Task]
    # The latest failed attempts (any batch) since the previous consume: what went wrong.
    errors: list[str] = field(default_factory=list)


class Admission:
    """Groups, samples, attempts, staleness and admission for one scheduler.

    It reads ``groups``, ``oversample``, ``admit``, ``max_lag``, ``ahead``,
    ``max_attempts``, ``timeout`` and ``truncation`` from ``config``; weight pushes
    (``sync_every``) and packing are the driver's. Every mutating method returns the
    actions to carry out, in order.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._truncate = truncation_policy(config.truncation)
        self.served: int | None = None  # version the engines serve
        # The version a push under way may already serve somewhere (an engine of a fleet
        # can finish a call under it before the push returns): calls up to it are fine.
        self.pushing_version: int | None = None
        self._batches: list[_Batch] = []  # registered, oldest first
        self._seq = itertools.count()
        self._gid = itertools.count()
        self._order = itertools.count()
        # Running attempts by key. A sample reaches its group through ``group``: a
        # (group, sample) pair per start would be one more object per rollout in flight
        # for the cyclic collector to walk.
        self._running: dict[RolloutKey, _Sample] = {}
        self._deadlines: list[tuple[float, RolloutKey]] = []
        self.closed = False
        self._errors: deque[str] = deque(maxlen=_ERRORS_KEPT)
        self.reset_counts()
        # Per-key ledger of how each started attempt ended; kept for audits and tests.
        self.audit: dict[RolloutKey, str] | None = None

    # ------------------------------------------------------------------ counters

    def reset_counts(self) -> None:
        """Start a new record window (one per trainer call)."""
        self.resubmitted: Counter[str] = Counter()
        self.cancelled = 0
        self.abandoned = 0
        self.dropped_rollouts: list[tuple[str, Rollout]] = []  # (why, rollout) for length bias

    def _end(self, key: RolloutKey, how: str) -> None:
        if self.audit is not None:
            if key in self.audit:
                raise AssertionError(f"{key} ended twice: {self.audit[key]!r} then {how!r}")
            self.audit[key] = how

    # ------------------------------------------------------------------ batches

    @property
    def registered(self) -> int:
        return len(self._batches)

    def register(self, tasks: Sequence[Task], handle: Any = None) -> int:
        """A batch was read from the stream. Returns its sequence number."""
        self._check_open()
        b = _Batch(next(self._seq), list(tasks), handle)
        self._batches.append(b)
        return b.seq

    def oldest(self) -> Any:
        return self._batches[0].handle if self._batches else None

    def _submit(self, b: _Batch, now: float) -> list[Action]:
        b.submitted = True
        actions: list[Action] = []
        n = self.config.groups + self.config.oversample
        for task in b.tasks:
            g = _Group(next(self._gid), task, b, [])
            g.samples = [_Sample(i, g) for i in range(n)]
            b.groups.append(g)
            b.running += 1
            self._top_up(g, now, actions)
        return actions

    def call(self, updates: int, now: float) -> list[Action]:
        """The trainer hands over the oldest registered batch at ``updates``.

        Sweeps staleness across everything live, then submits the handed batch (if it
        was not yet) and the next ``ahead`` registered batches.
        """
        self._check_open()
        if not self._batches:
            raise RuntimeError("no registered batch: read the batch from scheduler.tasks(dataset)")
        actions = self._sweep_stale(updates, now, self._batches)
        for b in self._batches[: self.config.ahead + 1]:
            if not b.submitted:
                actions += self._submit(b, now)
        return actions

    def pushing(self, version: int) -> None:
        """A push of ``version`` began: calls under it may finish before it is done."""
        self.pushing_version = version

    def pushed(self, version: int) -> None:
        """The engines serve ``version``: new submissions are stamped with it."""
        self.served = version

    # ------------------------------------------------------------------ samples

    def _start(self, g: _Group, s: _Sample, now: float, actions: list[Action]) -> None:
        if s.attempt >= 0 and s.cause is not None:
            self.resubmitted[s.cause] += 1
        s.attempt += 1
        s.cause = None
        s.state = _RUNNING
        s.version = self.served if self.served is not None else 0
        # tuple.__new__ skips the named tuple's generated __new__: one fewer Python call
        # per start, which the planner makes tens of thousands of times per plan.
        key = s.key = _tuple_new(RolloutKey, (g.gid, s.index, s.attempt))
        self._running[key] = s
        timeout = self.config.timeout
        if timeout is not None:
            heapq.heappush(self._deadlines, (now + timeout, key))
        actions.append(_tuple_new(Start, (g.task, key)))

    def _stop(self, s: _Sample, how: str, actions: list[Action]) -> None:
        """Cancel a running sample's current attempt."""
        key = s.key  # the current attempt's
        assert key is not None, "a running sample has been started"
        del self._running[key]
        self._end(key, how)
        actions.append(_tuple_new(Cancel, (key,)))

    def _top_up(self, g: _Group, now: float, actions: list[Action]) -> None:
        if g.state is not _G_RUNNING:
            return
        needed = self.config.groups - len(g.admitted)
        running = [s.state for s in g.samples].count(_RUNNING)
        want = needed + self.config.oversample
        for s in g.samples:
            if running >= want:
                break
            if s.state in (_IDLE, _SURPLUS):
                self._start(g, s, now, actions)
                running += 1

    def _alive(self, g: _Group) -> int:
        return sum(s.state is not _EXHAUSTED for s in g.samples)

    def _fail(self, g: _Group, s: _Sample, cause: str, now: float, actions: list[Action]) -> None:
        """A failed attempt: counts toward max_attempts; resubmit or give up."""
        self._count_failure(s, cause)
        self._settle(g, now, actions)

    def _count_failure(self, s: _Sample, cause: str) -> None:
        s.failures += 1
        s.rollout = None
        if s.failures >= self.config.max_attempts:
            s.state = _EXHAUSTED
        else:
            s.state, s.cause = _IDLE, cause

    def _settle(self, g: _Group, now: float, actions: list[Action]) -> None:
        """After failures: abandon a group that can no longer complete, else refill it."""
        if g.state is not _G_RUNNING:
            return
        if self._alive(g) < self.config.groups:
            self._abandon(g, actions)
        else:
            self._top_up(g, now, actions)

    def _abandon(self, g: _Group, actions: list[Action]) -> None:
        _set_state(g, _G_ABANDONED)
        self.abandoned += 1
        self._release(g, "abandoned", actions)

    def _release(self, g: _Group, how: str, actions: list[Action]) -> None:
        """Cancel a group's running samples and discard what it had admitted."""
        for s in g.samples:
            if s.state is _RUNNING:
                self._stop(s, how, actions)
                self.cancelled += 1
                s.state = _SURPLUS
            elif s.state is _ADMITTED and s.rollout is not None:
                self._end(s.rollout.key, "discarded")
                s.rollout = None
                s.state = _SURPLUS

    def _complete(self, g: _Group, actions: list[Action]) -> None:
        _set_state(g, _G_COMPLETE)
        g.order = next(self._order)
        for s in g.samples:
            if s.state is _RUNNING:
                self._stop(s, "surplus", actions)
                self.cancelled += 1
                s.state = _SURPLUS
        b = g.batch
        admit = self.config.admit
        if admit is not None:
            if b.complete >= admit:
                for x in b.groups:
                    if x.state is _G_RUNNING:
                        _set_state(x, _G_DROPPED)
                        self._release(x, "dropped", actions)

    # ------------------------------------------------------------------ events

    def finished(self, key: RolloutKey, rollout: Rollout, now: float) -> list[Action]:
        """A session resolved. Stale attempts and post-cancel results are ignored."""
        s = self._running.get(key)
        if s is None:
            return []
        if rollout.key != key:
            raise ValueError(f"{key}: the source returned a rollout labelled {rollout.key}")
        newest = self.served
        if self.pushing_version is not None and (newest is None or self.pushing_version > newest):
            newest = self.pushing_version
        for i, c in enumerate(rollout.calls):
            if newest is not None and c.version > newest:
                raise ValueError(
                    f"{key}: calls[{i}].version={c.version} is from the future "
                    f"(the engines serve version {newest} at most)"
                )
        status = rollout.status
        if status in (_COMPLETED, _AGENT_ERROR) and rollout.reward is None:
            raise ValueError(f"{key}: status {status.name} needs a reward from the verifier")
        del self._running[key]
        g = s.group
        actions: list[Action] = []
        cause: str | None = None
        if status is _TRUNCATED:
            verdict: Truncation = self._truncate(rollout)
            cause = verdict.resubmit
        elif status is _INFRA_ERROR:
            cause = "infra_error"
        elif status is _CANCELLED:
            cause = "cancelled"
        if cause is not None:
            self._errors.append(f"{key}: {cause}" + (f": {rollout.error}" if rollout.error else ""))
            self._end(key, f"failed:{cause}")
            self._fail(g, s, cause, now, actions)
            return actions
        s.state = _ADMITTED
        s.rollout = rollout
        g.admitted.append(s.index)
        if len(g.admitted) >= self.config.groups:
            self._complete(g, actions)
        return actions

    def next_deadline(self) -> float | None:
        while self._deadlines and self._deadlines[0][1] not in self._running:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def expire(self, now: float) -> list[Action]:
        """Cancel and resubmit, as failed attempts, every rollout past its deadline.

        Every expired attempt is counted before any group is refilled, so a group that
        several timeouts abandon at once starts no new attempt on the way.
        """
        actions: list[Action] = []
        touched: dict[int, _Group] = {}
        while self._deadlines and self._deadlines[0][0] <= now:
            _, key = heapq.heappop(self._deadlines)
            s = self._running.get(key)
            if s is None:
                continue
            g = s.group
            self._errors.append(f"{key}: timeout: still running {self.config.timeout:g} s in")
            self._stop(s, "failed:timeout", actions)
            self._count_failure(s, "timeout")
            touched[g.gid] = g
        for g in touched.values():
            self._settle(g, now, actions)
        return actions

    def _sweep_stale(self, updates: int, now: float, batches: Sequence[_Batch]) -> list[Action]:
        actions: list[Action] = []
        fresh = updates - self.config.max_lag  # the oldest version still within max_lag
        for b in batches:
            for g in b.groups:
                if g.state is not _G_RUNNING and g.state is not _G_COMPLETE:
                    continue
                touched = False
                for s in g.samples:  # every live sample, at every call: kept lean
                    state = s.state
                    if state is _RUNNING:
                        if s.version < fresh:
                            self._stop(s, "cancelled:stale", actions)
                            self.cancelled += 1
                            s.state, s.cause = _IDLE, "stale"
                            touched = True
                    elif state is _ADMITTED and s.rollout is not None:
                        oldest = s.rollout.oldest_version
                        if oldest is not None and oldest < fresh:
                            self._end(s.rollout.key, "resubmitted:stale")
                            self.dropped_rollouts.append(("stale", s.rollout))
                            g.admitted.remove(s.index)
                            s.state, s.cause, s.rollout = _IDLE, "stale", None
                            touched = True
                if touched:
                    if g.state is _G_COMPLETE and len(g.admitted) < self.config.groups:
                        _set_state(g, _G_RUNNING)
                    self._top_up(g, now, actions)
        return actions

    # ------------------------------------------------------------------ consumption

    def ready(self) -> bool:
        """Whether the oldest batch can be consumed."""
        b = self._batches[0]
        if not b.submitted:
            return False
        admit = self.config.admit
        if admit is not None and b.complete >= admit:
            return True
        return b.running == 0

    def consume(self, updates: int, now: float) -> tuple[Consumed | None, list[Action]]:
        """Take the oldest batch if it is ready and fresh at ``updates``.

        Complete groups are re-checked for staleness first; a stale member is
        discarded and resubmitted, and the batch is not ready after all.
        """
        if not self.ready():
            return None, []
        b = self._batches[0]
        actions = self._sweep_stale(updates, now, [b])
        if actions or not self.ready():
            return None, actions
        self._batches.pop(0)
        complete = sorted((g for g in b.groups if g.state is _G_COMPLETE), key=lambda g: g.order)
        out = Consumed(groups=[], abandoned=[], dropped=[], errors=list(self._errors))
        self._errors.clear()
        for g in b.groups:
            if g.state is _G_ABANDONED:
                out.abandoned.append(g.task)
            elif g.state is _G_DROPPED:
                out.dropped.append(g.task)
        for g in complete:
            members = [g.samples[i].rollout for i in g.admitted[: self.config.groups]]
            out.groups.append([r for r in members if r is not None])
            for r in out.groups[-1]:
                self._end(r.key, "consumed")
        # Break the batch <-> group cycle so a consumed batch is freed at once, not by
        # the cyclic collector (which, at thousands of rollouts a call, costs real time).
        for g in b.groups:
            g.samples.clear()
        b.groups.clear()
        return out, actions

    # ------------------------------------------------------------------ lifecycle

    def reopen(self) -> list[Action]:
        """A new stream: cancel everything in flight and forget every registered batch."""
        actions = self._cancel_all("reopened")
        self._batches.clear()
        self.served = None  # engines may serve anything after a resume
        self.pushing_version = None
        return actions

    def close(self) -> list[Action]:
        actions = self._cancel_all("closed")
        self._batches.clear()
        self.closed = True
        return actions

    def _cancel_all(self, how: str) -> list[Action]:
        actions: list[Action] = []
        for b in self._batches:
            for g in b.groups:
                self._release(g, how, actions)
                _set_state(g, _G_DROPPED)
        self._deadlines.clear()
        return actions

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the scheduler is closed")

    @property
    def in_flight(self) -> int:
        return len(self._running)
