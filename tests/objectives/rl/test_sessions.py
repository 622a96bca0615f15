"""Session types, ThreadedSource, chain merging, truncation policies and session metrics."""

from __future__ import annotations

import dataclasses
import re
import threading
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from dew.core import Call, Rollout, RolloutKey, Session, SessionSource, Status, Task, ThreadedSource
from dew.objectives.rl.chains import chains, merge_ratio
from dew.objectives.rl.metrics import session_metrics
from dew.objectives.rl.truncation import TRUNCATION_POLICIES, Truncation, truncation_policy

WAIT = 10.0  # seconds; every wait here is for an event and bounded by this

KEY = RolloutKey(group=3, sample=1, attempt=2)
TASK = Task("t7")


def call(
    prompt: Any = (1, 2),
    completion: Any = (3, 4, 5),
    log_probs: Any = None,
    version: Any = 0,
    **kw: Any,
) -> Call:
    if log_probs is None:
        log_probs = [-0.5] * len(completion)
    return Call(prompt=prompt, completion=completion, log_probs=log_probs, version=version, **kw)


def rollout(status: Any = Status.COMPLETED, calls: Any = None, **kw: Any) -> Rollout:
    if calls is None:
        calls = [call()]
    kw.setdefault("reward", 1.0 if status in (Status.COMPLETED, Status.AGENT_ERROR) else None)
    return Rollout(key=KEY, task=TASK, status=status, calls=calls, **kw)


# ------------------------------------------------------------------------ validation


def _names_key(message: str) -> bool:
    return str(KEY) in message


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: rollout(calls=[call(log_probs=[-1.0, -1.0])]), r"calls\[0\]\.log_probs"),
        (
            lambda: rollout(calls=[call(), call(prompt=[1], completion=[9], log_probs=[])]),
            r"calls\[1\]\.log_probs",
        ),
        (
            lambda: rollout(calls=[call(support=[[3], [4]])]),
            r"calls\[0\]\.support has 2 rows but completion has 3",
        ),
        (lambda: rollout(calls=[call(version=-1)]), r"calls\[0\]\.version must be >= 0"),
        (lambda: rollout(calls=[call(version=True)]), r"calls\[0\]\.version must be an int"),
        (lambda: rollout(calls=[call(version=1.5)]), r"calls\[0\]\.version must be an int"),
        (lambda: rollout(status="completed"), r"unknown status 'completed'"),
        (lambda: rollout(calls=[call(completion=[], log_probs=[])]), r"calls\[0\]\.completion"),
        (lambda: rollout(calls=[call(prompt=[])]), r"calls\[0\]\.prompt is empty"),
        (lambda: rollout(reward=float("nan")), r"reward must be a finite number"),
        (lambda: rollout(reward=float("inf")), r"reward must be a finite number"),
        (lambda: rollout(reward="1"), r"reward must be a finite number"),
        (
            lambda: rollout(components={"format": float("nan")}),
            r"reward component 'format' must be finite",
        ),
        (
            lambda: rollout(Status.TRUNCATED, reward=0.0),
            r"TRUNCATED rollout needs truncation",
        ),
        (lambda: rollout(Status.COMPLETED, calls=[]), r"COMPLETED needs at least one call"),
        (lambda: rollout(Status.AGENT_ERROR, calls=[]), r"AGENT_ERROR needs at least one call"),
        (
            lambda: rollout(Status.TRUNCATED, calls=[], truncation="length"),
            r"TRUNCATED needs at least one call",
        ),
        (
            lambda: rollout(calls=[call(support=[[3, 8], [7, 8], [5]])]),
            r"calls\[0\]\.support\[1\] does not contain the sampled token 4",
        ),
        (
            lambda: rollout(calls=[call(support=[[3], [], [5]])]),
            r"calls\[0\]\.support\[1\] is empty",
        ),
        (lambda: rollout(calls=[call(temperature=0.0)]), r"calls\[0\]\.temperature"),
        (lambda: rollout(calls=[{"prompt": [1]}]), r"calls\[0\] must be a Call, got dict"),
    ],
)
def test_bad_rollout_names_key_and_field(build: Callable[[], Rollout], field: str) -> None:
    with pytest.raises(ValueError, match=field) as info:
        build()
    assert _names_key(str(info.value)), str(info.value)


