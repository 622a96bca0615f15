"""The profile's sketches: quantiles within a bucket, exact merge and difference, and
the engine line recovered from an iteration log."""

import json
import math
import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dew.core import EngineTimings, IterationLog, LogHistogram, Timed
from dew.core.sketch import BUCKETS_PER_OCTAVE, MIN_SPREAD

BUCKET = 2 ** (1 / BUCKETS_PER_OCTAVE)  # a bucket's width, as a ratio

values = st.lists(
    st.one_of(st.just(0.0), st.floats(1e-6, 1e6, allow_nan=False)), min_size=1, max_size=200
)


@given(values, st.floats(0.0, 1.0))
@settings(max_examples=200, deadline=None)
def test_a_quantile_is_within_a_bucket_of_the_exact_one(xs, q):
    h = LogHistogram()
    h.extend(xs)
    got = h.quantile(q)
    ordered = sorted(xs)
    # the exact quantile lies between two order statistics; the sketch's answer is
    # within one bucket of the range they span
    lo = ordered[max(math.ceil(q * len(xs)) - 1, 0)]
    hi = ordered[min(math.ceil(q * len(xs)), len(xs) - 1)]
    if lo == 0.0:
        assert got == 0.0 or got <= hi * BUCKET
    else:
        assert lo / BUCKET <= got <= hi * BUCKET
    assert h.count == len(xs)
    assert h.mean == pytest.approx(sum(xs) / len(xs))


@given(values, values)
@settings(max_examples=100, deadline=None)
def test_merge_and_since_are_exact_inverses(first, second):
    live = LogHistogram()
    live.extend(first)
    then = live.snapshot()
    live.extend(second)
    later = live.since(then)
    alone = LogHistogram()
    alone.extend(second)
    assert later.to_json()["buckets"] == alone.to_json()["buckets"]
    assert later.count == len(second)
    assert then.merged(later).to_json()["buckets"] == live.to_json()["buckets"]
    again = LogHistogram.from_json(json.loads(json.dumps(live.to_json())))
    assert again.to_json() == live.to_json()


def test_a_sketch_that_restarted_is_taken_whole():
    old = LogHistogram()
    old.extend([1.0, 2.0, 3.0])
    fresh = LogHistogram()
    fresh.add(5.0)
    assert fresh.since(old.snapshot()).count == 1  # counts fell: a restart, not negatives


def test_bad_values_and_bad_json_are_refused_naming_the_sketch():
    with pytest.raises(ValueError, match="finite value >= 0"):
        LogHistogram().add(-1.0)
    with pytest.raises(ValueError, match="finite value >= 0"):
        LogHistogram().add(math.nan)
    with pytest.raises(ValueError, match="not a LogHistogram"):
        LogHistogram.from_json({"buckets": {}})
    with pytest.raises(ValueError, match="not an IterationLog"):
        IterationLog.from_json({"3": [1, -1.0]})
    with pytest.raises(ValueError, match="quantile"):
        LogHistogram().quantile(1.5)
    assert math.isnan(LogHistogram().quantile(0.5))


@given(
    st.floats(1e-4, 1e-1),
    st.floats(0.0, 1e-3),
    st.lists(st.integers(1, 256), min_size=2, max_size=60),
)
@settings(max_examples=100, deadline=None)
def test_fit_line_recovers_a_and_b_from_noiseless_iterations(a, b, actives):
    log = IterationLog()
    for k in actives:
        log.add(k, a + b * k)
    line = log.fit_line()
    mean = sum(actives) / len(actives)
    spread = math.sqrt(sum((k - mean) ** 2 for k in actives) / len(actives))
    if spread < MIN_SPREAD * mean:  # too alike to separate a from b
        assert line is None
        return
    assert line is not None
    assert line[0] == pytest.approx(a, rel=1e-6, abs=1e-9)
    assert line[1] == pytest.approx(b, rel=1e-6, abs=1e-9)


def test_fit_line_on_noisy_iterations_and_iteration_log_difference():
    rng = random.Random(0)
    a, b = 2e-3, 5e-5
    log = IterationLog()
    for _ in range(5000):
        k = rng.randint(1, 128)
        log.add(k, (a + b * k) * rng.lognormvariate(0, 0.2))
    then = log.snapshot()
    for _ in range(10):
        log.add(7, 1.0)
    assert log.since(then).rows() == {7: (10, pytest.approx(10.0))}
    fit = then.fit_line()
    assert fit is not None
    mean_noise = math.exp(0.2**2 / 2)  # a lognormal factor's mean
    assert fit[0] == pytest.approx(a * mean_noise, rel=0.1)
    assert fit[1] == pytest.approx(b * mean_noise, rel=0.05)
    assert IterationLog.from_json(json.loads(json.dumps(log.to_json()))).rows() == log.rows()


def test_writes_from_threads_are_all_counted():
    h, log = LogHistogram(), IterationLog()

    def write() -> None:
        for i in range(2000):
            h.add(float(i % 50 + 1))
            log.add(i % 8 + 1, 0.001)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert h.count == 8000
    assert log.iterations == 8000


def test_engine_timings_round_trip_and_the_timed_protocol():
    log = IterationLog()
    log.add(3, 0.01)
    entry = EngineTimings("http://127.0.0.1:1", 64, log)
    again = EngineTimings.from_json(json.loads(json.dumps(entry.to_json())))
    assert (again.name, again.max_active, again.iterations.rows()) == (
        entry.name,
        64,
        log.rows(),
    )

    class Engine:
        def timings(self) -> list[EngineTimings]:
            return [entry]

    assert isinstance(Engine(), Timed)
    assert not isinstance(object(), Timed)
