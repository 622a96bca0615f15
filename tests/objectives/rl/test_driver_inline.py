"""Sessions that resolve on the driver thread itself, inside the source's ``start`` or
``cancel``: the driver queues those finishes without its lock and must handle every one
of them, including those that its own timeout expiry causes while no other event is on
its way (a resubmission that resolves at once, a cancel that resolves the session)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch

from dew.core import Call, Rollout, RolloutKey, Session, Status, Task
from dew.objectives.rl.scheduler import RolloutScheduler, SchedulerRecord

from .conftest import WAIT, RecordingPublisher, task_dataset

pytestmark = pytest.mark.timeout(60)


class _Session:
    """Resolves when told to; a callback added after that runs at once, on the caller's thread."""

    def __init__(self, on_cancel: Callable[[_Session], None] | None = None) -> None:
        self._rollout: Rollout | None = None
        self._callbacks: list[Callable[[Session], None]] = []
        self._on_cancel = on_cancel
        self.cancelled = False

    def resolve(self, rollout: Rollout) -> None:
        self._rollout = rollout
        for fn in self._callbacks:
            fn(self)

    def cancel(self) -> None:
        self.cancelled = True
        if self._on_cancel is not None and self._rollout is None:
            self._on_cancel(self)

    def done(self) -> bool:
        return self._rollout is not None

    def result(self, timeout: float | None = None) -> Rollout:
        assert self._rollout is not None
        return self._rollout

    def add_done_callback(self, fn: Callable[[Session], None]) -> None:
        if self._rollout is not None:
            fn(self)
        else:
            self._callbacks.append(fn)


class FirstAttemptHangs:
    """Attempt 0 of every sample never finishes (on cancel it resolves as CANCELLED, on
    the thread that cancels); every later attempt is done before ``start`` returns."""

    def __init__(self) -> None:
        self.version = 0
        self.started: list[RolloutKey] = []
        self.threads: set[str] = set()

    def start(self, task: Task, key: RolloutKey) -> Session:
        self.started.append(key)
        if key.attempt == 0:
            return _Session(on_cancel=lambda s: self._resolve(s, task, key, Status.CANCELLED))
        session = _Session()
        self._resolve(session, task, key, Status.COMPLETED)
        return session

    def _resolve(self, session: _Session, task: Task, key: RolloutKey, status: Status) -> None:
        self.threads.add(threading.current_thread().name)
        if status is Status.CANCELLED:
            session.resolve(Rollout(key=key, task=task, status=status))
            return
        call = Call([1, 2], [3, 4], [-0.5, -0.25], version=self.version)
        session.resolve(Rollout(key=key, task=task, status=status, calls=(call,), reward=1.0))


class ZeroObjective:
    """No model: proximal log-probs of zero (the driver is what is under test)."""

    def packed_log_probs(self, variables: Any, batch: dict[str, np.ndarray]) -> torch.Tensor:
        return torch.zeros(batch["tokens"].shape)  # [rows, width]


def raw_reward(rewards: np.ndarray, trained: np.ndarray) -> np.ndarray:
    return rewards.astype(np.float32)


class _Publisher(RecordingPublisher):
    def __init__(self, source: FirstAttemptHangs | FirstAttemptLags) -> None:
        super().__init__()
        self.source = source

    def load(self, variables: Any, version: int) -> None:
        super().load(variables, version)
        self.source.version = version


def _scheduler(source: FirstAttemptHangs | FirstAttemptLags, **knobs: Any) -> RolloutScheduler:
    """No model, one rollout per group, no running ahead: the driver is what is tested."""
    return RolloutScheduler(
        ZeroObjective(),  # type: ignore[arg-type]
        source,  # type: ignore[arg-type]
        _Publisher(source),
        width=16,
        rows=4,
        groups=1,
        estimator=raw_reward,
        ahead=0,
        max_lag=0,
        **knobs,
    )


def _each_call(scheduler: RolloutScheduler, calls: int) -> Iterator[SchedulerRecord]:
    """Call the scheduler ``calls`` times from one other thread; each call's record."""
    stream = scheduler.tasks(task_dataset(n=8, batch_size=2)).stream()
    with ThreadPoolExecutor(1) as pool:
        for updates in range(calls):
            batch = next(stream)
            pool.submit(scheduler, None, batch, updates=updates).result(timeout=WAIT)
            yield scheduler.history[-1]


def test_finishes_caused_by_a_timeout_are_handled_without_another_event() -> None:
    source = FirstAttemptHangs()
    scheduler = _scheduler(source, timeout=0.2, max_attempts=3)
    try:
        # Each first attempt times out on the driver thread; its cancel resolves the
        # session there and the resubmission is done inside start: nothing else will
        # post an event, so only the driver's own queue can end the call.
        for record in _each_call(scheduler, 2):
            assert record.groups == 2 and dict(record.resubmitted) == {"timeout": 2}
        assert source.threads == {"dew-scheduler"}
        assert {k.attempt for k in source.started} == {0, 1}
    finally:
        scheduler.close()


class FirstAttemptLags:
    """Every session is done before ``start`` returns; attempt 0 reports the version
    before the served one (an engine that had not yet loaded the push), later attempts
    the served one."""

    def __init__(self) -> None:
        self.version = 0
        self.started: list[RolloutKey] = []

    def start(self, task: Task, key: RolloutKey) -> Session:
        self.started.append(key)
        version = max(self.version - 1, 0) if key.attempt == 0 else self.version
        call = Call([1, 2], [3, 4], [-0.5, -0.25], version=version)
        session = _Session()
        session.resolve(
            Rollout(key=key, task=task, status=Status.COMPLETED, calls=(call,), reward=1.0)
        )
        return session


def test_a_resubmission_at_consumption_that_resolves_at_once_is_handled() -> None:
    # No timeout, so no deadline wakes the driver: the stale first attempts are found
    # when the batch is consumed, their resubmissions resolve inside start, and the
    # driver must take those finishes before it waits for anything else.
    source = FirstAttemptLags()
    scheduler = _scheduler(source)
    try:
        for updates, record in enumerate(_each_call(scheduler, 3)):
            stale = 2 if updates else 0  # at update 0 the lagging version is still 0
            assert record.groups == 2 and record.resubmitted.get("stale", 0) == stale
            assert record.version == updates
    finally:
        scheduler.close()