def test_rollout_key_must_be_a_rollout_key() -> None:
    with pytest.raises(ValueError, match=r"Rollout\.key must be a RolloutKey"):
        Rollout(key=(3, 1, 2), task=TASK, status=Status.COMPLETED)  # type: ignore[arg-type]


def test_good_rollouts_construct() -> None:
    # Unscored statuses need no calls; numpy sequences and numpy versions are accepted.
    assert rollout(Status.INFRA_ERROR, calls=[], error="boom").calls == []
    assert rollout(Status.CANCELLED, calls=[]).oldest_version is None
    r = rollout(
        Status.TRUNCATED,
        calls=[
            call(
                prompt=np.array([1, 2]),
                completion=np.array([3, 4]),
                log_probs=np.array([-0.1, -0.2]),
                version=np.int64(5),
                support=np.array([[3, 9], [4, 9]]),
            ),
            call(version=2),
        ],
        truncation="length",
        reward=0.0,
    )
    assert r.completion_tokens == 5
    assert r.oldest_version == 2
    assert str(KEY) == "rollout(group=3, sample=1, attempt=2)"


# ------------------------------------------------------------------------ ThreadedSource


class Scripted(ThreadedSource):
    """run() does what the test registered for the sample, on the pool's threads."""

    def __init__(self, workers: int, behave: Callable[[Task, RolloutKey, threading.Event], Any]):
        super().__init__(workers=workers)
        self.behave = behave
        self.ran: list[RolloutKey] = []
        self.lock = threading.Lock()

    def run(self, task: Task, key: RolloutKey, stop: threading.Event) -> Rollout:
        with self.lock:
            self.ran.append(key)
        return self.behave(task, key, stop)


def done_rollout(task: Task, key: RolloutKey) -> Rollout:
    return Rollout(key=key, task=task, status=Status.COMPLETED, calls=[call()], reward=1.0)


def k(sample: int) -> RolloutKey:
    return RolloutKey(0, sample, 0)


@pytest.mark.timeout(30)
def test_cancel_while_running_sets_stop_and_resolves_cancelled() -> None:
    entered = threading.Event()
    saw_stop: list[bool] = []

    def behave(task: Task, key: RolloutKey, stop: threading.Event) -> Rollout:
        entered.set()
        saw_stop.append(stop.wait(WAIT))
        return done_rollout(task, key)  # a source that ignores the stop: still CANCELLED

    with Scripted(1, behave) as src:
        s = src.start(TASK, k(0))
        assert isinstance(s, Session)
        assert entered.wait(WAIT)
        assert not s.done()
        s.cancel()
        r = s.result(WAIT)
        s.cancel()  # again, after the end: harmless
    assert saw_stop == [True]
    assert s.done()
    assert r.status is Status.CANCELLED and r.key == k(0) and r.task == TASK
    assert r.reward is None
    assert len(r.calls) == 1  # the partial work is kept


@pytest.mark.timeout(30)
def test_cancel_queued_behind_busy_worker_resolves_at_once() -> None:
    release = threading.Event()
    entered = threading.Event()

    def behave(task: Task, key: RolloutKey, stop: threading.Event) -> Rollout:
        entered.set()
        assert release.wait(WAIT)
        return done_rollout(task, key)

    fired: list[Session] = []
    with Scripted(1, behave) as src:
        busy = src.start(TASK, k(0))
        assert entered.wait(WAIT)
        queued = src.start(TASK, k(1))
        queued.add_done_callback(fired.append)
        assert not queued.done()
        queued.cancel()
        # Resolved by cancel() itself, while the only worker is still busy.
        assert queued.done()
        assert fired == [queued]
        r = queued.result(0)
        assert r.status is Status.CANCELLED and r.key == k(1) and r.calls == ()
        release.set()
        assert busy.result(WAIT).status is Status.COMPLETED
    assert src.ran == [k(0)]  # run() never saw the cancelled session
    assert fired == [queued]


