"""The per-step profile: hand-worked sums from known rollouts, deltas of the source's and
the engine's cumulative sketches, and a real run writing it into every step record."""

from __future__ import annotations

import json
import math
from contextlib import ExitStack
from pathlib import Path

import pytest

from dew.core import (
    Call,
    EngineError,
    EngineTimings,
    IterationLog,
    LogHistogram,
    Rollout,
    RolloutKey,
    Status,
    Task,
)
from dew.objectives.rl.config import SchedulerConfig
from dew.objectives.rl.profile import PROFILE_FORMAT, StepProfiler


def _rollout(group: int, sample: int, lengths: list[int], *, capped: bool = False) -> Rollout:
    calls = tuple(
        Call(
            [1] * (3 + 10 * i),
            [0] * n,
            [0.0] * n,
            0,
            finish_reason="length" if capped and i == len(lengths) - 1 else "stop",
        )
        for i, n in enumerate(lengths)
    )
    return Rollout(
        RolloutKey(group, sample, 0),
        Task(str(group)),
        Status.TRUNCATED if capped else Status.COMPLETED,
        calls,
        reward=1.0,
        truncation="length" if capped else None,
    )


class _Engine:
    def __init__(self) -> None:
        self.log = IterationLog()
        self.fail: Exception | None = None

    def timings(self) -> list[EngineTimings]:
        if self.fail is not None:
            raise self.fail
        return [EngineTimings("e0", 16, self.log.snapshot())]


class _Source:
    def __init__(self) -> None:
        self.outside = LogHistogram()
        self.engine = _Engine()


def test_a_steps_profile_holds_hand_worked_figures_and_only_what_came_since_the_last():
    source = _Source()
    profiler = StepProfiler(SchedulerConfig(groups=2, ahead=1, max_lag=1, admit=3), source)
    groups = [
        [_rollout(0, 0, [2]), _rollout(0, 1, [8])],
        [_rollout(1, 0, [4, 4]), _rollout(1, 1, [16], capped=True)],
    ]
    stale = [_rollout(2, 0, [32])]
    cancelled = [_rollout(3, 0, [5]), Rollout(RolloutKey(3, 1, 0), Task("3"), Status.CANCELLED)]
    source.outside.extend([0.5, 1.5])
    source.engine.log.add(4, 0.01)
    p = profiler.step(groups, stale, cancelled)
    assert p["format"] == PROFILE_FORMAT
    assert p["policy"] == {
        "ahead": 1,
        "max_lag": 1,
        "oversample": 0,
        "admit": 3,
        "groups": 2,
        "sync_every": 1,
        "tasks": 2,
    }
    lengths = LogHistogram.from_json(p["lengths"]["finished"])
    assert (lengths.count, lengths.mean) == (5, (2 + 8 + 8 + 16 + 32) / 5)
    partial = LogHistogram.from_json(p["lengths"]["cancelled"])
    assert (partial.count, partial.mean) == (1, 5.0)  # the one without calls tells nothing
    # group means of log-length: log 4 (from 2 and 8) and log(sqrt(8 * 16))
    m0, m1 = math.log(4), (math.log(8) + math.log(16)) / 2
    logs = p["log_groups"]
    assert logs["groups"] == 2 and logs["within_df"] == 2
    assert logs["mean_sum"] == pytest.approx(m0 + m1)
    assert logs["mean_sq"] == pytest.approx(m0**2 + m1**2)
    assert logs["within_ss"] == pytest.approx(2 * math.log(2) ** 2 + 2 * (math.log(2) / 2) ** 2)
    assert (p["truncated"], p["length_cap"]) == (1, 16)
    assert LogHistogram.from_json(p["turns"]).mean == pytest.approx(6 / 5)  # one of two calls
    assert LogHistogram.from_json(p["prompt"]).mean == 3.0  # the first call's prompt
    assert LogHistogram.from_json(p["outside"]).count == 2
    assert p["engines"] == [{"name": "e0", "max_active": 16, "iterations": {"4": [1, 0.01]}}]
    assert p["cpu"] >= 0
    json.dumps(p)  # it goes into a JSON record as it is

    source.outside.add(2.0)
    source.engine.log.add(5, 0.02)
    p = profiler.step(groups[:1], [], [])
    assert LogHistogram.from_json(p["outside"]).mean == 2.0  # only what came since
    assert p["engines"][0]["iterations"] == {"5": [1, 0.02]}
    assert p["policy"]["tasks"] == 1

    source.engine.fail = EngineError("http://127.0.0.1:1/dew/timings: connection refused")
    p = profiler.step(groups[:1], [], [])
    assert "engines" not in p and "connection refused" in p["engines_error"]
    source.engine.fail = None
    source.engine.log.add(6, 0.03)
    p = profiler.step(groups[:1], [], [])  # the missed read is counted at the next one
    assert p["engines"][0]["iterations"] == {"6": [1, 0.03]}


