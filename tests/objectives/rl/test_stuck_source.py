"""A source whose rollouts ignore their cancel: counted, then named, never silent."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dew.core import Call, Rollout, RolloutKey, Status, Task, ThreadedSource
from dew.data import Prefetch
from dew.demo.model import make_model
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import RolloutScheduler, SourceStuck

from .conftest import RecordingPublisher, task_dataset


class DeafToStop(ThreadedSource):
    """Task 0's rollouts block until the test releases them, whatever ``stop`` says."""

    def __init__(self, release: threading.Event, **kw: float) -> None:
        super().__init__(workers=2, **kw)  # type: ignore[arg-type]
        self.release = release

    def run(self, task: Task, key: RolloutKey, stop: threading.Event) -> Rollout:
        if task.id == "0":
            self.release.wait(60.0)
        call = Call(prompt=[5, 6], completion=[7, 8], log_probs=[-1.0, -1.0], version=0)
        reward = float(key.sample % 2)
        return Rollout(key=key, task=task, status=Status.COMPLETED, calls=[call], reward=reward)


def test_threaded_source_lists_rollouts_running_past_their_cancel() -> None:
    release = threading.Event()
    source = DeafToStop(release, stuck_after=0.05)  # a non-default grace takes effect
    try:
        session = source.start(Task("0"), RolloutKey(group=0, sample=0, attempt=0))
        assert source.stuck() == []  # running, not cancelled
        session.cancel()
        time.sleep(0.1)
        assert source.stuck() == [session.key] and source.workers == 2
    finally:
        release.set()
        source.close()
    with pytest.raises(ValueError, match="stuck_after must be > 0 seconds"):
        ThreadedSource(stuck_after=0)


@pytest.mark.timeout(60)
def test_the_scheduler_counts_stuck_rollouts_and_stops_when_no_worker_is_left() -> None:
    release = threading.Event()
    source = DeafToStop(release, stuck_after=0.1)
    model = make_model("qwen2", "tiny", seed=0)
    scheduler = RolloutScheduler(
        GRPOObjective(),
        source,
        RecordingPublisher(),
        width=16,
        rows=8,
        groups=2,
        ahead=0,
        max_lag=0,
        timeout=0.3,
        max_attempts=2,
    )
    try:
        stream = Prefetch(scheduler.tasks(task_dataset(batch_size=1)).stream(), depth=1)
        # Task 0's two attempts time out and are abandoned, but both keep a worker.
        with pytest.raises(SourceStuck, match=r"all 2 worker threads are held .*group=") as err:
            for updates in range(5):
                scheduler(model, next(stream), updates=updates)
                stuck = scheduler.history[-1].metrics["source/stuck"]
                assert stuck < 2
        assert "run() must return once its stop event is set" in str(err.value)
    finally:
        release.set()  # lets the deaf rollouts end, so closing can join their threads
        scheduler.close()
        source.close()


@pytest.mark.timeout(60)
def test_close_is_bounded_and_names_the_rollouts_it_leaves(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = threading.Event()
    source = DeafToStop(release, stuck_after=0.3)
    try:
        stuck = source.start(Task("0"), RolloutKey(group=7, sample=1, attempt=0))
        done = source.start(Task("1"), RolloutKey(group=8, sample=0, attempt=0))
        assert done.result(timeout=10).status is Status.COMPLETED
        t0 = time.monotonic()
        with caplog.at_level("WARNING", logger="dew.core"):
            source.close()
        assert 0.25 < time.monotonic() - t0 < 5  # stuck_after, not the rollout's 60 s
        assert not stuck.done()
        (warning,) = [r.getMessage() for r in caplog.records if r.name == "dew.core"]
        assert "DeafToStop closed with 1 rollouts still running" in warning
        assert "group=7, sample=1, attempt=0" in warning
    finally:
        release.set()


@pytest.mark.timeout(60)
def test_a_process_whose_source_is_stuck_still_exits() -> None:
    """A stuck worker thread is a daemon: after close, the process ends normally."""
    script = """
import threading
from dew.core import RolloutKey, Task
from tests.objectives.rl.test_stuck_source import DeafToStop
source = DeafToStop(threading.Event(), stuck_after=0.2)
source.start(Task("0"), RolloutKey(group=0, sample=0, attempt=0))
source.close()
print("closed", flush=True)
"""
    root = Path(__file__).parents[3]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "closed\n"
    assert "1 rollouts still running" in done.stderr  # logging's last resort prints it
