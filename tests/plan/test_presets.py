import math

import numpy as np
import pytest

from dew.plan.presets import PRESETS, LengthDraws, LengthPreset, preset


def _levels(p: LengthPreset, tasks: int = 40_000, group: int = 8):
    lengths, truncated = p.sample(np.random.default_rng(1), tasks, group)
    logs = np.log(lengths)  # [tasks, group]
    within = logs.var(axis=1, ddof=1).mean()
    between = logs.mean(axis=1).var(ddof=1) - within / group
    return lengths, truncated, logs, within, between


def test_dapo_log_moments_and_split():
    p = preset("dapo")
    lengths, truncated, logs, within, between = _levels(p)
    assert lengths.shape == (40_000, 8)
    assert logs.mean() == pytest.approx(6.04, abs=0.01)
    assert logs.std() == pytest.approx(0.93, abs=0.01)
    assert between / (between + within) == pytest.approx(1 / 3, abs=0.02)
    assert truncated.mean() < 1e-3
    assert lengths.max() <= 20480


def test_dapo_moments_matches_its_moments():
    lengths, _, _, within, between = _levels(preset("dapo-moments"))
    assert lengths.mean() == pytest.approx(581, rel=0.02)
    assert math.sqrt(math.expm1(between)) == pytest.approx(0.39, abs=0.02)
    assert math.sqrt(math.expm1(within)) == pytest.approx(0.55, abs=0.02)


def test_longcot_truncates_about_15_percent():
    p = preset("longcot")
    lengths, truncated, _, _, _ = _levels(p)
    assert truncated.mean() == pytest.approx(0.165, abs=0.01)
    assert 0.14 <= truncated.mean() <= 0.18
    assert (lengths[truncated] == 16000).all() and (lengths[~truncated] < 16000).all()
    assert np.median(lengths) == pytest.approx(math.exp(8.90), rel=0.02)
    assert p.sigma == pytest.approx(0.80)
    assert math.sqrt(math.expm1(p.sigma_sample**2)) == pytest.approx(0.15)


def test_tail_is_the_demo_workloads_answer_lengths():
    from dew.demo.tail import Workload

    w = Workload()
    p = preset("tail")
    assert (p.mu, p.sigma_task, p.sigma_sample, p.cap) == (
        math.log(w.length_median),
        w.length_sigma,
        0.0,
        w.length_cap,
    )
    lengths, truncated, logs, within, _ = _levels(p)
    assert within == 0.0  # a group shares its task's target length
    assert np.median(lengths) == pytest.approx(24, abs=1)
    assert logs.std() == pytest.approx(0.9, abs=0.02)
    assert 0.005 < truncated.mean() < 0.03 and lengths.max() == 192


def test_sampling_is_seeded():
    p = PRESETS["dapo"]
    a = p.sample(np.random.default_rng(7), 5, 4)[0]
    b = p.sample(np.random.default_rng(7), 5, 4)[0]
    assert (a == b).all()


def test_length_draws_are_deterministic_and_quantized():
    d1 = LengthDraws(PRESETS["longcot"], seed=3, quantum=64)
    d2 = LengthDraws(PRESETS["longcot"], seed=3, quantum=64)
    got = [d1.get(t, s, a) for t in (5, 0) for s in (0, 3) for a in (0, 2)]
    assert got == [d2.get(t, s, a) for t in (5, 0) for s in (0, 3) for a in (0, 2)]
    assert all(n % 64 == 0 and n >= 64 for n, _ in got)
    assert d1.get(5, 0, 0) != d1.get(5, 0, 1)  # a resubmission draws again
    exact = LengthDraws(PRESETS["longcot"], seed=3)
    assert -(-exact.get(5, 3, 2)[0] // 64) * 64 == d1.get(5, 3, 2)[0]


def test_first_tokens_sums_the_first_attempts():
    # Spans a task-block boundary (256) so two tables are read.
    d = LengthDraws(PRESETS["dapo"], seed=1)
    want = sum(d.get(t, s)[0] for t in range(250, 262) for s in range(5))
    assert LengthDraws(PRESETS["dapo"], seed=1).first_tokens(250, 12, 5) == want
    assert d.first_tokens(7, 0, 5) == 0
    with pytest.raises(ValueError, match="group=65"):
        d.first_tokens(0, 1, 65)


def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="preset='nope'"):
        preset("nope")
    with pytest.raises(ValueError, match="quantum"):
        LengthDraws(PRESETS["dapo"], quantum=0)
    with pytest.raises(ValueError, match="sample=64"):
        LengthDraws(PRESETS["dapo"]).get(0, 64)
    with pytest.raises(ValueError, match="sigma_task"):
        LengthPreset("x", 1.0, -1.0, 1.0, 10)
