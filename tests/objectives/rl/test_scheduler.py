"""RolloutScheduler rule by rule, with a scripted source the tests finish by hand."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from dew.core import RolloutKey, Status, Task
from dew.data import Prefetch
from dew.demo.model import make_model
from dew.objectives.rl.config import SchedulerConfig, SchedulerHooks
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import RolloutScheduler, SchedulerRecord, task_ids

from .conftest import WAIT, RecordingPublisher, ScriptedSource, task_dataset

pytestmark = pytest.mark.timeout(60)

# A rollout timeout that must fire once, while the test then beats it on the next
# attempt: long enough that a loaded machine still does (a slow pass, not a failure).
TIMEOUT = 2.0


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return make_model("qwen2", "tiny")


def raw_reward(rewards: np.ndarray, trained: np.ndarray) -> np.ndarray:
    return rewards.astype(np.float32)


@pytest.fixture
def make(
    model: torch.nn.Module,
    source: ScriptedSource,
    publisher: RecordingPublisher,
    trainer: Callable[..., Any],
) -> Iterator[Callable[..., RolloutScheduler]]:
    # Asks for `trainer` so it is torn down after this: the schedulers made here are
    # closed first, which ends any trainer call still blocked in them, and only then is
    # the trainer's thread joined. The other way round, a test failing while a trainer
    # call waits would hang the run in teardown.
    made: list[RolloutScheduler] = []
    records: list[SchedulerRecord] = []

    def build(**kw: Any) -> RolloutScheduler:
        kw.setdefault("width", 64)
        kw.setdefault("rows", 8)
        kw.setdefault("groups", 2)
        if kw["groups"] == 1:
            # One-rollout groups test the mechanics; a group-relative estimator would
            # refuse them (it could learn nothing), so these score by the raw reward.
            kw.setdefault("estimator", raw_reward)
        kw.setdefault("log", records.append)
        s = RolloutScheduler(GRPOObjective(), source, publisher, **kw)
        made.append(s)
        return s

    build.records = records  # type: ignore[attr-defined]
    yield build
    for s in made:
        s.close()


@pytest.mark.skipif(
    os.environ.get("DEW_SEEDED_FAILURE") != "1",
    reason="a deliberately failing test, run only by the test below",
)
def test_seeded_failure_while_a_trainer_call_waits(make, source, trainer, model) -> None:
    s = make()
    stream = Prefetch(s.tasks(task_dataset()).stream(), depth=1)
    trainer(s, model, next(stream), updates=0)  # blocks: no session ever finishes
    source.wait_started(1)
    raise AssertionError("seeded failure")


@pytest.mark.timeout(120)
def test_a_failing_scheduler_test_fails_and_does_not_hang() -> None:
    """The test above, run on its own: it must be reported failed, with its teardown
    done, well within its timeout (it used to hang in teardown)."""
    started = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"{__file__}::test_seeded_failure_while_a_trainer_call_waits",
        ],
        env={**os.environ, "DEW_SEEDED_FAILURE": "1"},
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    took = time.monotonic() - started
    assert out.returncode == 1, out.stdout[-3000:]
    assert "1 failed" in out.stdout and "seeded failure" in out.stdout, out.stdout[-3000:]
    assert "Timeout" not in out.stdout, out.stdout[-3000:]
    assert took < 60, took  # its own timeout is 60 s


def keys_of(source: ScriptedSource, group: int) -> list[RolloutKey]:
    return [k for k in source.order if k.group == group]


# ---------------------------------------------------------------- construction


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"max_lag": 0, "ahead": 1}, "max_lag=0 < ahead + sync_every - 1 = 1"),
        ({"max_lag": 2, "ahead": 1, "sync_every": 3}, "max_lag=2 < ahead + sync_every - 1 = 3"),
        ({"groups": 0}, "groups=0"),
        ({"oversample": -1}, "oversample=-1"),
        ({"admit": 0}, "admit=0"),
        ({"max_attempts": 0}, "max_attempts=0"),
        ({"timeout": 0}, "timeout=0"),
        ({"timeout": -1.0}, "timeout=-1.0"),
        ({"estimator": "ppo"}, "estimator='ppo'"),
        ({"truncation": "drop"}, "truncation='drop'"),
        ({"rows": 0}, "rows=0"),
        ({"width": 0}, "width=0"),
        ({"sync_every": 0}, "sync_every=0"),
    ],
)
def test_construction_refuses_bad_parameters(
    make: Callable[..., RolloutScheduler], kw: dict[str, Any], needle: str
) -> None:
    with pytest.raises(ValueError, match=_re(needle)):
        make(**kw)


def _re(s: str) -> str:
    import re

    return re.escape(s)


def test_task_ids_builds_decimal_ids() -> None:
    assert task_ids({"task_id": np.array([3, 10])}) == [Task("3"), Task("10")]
    with pytest.raises(ValueError, match="task_id"):
        task_ids({"prompt": np.array([1])})
    with pytest.raises(ValueError, match="integers"):
        task_ids({"task_id": np.array([1.5])})


def test_tasks_turns_each_batch_into_the_sources_tasks(make, source, trainer, model) -> None:
    # A tasks function of the caller's: the source sees its tasks (ids and data), each
    # group's samples share the task, and the trained ids are its ids, not task_ids'.
    def lettered(batch: Any) -> list[Task]:
        return [Task(f"q{int(i)}", {"n": int(i) * 10}) for i in batch["task_id"]]

    s = make(ahead=0, max_lag=0, groups=2, tasks=lettered)
    stream = Prefetch(s.tasks(task_dataset()).stream(), depth=0)
    batch = next(stream)
    fut = trainer(s, model, batch, updates=0)
    source.wait_started(4)
    ids = [int(i) for i in batch["task_id"]]
    by_group: dict[int, list[Task]] = {}
    for key in source.order:
        by_group.setdefault(key.group, []).append(source.sessions[key].task)
    assert sorted(by_group.values(), key=lambda tasks: tasks[0].id) == [
        [Task(f"q{i}", {"n": i * 10})] * 2 for i in ids
    ]
    source.finish_all()
    fut.result(WAIT)
    assert s.last_tasks["trained"] == [f"q{i}" for i in ids]


# ---------------------------------------------------------------- synchronous and ahead


def test_synchronous_on_policy(make, source, publisher, trainer, model) -> None:
    s = make(ahead=0, sync_every=1, max_lag=0)
    stream = Prefetch(s.tasks(task_dataset()).stream(), depth=0)
    for updates in range(3):
        batch = next(stream)
        fut = trainer(s, model, batch, updates=updates)
        source.wait_started(2 * 2 * (updates + 1))
        # Synchronous: nothing beyond this batch's own two groups was started.
        assert len(source.sessions) == 4 * (updates + 1)
        source.finish_all(reward=float(updates))
        out = fut.result(WAIT)
        assert out["loss_mask"].shape == (8, 64)
    assert publisher.loads == [0, 1, 2]  # pushed every call
    assert all(
        v == u
        for u, v in enumerate(source.start_versions[k].__index__() for k in source.order[::4])
    )
    assert [r.lag for r in make.records] == [0, 0, 0]


def test_ahead_submits_next_batches_under_served_version(
    make, source, publisher, trainer, model
) -> None:
    s = make(ahead=2, max_lag=2)
    stream = Prefetch(s.tasks(task_dataset()).stream(), depth=2)
    b0 = next(stream)
    fut = trainer(s, model, b0, updates=0)
    # Batches 0, 1 and 2 (2 tasks x 2 samples each) start at the first call.
    source.wait_started(12)
    assert sorted({k.group for k in source.order}) == [0, 1, 2, 3, 4, 5]
    assert all(k.attempt == 0 for k in source.order)
    assert {k.sample for k in source.order} == {0, 1}
    for g in (0, 1):
        for k in keys_of(source, g):
            source.finish(k)
    fut.result(WAIT)
    b1 = next(stream)  # reads batch 3 into the prefetch
    fut = trainer(s, model, b1, updates=1)
    source.wait_started(16)
    new = source.order[12:]
    assert {source.start_versions[k] for k in new} == {1}
    for g in (2, 3):
        for k in keys_of(source, g):
            source.finish(k, version=0)  # submitted under 0, trained at 1: lag 1 <= 2
    fut.result(WAIT)
    assert make.records[-1].lag == 1 and make.records[-1].version == 0


def test_nothing_read_ahead_of_prefetch(make, source, trainer, model) -> None:
    s = make(ahead=3, max_lag=3)
    stream = Prefetch(s.tasks(task_dataset()).stream(), depth=1)
    fut = trainer(s, model, next(stream), updates=0)
    source.wait_started(8)  # only batches 0 and 1 were read
    source.finish_all()
    fut.result(WAIT)
    assert len(source.sessions) == 8


def test_refuses_a_batch_that_is_not_the_oldest(make, source, trainer, model) -> None:
    s = make(ahead=1)
    stream = Prefetch(s.tasks(task_dataset()).stream(), depth=1)
    next(stream)  # batch 0 is the oldest registered
    b1 = next(stream)
    with pytest.raises(ValueError, match="oldest"):
        s(model, b1, updates=0)
    with pytest.raises(ValueError, match="oldest"):
        s(model, {"task_id": np.array([0, 1])}, updates=0)


# ---------------------------------------------------------------- admission by status


def test_admission_by_status_and_resubmission(make, source, trainer, model) -> None:
    s = make(ahead=0, max_lag=0, groups=2)
    stream = Prefetch(s.tasks(task_dataset()).stream(), depth=0)
    fut = trainer(s, model, next(stream), updates=0)
    source.wait_started(4)
    a, b = keys_of(source, 0)
    c, d = keys_of(source, 1)
    source.finish(a, Status.COMPLETED, reward=1.0)
    source.finish(b, Status.AGENT_ERROR, reward=0.0)
    source.finish(c, Status.INFRA_ERROR)
    source.wait_started(5)
    c1 = source.order[4]
    assert c1 == RolloutKey(c.group, c.sample, 1)
    source.finish(c1, Status.CANCELLED)  # cancelled by the source itself: a failure
    source.wait_started(6)
    c2 = source.order[5]
    assert c2.attempt == 2
    source.finish(c2, Status.TRUNCATED, reward=0.3)  # mask: admitted, untrained
    source.finish(d, Status.COMPLETED, reward=0.5)
    out = fut.result(WAIT)
    rec = make.records[-1]
    assert rec.groups == 2
    assert rec.resubmitted == {"infra_error": 1, "cancelled": 1}
    assert rec.metrics["status/truncated"] == 0.25
    assert rec.metrics["status/agent_error"] == 0.25
    # The masked truncation trains nothing; the others train their completions.
    assert out["loss_mask"].sum() == 3 * 3


def test_score_truncation_without_reward_is_unscored(make, source, trainer, model) -> None:
    s = make(ahead=0, max_lag=0, groups=1, truncation="score")
    stream = Prefetch(s.tasks(task_dataset(batch_size=1)).stream(), depth=0)
    fut = trainer(s, model, next(stream), updates=0)
    source.wait_started(1)
    source.finish(source.order[0], Status.TRUNCATED, reward=None)
    source.wait_started(2)
    source.finish(source.order[1], Status.TRUNCATED, reward=0.25)
    out = fut.result(WAIT)
    assert make.records[-1].resubmitted == {"unscored": 1}
    assert out["loss_mask"].sum() == 3  # trained on its verifier reward


def test_max_attempts_abandons_group_rest_still_trains(make, source, trainer, model) -> None:
    s = make(ahead=0, max_lag=0, groups=2, max_attempts=2)
    stream = Prefetch(s.tasks(task_dataset()).stream(), depth=0)
    batch = next(stream)
    fut = trainer(s, model, batch, updates=0)
    source.wait_started(4)
    g0 = keys_of(source, 0)
    source.finish(g0[0], Status.INFRA_ERROR)
    source.wait_started(5)
    source.finish(source.order[4], Status.INFRA_ERROR)  # second failure: out of attempts
    source.wait_for(lambda src: src.sessions[g0[1]].cancelled, "running member cancelled")
    for k in keys_of(source, 1):
        source.finish(k)
    fut.result(WAIT)
    rec = make.records[-1]
    assert rec.abandoned == 1 and rec.groups == 1 and rec.cancelled == 1
    assert rec.resubmitted == {"infra_error": 1}
    assert s.last_tasks["abandoned"] == [str(batch["task_id"][0])]
    assert s.last_tasks["trained"] == [str(batch["task_id"][1])]


# ---------------------------------------------------------------- staleness


def test_stale_finished_rollout_is_discarded_and_resubmitted(
    make, source, publisher, trainer, model
) -> None:
    s = make(ahead=1, max_lag=1, groups=1)
    stream = Prefetch(s.tasks(task_dataset(batch_size=1)).stream(), depth=1)
    fut = trainer(s, model, next(stream), updates=0)
    source.wait_started(2)
    source.finish(source.order[0])
    fut.result(WAIT)
    # Batch 1's rollout reports a call from version 0 ... but we train it at 2.
    fut = trainer(s, model, next(stream), updates=1)
    source.wait_started(3)
    source.finish(source.order[2])  # batch 2, fresh
    source.finish(source.order[1], version=0)  # lag 1 at updates=1: admitted
    fut.result(WAIT)
    assert make.records[-1].lag == 1
    # Now batch 2 finished under version 1 long ago; consume it at updates=3 (lag 2 > 1).
    b2 = next(stream)
    fut = trainer(s, model, b2, updates=3)
    source.wait_for(lambda src: any(k.attempt == 1 for k in src.order), "stale resubmission")
    again = next(k for k in source.order if k.attempt == 1)
    assert again.group == source.order[2].group
    assert source.start_versions[again] == 3
    source.finish_all()
    fut.result(WAIT)
    assert make.records[-1].resubmitted.get("stale") == 1
    assert make.records[-1].lag == 0


def test_running_rollout_past_the_bound_is_cancelled_first(make, source, trainer, model) -> None:
    s = make(ahead=1, max_lag=1, groups=1)
    stream = Prefetch(s.tasks(task_dataset(batch_size=1)).stream(), depth=1)
    fut = trainer(s, model, next(stream), updates=0)
    source.wait_started(2)
    source.finish(source.order[0])
    fut.result(WAIT)
    slow = source.order[1]  # batch 1, submitted under version 0, still running
    fut = trainer(s, model, next(stream), updates=2)  # 2 - 0 > max_lag
    source.wait_for(lambda src: src.sessions[slow].cancelled, "stale running cancel")
    source.wait_for(lambda src: RolloutKey(slow.group, 0, 1) in src.sessions, "resubmission")
    source.finish(RolloutKey(slow.group, 0, 1))
    fut.result(WAIT)
    rec = make.records[-1]
    assert rec.resubmitted == {"stale": 1} and rec.cancelled == 1


# ---------------------------------------------------------------- timeout


def test_timeout_cancels_and_resubmits_as_failed_attempt(make, source, trainer, model) -> None:
    s = make(ahead=0, max_lag=0, groups=1, timeout=TIMEOUT, max_attempts=3)
    stream = Prefetch(s.tasks(task_dataset(batch_size=1)).stream(), depth=0)
    fut = trainer(s, model, next(stream), updates=0)
    source.wait_started(1)
    first = source.order[0]
    # Nothing finishes: the driver cancels it at its deadline, with no trainer event.
    source.wait_for(lambda src: src.sessions[first].cancelled, "timeout cancel")
    source.wait_started(2)
    source.finish(source.order[1])
    fut.result(WAIT)
    assert make.records[-1].resubmitted == {"timeout": 1}


def test_timeout_enforced_while_trainer_trains(make, source, trainer, model) -> None:
    s = make(ahead=1, max_lag=1, groups=1, timeout=TIMEOUT)
    stream = Prefetch(s.tasks(task_dataset(batch_size=1)).stream(), depth=1)
    fut = trainer(s, model, next(stream), updates=0)
    source.wait_started(2)
    source.finish(source.order[0])
    fut.result(WAIT)
    # No trainer call is waiting now; batch 1's rollout still times out and is resubmitted.
    ahead_key = source.order[1]
    source.wait_for(lambda src: src.sessions[ahead_key].cancelled, "timeout while training")
    source.wait_for(lambda src: RolloutKey(ahead_key.group, 0, 1) in src.sessions, "resubmit")


# ---------------------------------------------------------------- long tail


def test_oversample_admits_first_finishers_and_cancels_rest(make, source, trainer, model) -> None:
    s = make(ahead=0, max_lag=0, groups=2, oversample=2)
    stream = Prefetch(s.tasks(task_dataset(batch_size=1)).stream(), depth=0)
    fut = trainer(s, model, next(stream), updates=0)
    source.wait_started(4)
    k = source.order
    source.finish(k[3], reward=1.0, length=2)
    source.finish(k[1], reward=0.0, length=4)
    out = fut.result(WAIT)
    assert source.sessions[k[0]].cancelled and source.sessions[k[2]].cancelled
    rec = make.records[-1]
    assert rec.cancelled == 2 and rec.groups == 1
    assert out["loss_mask"].shape == (8, 64)
    assert out["loss_mask"].sum() == 6
    assert rec.metrics["bias/admitted_len"] == 3.0


def test_admit_takes_first_groups_and_cancels_others(make, source, trainer, model) -> None:
    s = make(ahead=0, max_lag=0, groups=1, admit=2)
    stream = Prefetch(s.tasks(task_dataset(batch_size=4)).stream(), depth=0)
    batch = next(stream)
    fut = trainer(s, model, batch, updates=0)
    source.wait_started(4)
    k = source.order
    source.finish(k[2])
    source.finish(k[0])
    out = fut.result(WAIT)
    assert source.sessions[k[1]].cancelled and source.sessions[k[3]].cancelled
    rec = make.records[-1]
    assert rec.groups == 2 and rec.cancelled == 2
    assert s.last_tasks["trained"] == [str(batch["task_id"][2]), str(batch["task_id"][0])]
    assert sorted(s.last_tasks["dropped"]) == sorted(str(batch["task_id"][i]) for i in (1, 3))
    assert out["tokens"].shape == (8, 64)


# ---------------------------------------------------------------- weights


def test_pushes_first_call_sync_every_and_after_reopen(
    make, source, publisher, trainer, model
) -> None:
    s = make(ahead=1, sync_every=2, max_lag=2, groups=1)
    ds = s.tasks(task_dataset(batch_size=1))
    stream = Prefetch(ds.stream(), depth=1)
    for updates in range(4):
        fut = trainer(s, model, next(stream), updates=updates)
        source.wait_for(lambda src: len(src.running()) >= 1, "a running rollout")
        source.finish_all()
        fut.result(WAIT)
    assert publisher.loads == [0, 2]
    running_before = source.running()
    stream = Prefetch(ds.stream(4), depth=1)  # a resume reopens the stream
    assert all(source.sessions[k].cancelled for k in running_before)
    fut = trainer(s, model, next(stream), updates=4)
    source.wait_for(lambda src: len(src.running()) >= 2, "resubmitted work")
    source.finish_all()
    fut.result(WAIT)
    assert publisher.loads == [0, 2, 4]


def test_partial_rollouts_run_across_pushes(make, source, publisher, trainer, model) -> None:
    s = make(ahead=1, max_lag=1, groups=1)
    stream = Prefetch(s.tasks(task_dataset(batch_size=1)).stream(), depth=1)
    fut = trainer(s, model, next(stream), updates=0)
    source.wait_started(2)
    source.finish(source.order[0])
    fut.result(WAIT)
    partial = source.order[1]
    fut = trainer(s, model, next(stream), updates=1)  # push of version 1 lands
    source.wait_started(3)
    assert not source.sessions[partial].cancelled
    source.finish(partial, version=0)  # its oldest call is version 0: lag 1
    fut.result(WAIT)
    assert publisher.loads == [0, 1]
    assert make.records[-1].version == 0


# ---------------------------------------------------------------- failures and lifecycle


def _raise_here() -> None:
    raise KeyError("environment exploded")


def test_result_exception_propagates_with_traceback(make, source, trainer, model) -> None:
    s = make(ahead=1, max_lag=1, groups=1)
    stream = Prefetch(s.tasks(task_dataset(batch_size=1)).stream(), depth=1)
    fut = trainer(s, model, next(stream), updates=0)
    source.wait_started(2)
    try:
        _raise_here()
    except KeyError as exc:
        error = exc
    source.sessions[source.order[0]].resolve(error)
    with pytest.raises(KeyError, match="environment exploded") as info:
        fut.result(WAIT)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "_raise_here" in frames
    # The batch's other work was cancelled.
    assert source.sessions[source.order[1]].cancelled
    with pytest.raises(RuntimeError, match="reopen"):
        s(model, {"task_id": np.array([0])}, updates=0)


class EnvironmentGone(Exception):
    """A source's own exception type, unknown to the scheduler."""


