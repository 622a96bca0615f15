"""The live pieces the harness tests share: a spy over the real engine, the task, the
verifier that counts calls."""

from __future__ import annotations

import threading
from collections.abc import Hashable
from concurrent.futures import Future
from typing import Any

from dew.core import Call, SamplingParams, Task
from dew.demo.model import make_tokenizer
from dew.gateway import HarnessOutcome
from dew.serving import RolloutServer

TOK = make_tokenizer()
WAIT = 60.0  # seconds; every wait is on an event or a result, bounded by this
TASK = Task("3", {"question": "What is 1+2?", "answer": "3"})


class Spy:
    """The real server; counts requests entering it and keeps what they asked for and
    what it returned or raised, for the test to compare against."""

    def __init__(self, server: RolloutServer) -> None:
        self.server = server
        self.calls: list[Call] = []
        self.params: list[SamplingParams] = []
        self.affinities: list[Hashable | None] = []
        self.errors: list[BaseException] = []
        self.cond = threading.Condition()
        self.entered = 0

    @property
    def version(self) -> int:
        return self.server.version

    @property
    def max_len(self) -> int:
        return self.server.max_len

    def submit(
        self,
        prompt: Any,
        params: SamplingParams,
        *,
        stop: threading.Event | None = None,
        affinity: Hashable | None = None,
    ) -> Future[Call]:
        with self.cond:
            self.entered += 1
            self.params.append(params)
            self.affinities.append(affinity)
            self.cond.notify_all()
        try:
            future = self.server.submit(prompt, params, stop=stop, affinity=affinity)
        except BaseException as exc:
            self._failed(exc)
            raise
        future.add_done_callback(self._done)
        return future

    def abort(self, future: Future[Call]) -> None:
        self.server.abort(future)

    def generate(
        self,
        prompt: Any,
        params: SamplingParams,
        *,
        stop: threading.Event | None = None,
        affinity: Hashable | None = None,
    ) -> Call:
        return self.submit(prompt, params, stop=stop, affinity=affinity).result()

    def _done(self, future: Future[Call]) -> None:
        exc = future.exception()
        if exc is not None:
            self._failed(exc)
            return
        with self.cond:
            self.calls.append(future.result())

    def _failed(self, exc: BaseException) -> None:
        with self.cond:
            self.errors.append(exc)
            self.cond.notify_all()

    def wait_entered(self, n: int, timeout: float = WAIT) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.entered >= n, timeout)

    def wait_errors(self, n: int, timeout: float = WAIT) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: len(self.errors) >= n, timeout)


def length_verifier(task: Task, outcome: HarnessOutcome) -> float:
    return float(len(outcome.calls))
