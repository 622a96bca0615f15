"""A scripted SessionSource the tests drive with events, and a recording publisher."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from dew.core import Call, Rollout, RolloutKey, Session, Status, Task
from dew.data import Dataset

WAIT = 10.0  # seconds; every wait in these tests is for an event, bounded by this


class RecordingPublisher:
    def __init__(self) -> None:
        self.version = 0
        self.loads: list[int] = []

    def load(self, variables: Any, version: int) -> None:
        self.loads.append(version)
        self.version = version


class ScriptedSession:
    def __init__(self, source: ScriptedSource, task: Task, key: RolloutKey) -> None:
        self.source, self.task, self.key = source, task, key
        self.cancelled = False
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[Session], None]] = []
        self._outcome: Rollout | BaseException | None = None
        self._event = threading.Event()

    def cancel(self) -> None:
        with self.source.cond:
            self.cancelled = True
            self.source.cond.notify_all()
        if self.source.resolve_on_cancel and not self._event.is_set():
            self.resolve(Rollout(key=self.key, task=self.task, status=Status.CANCELLED))

    def done(self) -> bool:
        return self._event.is_set()

    def result(self, timeout: float | None = None) -> Rollout:
        if not self._event.wait(timeout):
            raise TimeoutError(self.key)
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        assert self._outcome is not None
        return self._outcome

    def add_done_callback(self, fn: Callable[[Session], None]) -> None:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def resolve(self, outcome: Rollout | BaseException) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._outcome = outcome
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)


class ScriptedSource:
    """Sessions that end only when the test says so."""

    def __init__(self, publisher: RecordingPublisher, *, resolve_on_cancel: bool = True) -> None:
        self.publisher = publisher
        self.resolve_on_cancel = resolve_on_cancel
        self.cond = threading.Condition()
        self.sessions: dict[RolloutKey, ScriptedSession] = {}
        self.order: list[RolloutKey] = []
        self.start_error: BaseException | None = None
        self.start_versions: dict[RolloutKey, int] = {}

    def start(self, task: Task, key: RolloutKey) -> Session:
        if self.start_error is not None:
            raise self.start_error
        s = ScriptedSession(self, task, key)
        with self.cond:
            assert key not in self.sessions, f"{key} started twice"
            self.sessions[key] = s
            self.order.append(key)
            self.start_versions[key] = self.publisher.version
            self.cond.notify_all()
        return s

    def wait_for(self, pred: Callable[[ScriptedSource], bool], what: str = "") -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: pred(self), WAIT):
                raise AssertionError(f"timed out waiting for {what or pred}")

    def wait_started(self, n: int) -> None:
        self.wait_for(lambda s: len(s.sessions) >= n, f"{n} sessions started")

    def running(self) -> list[RolloutKey]:
        with self.cond:
            return [k for k, s in self.sessions.items() if not s.done() and not s.cancelled]

    def finish(
        self,
        key: RolloutKey,
        status: Status = Status.COMPLETED,
        *,
        reward: float | None = 1.0,
        version: int | None = None,
        length: int = 3,
        truncation: str | None = None,
        support: int | None = None,
    ) -> None:
        """Resolve ``key``'s session; ``support``: each sampled token comes with that
        many support ids (filtered sampling), itself first."""
        s = self.sessions[key]
        v = self.start_versions[key] if version is None else version
        calls = []
        if status in (Status.COMPLETED, Status.AGENT_ERROR, Status.TRUNCATED):
            completion = [20 + (i % 50) for i in range(length)]
            rows = None
            if support is not None:
                rows = [[t + j for j in range(support)] for t in completion]
            calls = [
                Call(
                    prompt=[10, 11, 12],
                    completion=completion,
                    log_probs=[-1.0] * length,
                    version=v,
                    support=rows,
                )
            ]
        if status is Status.TRUNCATED and truncation is None:
            truncation = "length"
        if status in (Status.INFRA_ERROR, Status.CANCELLED):
            reward = None
        s.resolve(
            Rollout(
                key=key,
                task=s.task,
                status=status,
                calls=calls,
                reward=reward,
                truncation=truncation,
            )
        )

    def finish_all(self, **kw: Any) -> None:
        for key in self.running():
            self.finish(key, **kw)


@pytest.fixture
def publisher() -> RecordingPublisher:
    return RecordingPublisher()


@pytest.fixture
def source(publisher: RecordingPublisher) -> ScriptedSource:
    return ScriptedSource(publisher)


@pytest.fixture
def trainer() -> Iterator[Callable[..., Future[Any]]]:
    """Runs trainer calls on a thread the test owns, so the test can finish sessions."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-trainer")

    def submit(fn: Callable[..., Any], *args: Any, **kw: Any) -> Future[Any]:
        return pool.submit(fn, *args, **kw)

    yield submit
    pool.shutdown(wait=True, cancel_futures=True)


def task_dataset(n: int = 64, batch_size: int = 2) -> Dataset:
    return Dataset({"task_id": np.arange(n)}, batch_size=batch_size, shuffle=False)