def _wait_until(pred: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


@pytest.mark.parametrize("kind", [EnvironmentGone, KeyError])
def test_source_failing_between_calls_raises_its_own_exception_next_call(
    model, source, publisher, trainer, kind: type[Exception]
) -> None:
    error = kind("the environment went away")
    agreed: list[BaseException | None] = []
    config = SchedulerConfig(groups=1, ahead=1, max_lag=1, estimator=raw_reward)
    hooks = SchedulerHooks(agree=agreed.append)
    s = RolloutScheduler.from_config(
        GRPOObjective(), source, publisher, config, width=64, rows=8, hooks=hooks
    )
    try:
        stream = Prefetch(s.tasks(task_dataset(batch_size=1)).stream(), depth=1)
        fut = trainer(s, model, next(stream), updates=0)
        source.wait_started(2)
        source.finish(source.order[0])
        fut.result(WAIT)  # the call returned; batch 1's rollout is still running
        assert s.failure is None and agreed == [None]
        source.sessions[source.order[1]].resolve(error)  # breaks while no call waits
        _wait_until(lambda: s.failure is error, "the failure to be recorded")
        with pytest.raises(kind) as info:
            trainer(s, model, next(stream), updates=1).result(WAIT)
        assert info.value is error
        assert any("between trainer calls" in n for n in getattr(error, "__notes__", []))
        assert agreed[-1] is error  # the pool's agreement gets the cause itself
        # Once raised, later calls say the scheduler stopped, chained to the cause.
        with pytest.raises(RuntimeError, match="reopen") as again:
            s(model, {"task_id": np.array([0])}, updates=1)
        assert again.value.__cause__ is error
        assert len(error.__notes__) == 1
        # Reopening the stream clears it.
        stream = Prefetch(s.tasks(task_dataset(batch_size=1)).stream(1), depth=1)
        assert s.failure is None
        fut = trainer(s, model, next(stream), updates=1)
        source.wait_for(lambda src: len(src.running()) >= 1, "resubmitted work")
        source.finish_all()
        fut.result(WAIT)
    finally:
        s.close()


def test_start_exception_propagates(make, source, trainer, model) -> None:
    s = make(ahead=0, max_lag=0, groups=1)
    stream = Prefetch(s.tasks(task_dataset(batch_size=1)).stream(), depth=0)
    source.start_error = ConnectionError("engine down")
    with pytest.raises(ConnectionError, match="engine down"):
        trainer(s, model, next(stream), updates=0).result(WAIT)


def test_bad_rollout_data_raises_naming_the_key(make, source, publisher, trainer, model) -> None:
    s = make(ahead=0, max_lag=0, groups=1)
    stream = Prefetch(s.tasks(task_dataset(batch_size=1)).stream(), depth=0)
    fut = trainer(s, model, next(stream), updates=0)
    source.wait_started(1)
    source.finish(source.order[0], version=7)  # the engines serve 0
    with pytest.raises(ValueError, match=r"group=0, sample=0, attempt=0.*from the future"):
        fut.result(WAIT)


def test_close_cancels_in_flight_and_refuses_calls(make, source, trainer, model) -> None:
    s = make(ahead=1, max_lag=1, groups=1)
    stream = Prefetch(s.tasks(task_dataset(batch_size=1)).stream(), depth=1)
    fut = trainer(s, model, next(stream), updates=0)
    source.wait_started(2)
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        fut.result(WAIT)
    assert all(source.sessions[k].cancelled for k in source.order)
    with pytest.raises(RuntimeError, match="closed"):
        s(model, {"task_id": np.array([0])}, updates=0)
    s.close()  # idempotent


def test_late_superseded_result_is_ignored(make, source, trainer, model) -> None:
    source.resolve_on_cancel = False  # cancelled sessions report later, as real ones may
    s = make(ahead=0, max_lag=0, groups=1, timeout=TIMEOUT)
    stream = Prefetch(s.tasks(task_dataset(batch_size=1)).stream(), depth=0)
    fut = trainer(s, model, next(stream), updates=0)
    source.wait_started(2)  # the first attempt timed out and was resubmitted
    first, second = source.order[:2]
    source.finish(first, reward=1.0, length=7)  # too late: fenced by its attempt
    source.finish(second, reward=0.0, length=2)
    out = fut.result(WAIT)
    assert out["loss_mask"].sum() == 2
    assert make.records[-1].groups == 1


# ---------------------------------------------------------------- packing and records


def test_packing_order_cut_and_rescoring(make, source, trainer, model) -> None:
    s = make(ahead=0, max_lag=0, groups=1, rows=1, width=16)
    stream = Prefetch(s.tasks(task_dataset(batch_size=3)).stream(), depth=0)
    batch = next(stream)
    fut = trainer(s, model, batch, updates=0)
    source.wait_started(3)
    k = source.order
    source.finish(k[2], length=5)  # 3 + 5 = 8 tokens: fits
    source.finish(k[0], length=10)  # 13 tokens: does not fit beside the first -> cut
    source.finish(k[1], length=2)  # 5 tokens: fits after the cut one
    out = fut.result(WAIT)
    rec = make.records[-1]
    assert rec.groups == 2 and rec.cut == 1
    assert s.last_tasks["trained"] == [str(batch["task_id"][2]), str(batch["task_id"][1])]
    assert s.last_tasks["cut"] == [str(batch["task_id"][0])]
    with torch.no_grad():
        expected = GRPOObjective().packed_log_probs(model, out).numpy()
    np.testing.assert_allclose(out["proximal_log_probs"], expected, atol=1e-6)
    assert np.any(out["proximal_log_probs"] != 0)
    assert rec.metrics["bias/cut_len"] == 10.0


def ten_times_reward(rewards: np.ndarray, trained: np.ndarray) -> np.ndarray:
    return np.where(trained, 10.0 * rewards, 0.0)


@pytest.mark.parametrize("estimator", ["group", "group_std", "rloo", ten_times_reward])
def test_the_estimator_sets_the_packed_advantages(make, source, trainer, model, estimator) -> None:
    # Rewards 1, 0, 0.5: every estimator gives its own advantages (group: +-0.5, 0;
    # group_std: +-1.22, 0; rloo: +-0.75, 0; the user's: 10, 0, 5). A scheduler that
    # packed with another estimator than the one it was given would not match.
    from dew.objectives.rl.estimators import advantages

    s = make(ahead=0, max_lag=0, groups=3, estimator=estimator)
    stream = Prefetch(s.tasks(task_dataset(batch_size=1)).stream(), depth=0)
    fut = trainer(s, model, next(stream), updates=0)
    source.wait_started(3)
    rewards = [1.0, 0.0, 0.5]
    for key, reward in zip(source.order, rewards, strict=True):
        source.finish(key, reward=reward, length=3)
    out = fut.result(WAIT)
    want = advantages(estimator, np.array(rewards), np.ones(3, dtype=bool))
    assert len(set(np.round(want, 6))) == 3  # the three rewards tell apart
    trained = out["advantages"][out["loss_mask"] > 0]  # 3 completion tokens a rollout
    np.testing.assert_allclose(np.sort(trained), np.sort(np.repeat(want, 3)), rtol=1e-5)
    # last_samples: each trained rollout with its own advantage (what a sample log shows).
    got = {r.reward: a for r, a in s.last_samples}
    assert sorted(got) == sorted(rewards)
    np.testing.assert_allclose([got[r] for r in rewards], want, rtol=1e-5)


def test_support_capacity_packs_the_support_of_filtered_sampling(
    make, source, trainer, model
) -> None:
    # Two rollouts of 3 tokens, each token with 4 support ids: 24 ids fit the 32 a
    # row holds. The rescored log-probs are renormalized over those ids.
    s = make(ahead=0, max_lag=0, groups=2, rows=2, width=16, support_capacity=32)
    stream = Prefetch(s.tasks(task_dataset(batch_size=1)).stream(), depth=0)
    fut = trainer(s, model, next(stream), updates=0)
    source.wait_started(2)
    source.finish(source.order[0], reward=1.0, support=4)
    source.finish(source.order[1], reward=0.0, support=4)
    out = fut.result(WAIT)
    assert out["support"].shape == (2, 32)
    assert int((out["support"] >= 0).sum()) == 2 * 3 * 4
    with torch.no_grad():
        fresh = GRPOObjective().packed_log_probs(model, out).numpy()
        whole = (
            GRPOObjective()
            .packed_log_probs(model, {k: v for k, v in out.items() if not k.startswith("support")})
            .numpy()
        )
    np.testing.assert_allclose(out["proximal_log_probs"], fresh, atol=1e-6)
    trained = out["loss_mask"] > 0
    # Over 4 ids instead of the whole vocabulary: every trained log-prob is higher.
    assert np.all(out["proximal_log_probs"][trained] > whole[trained])


def test_record_fields(make, source, trainer, model) -> None:
    logged: list[SchedulerRecord] = []
    s = make(ahead=0, max_lag=0, groups=2, log=logged.append)
    stream = Prefetch(s.tasks(task_dataset(batch_size=1)).stream(), depth=0)
    fut = trainer(s, model, next(stream), updates=0)
    source.wait_started(2)
    source.finish(source.order[0], reward=1.0)
    source.finish(source.order[1], reward=0.0)
    fut.result(WAIT)
    rec = logged[-1]
    assert list(s.history) == logged == [rec]  # one record per call, to the given log
    assert (rec.updates, rec.version, rec.lag, rec.groups) == (0, 0, 0, 1)
    assert rec.cancelled == 0 and rec.abandoned == 0 and rec.cut == 0
    assert 0 < rec.waited < WAIT  # the call waited for the two rollouts the test finished
    m = rec.metrics
    assert m["reward/mean"] == 0.5 and m["merge_ratio"] == 1.0
    assert m["status/completed"] == 1.0 and m["trained_tokens"] == 6
    assert {"latency_p50", "latency_p99", "latency_max", "token_lag_mean"} <= set(m)