def _explode(key: RolloutKey) -> None:
    raise KeyError(f"environment broke for {key}")


@pytest.mark.timeout(30)
def test_exception_in_run_is_reraised_with_its_traceback() -> None:
    def behave(task: Task, key: RolloutKey, stop: threading.Event) -> Rollout:
        _explode(key)
        raise AssertionError("unreachable")

    fired: list[Session] = []
    with Scripted(2, behave) as src:
        s = src.start(TASK, k(4))
        s.add_done_callback(fired.append)
        with pytest.raises(KeyError, match=re.escape(str(k(4)))) as info:
            s.result(WAIT)
        with pytest.raises(KeyError):  # every result() call raises it again
            s.result(0)
    frames = traceback.extract_tb(info.value.__traceback__)
    names = [f.name for f in frames]
    assert names[-1] == "_explode"
    assert names[-2] == "behave"
    assert "run" in names
    assert frames[-1].filename == __file__
    assert frames[-1].line == 'raise KeyError(f"environment broke for {key}")'
    assert fired == [s]


@pytest.mark.timeout(30)
def test_done_callbacks_run_exactly_once() -> None:
    release = threading.Event()

    def behave(task: Task, key: RolloutKey, stop: threading.Event) -> Rollout:
        assert release.wait(WAIT)
        return done_rollout(task, key)

    calls: list[tuple[str, Session, str]] = []
    finished = threading.Event()

    def cb(name: str) -> Callable[[Session], None]:
        def fn(s: Session) -> None:
            calls.append((name, s, threading.current_thread().name))
            if name == "b":
                finished.set()

        return fn

    with Scripted(1, behave) as src:
        s = src.start(TASK, k(0))
        s.add_done_callback(cb("a"))
        s.add_done_callback(cb("b"))
        release.set()
        assert finished.wait(WAIT)
        assert s.result(WAIT).status is Status.COMPLETED
        s.add_done_callback(cb("late"))  # after completion: at once, on this thread
        s.cancel()  # a cancel after the end fires nothing again
    assert [name for name, _, _ in calls] == ["a", "b", "late"]
    assert all(session is s for _, session, _ in calls)
    worker = calls[0][2]
    assert worker.startswith("Scripted") and calls[1][2] == worker  # the worker resolved it
    assert calls[2][2] == threading.current_thread().name


@pytest.mark.timeout(30)
def test_pool_is_bounded_by_workers() -> None:
    n = 5
    release = [threading.Event() for _ in range(n)]
    cond = threading.Condition()
    active: list[int] = []
    seen_max = [0]
    threads: set[int] = set()

    def behave(task: Task, key: RolloutKey, stop: threading.Event) -> Rollout:
        with cond:
            active.append(key.sample)
            seen_max[0] = max(seen_max[0], len(active))
            threads.add(threading.get_ident())
            cond.notify_all()
        assert release[key.sample].wait(WAIT)
        with cond:
            active.remove(key.sample)
        return done_rollout(task, key)

    with Scripted(2, behave) as src:
        sessions = [src.start(TASK, k(i)) for i in range(n)]
        with cond:
            assert cond.wait_for(lambda: len(active) == 2, WAIT)
            assert sorted(active) == [0, 1]  # FIFO: the first two run, the rest wait
        assert not any(s.done() for s in sessions)
        # Release one at a time: each release lets exactly the next queued one in.
        for i in range(n):
            release[i].set()
            assert sessions[i].result(WAIT).status is Status.COMPLETED
            if i + 2 < n:
                with cond:
                    assert cond.wait_for(lambda i=i: i + 2 in active, WAIT)
                    assert len(active) <= 2
    assert seen_max[0] == 2
    assert len(threads) == 2  # an unbounded pool would have used one thread per session


