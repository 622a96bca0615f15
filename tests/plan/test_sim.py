import math
import threading

import pytest

from dew.core import RolloutKey, SessionSource, Status, Task
from dew.objectives.rl.config import SchedulerConfig
from dew.objectives.rl.scheduler import Publisher, SchedulerRecord
from dew.plan._engine import EngineConfig
from dew.plan._trace import summarize
from dew.plan.planner import Scenario, simulate
from dew.plan.presets import LengthDraws, LengthPreset
from dew.plan.sim import SimulatedEngineSource, run_scheduler

FLAT = LengthPreset("flat", math.log(50), 0.0, 0.0, 1000)
CAPPED = LengthPreset("capped", math.log(50), 0.0, 0.0, 20)  # every sample hits the cap


@pytest.mark.timeout(30)
def test_source_statuses_versions_and_cancel():
    with SimulatedEngineSource(LengthDraws(CAPPED), scale=1e-3) as capped:
        assert isinstance(capped, SessionSource) and isinstance(capped, Publisher)
        capped.load(None, 3)
        r = capped.start(Task("0"), RolloutKey(0, 0, 0)).result(timeout=10)
        assert r.status is Status.TRUNCATED and r.truncation == "length"
        assert r.completion_tokens == 20 and r.calls[0].version == 3
        assert r.calls[0].finish_reason == "length"

    # One slot. The first request was queued before the push, so it is served at the old
    # version (a push first fills the slots freed before it), however soon it finishes;
    # the second, sent after the push, at the new one. No timing decides it.
    engine = EngineConfig(max_active=1)
    with SimulatedEngineSource(LengthDraws(FLAT), scale=1e-3, engine=engine) as source:
        first = source.start(Task("1"), RolloutKey(1, 0, 0))
        source.load(None, 1)
        second = source.start(Task("1"), RolloutKey(1, 1, 0))
        ends: list[Status] = []
        seen = threading.Event()
        second.add_done_callback(lambda s: (ends.append(s.result().status), seen.set()))
        a, b = first.result(timeout=10), second.result(timeout=10)
        assert seen.wait(10) and ends == [Status.COMPLETED]
        assert a.status is Status.COMPLETED and a.completion_tokens == 50
        assert (a.calls[0].version, b.calls[0].version) == (0, 1)  # version at first token
        assert a.reward is not None

        long_one = source.start(Task("2"), RolloutKey(2, 0, 0))
        long_one.cancel()
        long_one.cancel()  # idempotent
        assert long_one.done() and long_one.result().status is Status.CANCELLED
        ledger = source.ledgers[2]
        assert ledger.drawn == [50] and 0 <= ledger.generated <= 50
        with pytest.raises(ValueError, match="not a decimal integer"):
            source.start(Task("x"), RolloutKey(3, 0, 0))
    assert not source._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        source.start(Task("1"), RolloutKey(9, 0, 0))


@pytest.mark.timeout(120)
def test_real_scheduler_on_simulated_engine():
    p = LengthPreset("tiny", math.log(40), 0.3, 0.5, 60)  # some samples reach the cap
    sc = Scenario(p, tasks=4, group=3, T=0.5, steps=4, warmup=1, seed=2)
    records: list[SchedulerRecord] = []
    trace = run_scheduler(SchedulerConfig.tight(ahead=1), sc, scale=0.01, log=records.append)
    assert [r.updates for r in records] == [0, 1, 2, 3]
    assert [s.samples for s in trace.steps] == [12] * 4
    assert records[0].lag == 0 and all(r.lag <= 1 for r in records)
    assert all(r.cut == 0 and r.abandoned == 0 for r in records)
    truncated = [r.metrics["status/truncated"] for r in records]
    completed = [r.metrics["status/completed"] for r in records]
    assert sum(truncated) > 0  # the seeded draws reach the cap 60 now and then
    assert all(t + c == pytest.approx(1.0) for t, c in zip(truncated, completed, strict=True))
    # Each batch drew exactly its 12 samples once and generated them in full.
    planned = simulate(SchedulerConfig.tight(ahead=1), sc)
    for k in range(4):
        assert sorted(trace.batches[k].drawn) == sorted(planned.batches[k].drawn)
        assert trace.batches[k].generated == pytest.approx(sum(trace.batches[k].drawn))
    assert [s.tokens for s in trace.steps] == pytest.approx([s.tokens for s in planned.steps])
    f = summarize(trace, sc.warmup)
    assert 0 < f.fraction <= 1.05 and f.length_bias == pytest.approx(1.0)
    assert f.wasted == pytest.approx(0.0, abs=1e-9)


class _ShortDraws(LengthDraws):
    """Draws shorter than the quantum: the engine thread cannot build their call."""

    def get(self, task: int, sample: int, attempt: int = 0) -> tuple[int, bool]:
        return 5, False


@pytest.mark.timeout(30)
def test_a_rollout_that_cannot_be_built_raises_from_its_session():
    with SimulatedEngineSource(_ShortDraws(FLAT, quantum=10), scale=1e-3) as source:
        first = source.start(Task("0"), RolloutKey(0, 0, 0))
        with pytest.raises(ValueError, match="completion is empty"):
            first.result(timeout=10)
        second = source.start(Task("0"), RolloutKey(1, 0, 0))  # the engine thread lives on
        with pytest.raises(ValueError, match="completion is empty"):
            second.result(timeout=10)
        assert source._thread.is_alive()
    assert not source._thread.is_alive()


def test_a_verifier_latency_is_refused_by_the_simulated_run():
    p = LengthPreset("tiny", math.log(40), 0.3, 0.5, 60)
    sc = Scenario(p, tasks=2, group=2, T=0.5, steps=2, warmup=1, latency=0.1)
    with pytest.raises(ValueError, match=r"latency=0\.1: the simulated engine source"):
        run_scheduler(SchedulerConfig.tight(ahead=1), sc, scale=0.01)
