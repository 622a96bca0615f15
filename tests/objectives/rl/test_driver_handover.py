"""The driver hands a complete batch over before it starts the rollouts the same call
submits (the trainer need not wait for them), and a driver thread that died does not
leave ``close`` waiting for an answer."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from dew.core import RolloutKey, Session, Task
from dew.data import Prefetch
from dew.demo.model import make_model
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import RolloutScheduler

from .conftest import WAIT, RecordingPublisher, ScriptedSource, task_dataset

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return make_model("qwen2", "tiny")


class GatedSource(ScriptedSource):
    """``start`` blocks while the gate is shut (on the driver thread, like a slow
    engine submission); ``entered`` is set once a start is held there."""

    def __init__(self, publisher: RecordingPublisher) -> None:
        super().__init__(publisher)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def start(self, task: Task, key: RolloutKey) -> Session:
        if not self.gate.is_set():
            self.entered.set()
            if not self.gate.wait(WAIT):
                raise AssertionError("the gate was never opened")
        return super().start(task, key)


@pytest.fixture
def gated(publisher: RecordingPublisher) -> GatedSource:
    return GatedSource(publisher)


@pytest.fixture
def scheduler(gated: GatedSource, publisher: RecordingPublisher) -> Iterator[RolloutScheduler]:
    s = RolloutScheduler(
        GRPOObjective(), gated, publisher, width=64, rows=8, groups=2, ahead=1, max_lag=1
    )
    yield s
    gated.gate.set()
    s.close()


def test_a_complete_batch_is_handed_over_before_the_calls_new_rollouts_start(
    scheduler: RolloutScheduler, gated: GatedSource, trainer, model
) -> None:
    stream = Prefetch(scheduler.tasks(task_dataset()).stream(), depth=1)
    fut = trainer(scheduler, model, next(stream), updates=0)
    gated.wait_started(8)  # batches 0 and 1, two tasks of two samples each
    gated.finish_all()  # both complete: batch 1 is ready before its call
    fut.result(WAIT)
    gated.gate.clear()  # from here every start blocks on the driver thread
    fut = trainer(scheduler, model, next(stream), updates=1)
    # The call submits batch 2; its starts are held at the gate, and the trainer has
    # its batch already.
    assert gated.entered.wait(WAIT), "the call started no rollout"
    fut.result(WAIT)
    assert len(gated.sessions) == 8  # nothing of batch 2 has started yet
    gated.gate.set()
    gated.wait_started(12)
    assert {gated.start_versions[k] for k in gated.order[8:]} == {1}
    assert {k.group for k in gated.order[8:]} == {4, 5}


def test_the_call_waits_for_starts_when_its_batch_is_not_complete(
    scheduler: RolloutScheduler, gated: GatedSource, trainer, model
) -> None:
    stream = Prefetch(scheduler.tasks(task_dataset()).stream(), depth=1)
    fut = trainer(scheduler, model, next(stream), updates=0)
    gated.wait_started(8)
    for k in [k for k in gated.order if k.group in (0, 1)]:
        gated.finish(k)
    fut.result(WAIT)
    # Batch 1 (groups 2, 3) still runs: the next call starts batch 2 and then waits.
    fut = trainer(scheduler, model, next(stream), updates=1)
    gated.wait_started(12)
    assert not fut.done()
    for k in [k for k in gated.order if k.group in (2, 3)]:
        gated.finish(k)
    fut.result(WAIT)


class Fatal(BaseException):
    """Not an Exception: it ends the driver thread (the driver never swallows it)."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_close_returns_after_the_driver_thread_died(
    publisher: RecordingPublisher, trainer, model
) -> None:
    source = ScriptedSource(publisher)
    source.start_error = Fatal("the interpreter is going down")
    s = RolloutScheduler(GRPOObjective(), source, publisher, width=64, rows=8, groups=2)
    stream = Prefetch(s.tasks(task_dataset()).stream(), depth=0)
    done = threading.Event()
    with pytest.raises(Fatal):
        trainer(s, model, next(stream), updates=0).result(WAIT)

    def close() -> None:
        s.close()
        done.set()

    closer = threading.Thread(target=close, name="test-close", daemon=True)
    closer.start()
    closer.join(WAIT)
    assert done.is_set(), "close waited on a driver thread that had died"