@pytest.mark.timeout(30)
def test_close_cancels_running_drops_queued_and_joins() -> None:
    entered = threading.Event()
    stopped: list[bool] = []

    def behave(task: Task, key: RolloutKey, stop: threading.Event) -> Rollout:
        entered.set()
        stopped.append(stop.wait(WAIT))
        return done_rollout(task, key)

    src = Scripted(1, behave)
    running = src.start(TASK, k(0))
    assert entered.wait(WAIT)
    queued = [src.start(TASK, k(i)) for i in (1, 2)]
    fired: list[Session] = []
    for s in [running, *queued]:
        s.add_done_callback(fired.append)
    src.close()
    assert stopped == [True]
    assert all(s.done() for s in [running, *queued])
    assert [s.result(0).status for s in [running, *queued]] == [Status.CANCELLED] * 3
    assert src.ran == [k(0)]
    assert sorted(fired, key=id) == sorted([running, *queued], key=id)
    assert not [t for t in threading.enumerate() if t.name.startswith("Scripted")]
    with pytest.raises(RuntimeError, match="Scripted is closed"):
        src.start(TASK, k(3))
    src.close()  # idempotent


def test_threaded_source_refuses_no_workers() -> None:
    with pytest.raises(ValueError, match="workers must be >= 1, got 0"):
        ThreadedSource(workers=0)


@pytest.mark.timeout(30)
def test_threaded_source_is_a_session_source() -> None:
    with Scripted(1, lambda t, key, stop: done_rollout(t, key)) as src:
        assert isinstance(src, SessionSource)
        assert src.start(TASK, k(0)).result(WAIT).status is Status.COMPLETED


# ------------------------------------------------------------------------ chains


def test_extending_prompt_is_one_chain_with_untrained_observation() -> None:
    first = call(
        prompt=[1, 2], completion=[3, 4], log_probs=[-0.1, -0.2], version=4, support=[[3, 8], [4]]
    )
    # The second prompt is the chain so far plus observation tokens 5, 6.
    second = Call(
        prompt=np.array([1, 2, 3, 4, 5, 6]),
        completion=np.array([7]),
        log_probs=np.array([-0.3]),
        version=5,
        support=[[7, 1, 2]],
    )
    (ch,) = chains([first, second])
    np.testing.assert_array_equal(ch.tokens, [1, 2, 3, 4, 5, 6, 7])
    np.testing.assert_array_equal(ch.trained, [0, 0, 1, 1, 0, 0, 1])
    np.testing.assert_allclose(ch.log_probs, [0, 0, -0.1, -0.2, 0, 0, -0.3])
    np.testing.assert_array_equal(ch.versions, [4, 4, 4, 4, 5, 5, 5])
    assert ch.trained.dtype == bool and ch.tokens.dtype == np.int64
    assert [list(r) for r in ch.support] == [[3, 8], [4], [7, 1, 2]]


def test_prompt_equal_to_chain_extends_without_observation() -> None:
    (ch,) = chains([call(prompt=[1], completion=[2]), call(prompt=[1, 2], completion=[3])])
    np.testing.assert_array_equal(ch.tokens, [1, 2, 3])
    np.testing.assert_array_equal(ch.trained, [0, 1, 1])
    assert ch.support == ()