def test_a_source_without_sketches_gives_a_profile_without_them():
    p = StepProfiler(SchedulerConfig(), object()).step([[_rollout(0, 0, [3])]], [], [])
    assert "outside" not in p and "engines" not in p
    assert LogHistogram.from_json(p["lengths"]["finished"]).count == 1


@pytest.mark.parametrize("task", ["tail", "tail-turns"])
def test_every_step_record_of_a_real_run_carries_its_profile(task: str, tmp_path: Path) -> None:
    from dew.demo.run import DemoConfig, build_job

    config = DemoConfig.for_task(task, steps=3, batch_size=2, group_size=2)
    with ExitStack() as stack:
        job = build_job(config, stack)
        job.fit(steps=3, run_dir=tmp_path, tensorboard=False, checkpoint_every=None)
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    outside, iterations = LogHistogram(), 0
    for r in records:
        p = r["profile"]
        assert p["policy"]["tasks"] == 2 and p["policy"]["groups"] == 2
        assert LogHistogram.from_json(p["lengths"]["finished"]).count == 4
        (engine,) = p["engines"]
        assert engine["name"] == "local" and engine["max_active"] >= 1
        # a step's rollouts may all have run before the last read (ahead): summed below
        iterations += IterationLog.from_json(engine["iterations"]).iterations
        outside = outside.merged(LogHistogram.from_json(p["outside"]))
    # every scored rollout spent its verifier's (and, multi-turn, its tools') latency
    # outside the engine: a lognormal of median 50 ms per call
    assert iterations > 0
    assert outside.count >= 12
    assert outside.quantile(0.5) > (0.02 if task == "tail" else 0.05)


def test_the_engines_iterations_while_the_trainer_waited_are_told_apart():
    source = _Source()
    profiler = StepProfiler(SchedulerConfig(), source)
    log = source.engine.log
    log.add(8, 0.2)  # beside the trainer's work, before the call
    profiler.wait_begins()
    log.add(8, 0.1)  # the trainer waits: the engine alone
    log.add(9, 0.1)
    profiler.wait_ends()
    log.add(8, 0.3)  # packing, then training: the next call's
    (entry,) = profiler.step([[_rollout(0, 0, [3])]], [], [])["engines"]
    assert IterationLog.from_json(entry["iterations"]).rows() == {
        8: (2, pytest.approx(0.3)),
        9: (1, pytest.approx(0.1)),
    }
    assert IterationLog.from_json(entry["waiting"]).rows() == {
        8: (1, pytest.approx(0.1)),
        9: (1, pytest.approx(0.1)),
    }
    profiler.wait_begins()
    profiler.wait_ends()
    (entry,) = profiler.step([[_rollout(0, 0, [3])]], [], [])["engines"]
    assert IterationLog.from_json(entry["iterations"]).rows() == {8: (1, pytest.approx(0.3))}
    assert entry["waiting"] == {}


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("outside"), st.floats(0.0, 10.0)),
        st.tuples(st.just("iteration"), st.integers(1, 64)),
        st.tuples(st.just("wait"), st.booleans()),
        st.tuples(st.just("fail"), st.booleans()),
        st.tuples(st.just("step"), st.just(0)),
    ),
    max_size=60,
)


@given(_OPS)
@settings(max_examples=60, deadline=None)
def test_the_steps_sum_to_what_the_source_and_engine_counted(ops):
    """Whatever the order of reads, waits and failed reads, the steps' outside and
    engine sections add up to the cumulative sketches as of the last call's read (a
    step counts the engine up to the end of its wait; what comes after, the next
    step), and the part marked waiting is never more than the whole."""
    source = _Source()
    profiler = StepProfiler(SchedulerConfig(), source)
    outside, iterations = LogHistogram(), IterationLog()
    waiting_total = 0

    def step() -> None:
        nonlocal outside, iterations, waiting_total
        p = profiler.step([[_rollout(0, 0, [3])]], [], [])
        outside = outside.merged(LogHistogram.from_json(p["outside"]))
        for e in p.get("engines", ()):
            whole = IterationLog.from_json(e["iterations"])
            iterations = iterations.merged(whole)
            if "waiting" in e:
                part = IterationLog.from_json(e["waiting"])
                assert part.iterations <= whole.iterations
                waiting_total += part.iterations

    for op, value in ops:
        if op == "outside":
            source.outside.add(value)
        elif op == "iteration":
            source.engine.log.add(value, 0.001)
        elif op == "wait":
            profiler.wait_begins() if value else profiler.wait_ends()
        elif op == "fail":
            source.engine.fail = EngineError("down") if value else None
        else:
            step()
    source.engine.fail = None
    profiler.wait_begins()  # a last call as the scheduler makes it: its wait, then its step
    profiler.wait_ends()
    step()
    assert outside.count == source.outside.count
    got, want = iterations.rows(), source.engine.log.rows()
    assert {k: n for k, (n, _) in got.items()} == {k: n for k, (n, _) in want.items()}
    assert all(got[k][1] == pytest.approx(want[k][1]) for k in want)
    assert waiting_total <= iterations.iterations