@pytest.mark.parametrize(
    "second_prompt",
    [[1, 2, 9, 4, 5], [1, 2], [7, 7, 7, 7, 7, 7]],
    ids=["differs", "shorter", "unrelated"],
)
def test_non_extending_prompt_opens_new_chain(second_prompt: list[int]) -> None:
    a = call(prompt=[1, 2], completion=[3, 4], version=1)
    b = call(prompt=second_prompt, completion=[8], log_probs=[-2.0], version=2)
    c = call(prompt=[*second_prompt, 8, 6], completion=[5], log_probs=[-3.0], version=3)
    one, two = chains([a, b, c])  # c extends b's chain, not a's
    np.testing.assert_array_equal(one.tokens, [1, 2, 3, 4])
    np.testing.assert_array_equal(one.trained, [0, 0, 1, 1])
    np.testing.assert_array_equal(one.versions, [1, 1, 1, 1])
    np.testing.assert_array_equal(two.tokens, [*second_prompt, 8, 6, 5])
    np.testing.assert_array_equal(two.trained, [0] * len(second_prompt) + [1, 0, 1])
    np.testing.assert_allclose(two.log_probs, [0] * len(second_prompt) + [-2.0, 0, -3.0])
    np.testing.assert_array_equal(two.versions, [2] * (len(second_prompt) + 1) + [3, 3])


def test_chains_of_nothing() -> None:
    assert chains([]) == []


def _multi(*prompts: list[int]) -> Rollout:
    calls = [call(prompt=[1, 2], completion=[3])]
    calls += [call(prompt=p, completion=[9]) for p in prompts]
    return rollout(calls=calls)


def test_merge_ratio() -> None:
    single = rollout()
    merged = _multi([1, 2, 3, 4], [1, 2, 3, 4, 9, 5])  # both later calls extend
    half = _multi([1, 2, 3, 4], [6])  # one extends, one restarts
    none = _multi([5])
    assert merge_ratio([]) == 1.0
    assert merge_ratio([single]) == 1.0
    assert merge_ratio([merged]) == 1.0
    assert merge_ratio([half]) == 0.5
    assert merge_ratio([none]) == 0.0
    assert merge_ratio([single, merged, half, none]) == pytest.approx(3 / 5)


# ------------------------------------------------------------------------ truncation


@pytest.mark.parametrize(
    ("name", "reward", "expected"),
    [
        ("mask", 0.5, Truncation(trained=False, reward=0.5)),
        ("mask", None, Truncation(trained=False, reward=None)),
        ("score", 0.5, Truncation(trained=True, reward=0.5)),
        ("score", None, Truncation(trained=False, reward=None, resubmit="unscored")),
        ("zero", 0.5, Truncation(trained=True, reward=0.0)),
        ("zero", None, Truncation(trained=True, reward=0.0)),
    ],
)
def test_truncation_policies(name: str, reward: float | None, expected: Truncation) -> None:
    r = rollout(Status.TRUNCATED, reward=reward, truncation="length")
    assert truncation_policy(name)(r) == expected
    assert TRUNCATION_POLICIES[name](r) == expected


def test_truncation_policy_registry() -> None:
    assert sorted(TRUNCATION_POLICIES) == ["mask", "score", "zero"]
    with pytest.raises(TypeError):
        TRUNCATION_POLICIES["drop"] = TRUNCATION_POLICIES["mask"]  # type: ignore[index]
    with pytest.raises(ValueError, match=r"truncation='drop' is not one of \['mask', 'score'"):
        truncation_policy("drop")


# ------------------------------------------------------------------------ metrics


def _stamped(r: Rollout, latency: float) -> Rollout:
    return dataclasses.replace(r, submitted=100.0, finished=100.0 + latency)


def test_session_metrics_by_hand() -> None:
    rs = [
        _stamped(
            rollout(calls=[call(completion=[3, 4], log_probs=[0, 0])], components={"fmt": 1.0}),
            1.0,
        ),
        _stamped(rollout(Status.AGENT_ERROR, reward=0.0, components={"fmt": 0.0}), 2.0),
        _stamped(
            rollout(Status.TRUNCATED, calls=[call(completion=[3], log_probs=[0])], truncation="x"),
            3.0,
        ),
        _stamped(rollout(Status.INFRA_ERROR, calls=[]), 4.0),
        rollout(Status.COMPLETED, reward=0.5, calls=[call(), call(prompt=[1, 2, 3, 4, 5])]),
    ]
    # Two rows; segments 0 are padding. Row 0 is one trained chain, row 1 holds a masked
    # (untrained) completion token at position 2 and a trained token of version 2.
    batch = {
        "segments": np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 2, 2, 0]]),
        "loss_mask": np.array([[0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 0]], dtype=np.float32),
        "completion_mask": np.array([[0, 0, 1, 1, 0, 0], [0, 0, 1, 0, 1, 0]], dtype=bool),
        "versions": np.array([[4, 4, 4, 4, -1, -1], [3, 3, 3, 2, 2, -1]]),
    }
    m = session_metrics(rs, batch, updates=5)
    assert m["merge_ratio"] == 1.0  # the one multi-call rollout's second call extends
    assert m["status/completed"] == pytest.approx(2 / 5)
    assert m["status/agent_error"] == pytest.approx(1 / 5)
    assert m["status/truncated"] == pytest.approx(1 / 5)
    assert m["status/infra_error"] == pytest.approx(1 / 5)
    assert m["status/cancelled"] == 0.0
    assert m["reward/mean"] == pytest.approx((1.0 + 0.0 + 0.5) / 3)  # None rewards left out
    assert m["reward/fmt"] == pytest.approx(0.5)
    assert m["latency_p50"] == pytest.approx(2.5)
    assert m["latency_p90"] == pytest.approx(3.7)
    assert m["latency_p99"] == pytest.approx(3.97)
    assert m["latency_max"] == 4.0
    assert m["completion_tokens_mean"] == pytest.approx((2 + 3 + 1 + 0 + 6) / 5)
    assert m["trained_tokens"] == 3.0
    assert m["masked_share"] == pytest.approx(1 / 4)  # 4 completion tokens, 1 untrained
    assert m["token_lag_mean"] == pytest.approx(((5 - 4) * 2 + (5 - 2)) / 3)
    assert m["token_lag_max"] == 3.0

    without = session_metrics(rs, batch)
    assert "token_lag_mean" not in without and "token_lag_max" not in without
    assert without["masked_share"] == m["masked_share"]


def test_session_metrics_without_batch_or_rollouts() -> None:
    assert session_metrics([]) == {}
    m = session_metrics([rollout(reward=None, calls=[call()])])
    assert "reward/mean" not in m and "latency_p50" not in m and "trained_tokens" not in m
    assert m["status/completed"] == 1.0
    batch = {
        "segments": np.array([[1, 1, 0]]),
        "loss_mask": np.array([[0.0, 1.0, 0.0]]),
        "completion_mask": np.array([[False, True, False]]),
        "versions": np.array([[0, 0, -1]]),
    }
    m = session_metrics([rollout()], batch, updates=0)
    assert m["masked_share"] == 0.0 and m["trained_tokens"] == 1.0
    assert m["token_lag_mean"] == 0.0
    # pack always writes completion_mask; a batch without it is not one of pack's.
    del batch["completion_mask"]
    with pytest.raises(ValueError, match=r"\['completion_mask'\]"):
        session_metrics([rollout()], batch, updates=0)


@pytest.mark.parametrize("status", [Status.COMPLETED, Status.TRUNCATED])
def test_unchecked_rollout_equals_the_validated_one(status: Status) -> None:
    # The planner's shortcut must build exactly what the constructor builds.
    from dew.core.types import simulated_rollout

    calls = (
        Call([1, 2], [3], [-0.5], 4, finish_reason="length"),
        Call([1, 2, 3, 7], [5, 6], [-0.1, -0.2], 2),
    )
    truncation = "length" if status is Status.TRUNCATED else None
    args = dict(key=RolloutKey(3, 1, 2), task=Task("9"), status=status, calls=calls)
    checked = Rollout(**args, reward=0.5, truncation=truncation)
    fast = simulated_rollout(**args, reward=0.5, truncation=truncation)
    assert type(fast) is Rollout
    assert vars(fast) == vars(checked)
    assert fast.oldest_version == 2
    assert dataclasses.replace(fast, reward=1.0).reward == 1.0  # still a normal Rollout
