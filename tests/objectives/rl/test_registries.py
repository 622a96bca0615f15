"""Estimators and truncation policies: a user's function works wherever a name does."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dew.core import Call, Rollout, RolloutKey, Status, Task
from dew.objectives.rl.estimators import (
    ESTIMATORS,
    advantage_estimator,
    advantages,
    estimator_name,
)
from dew.objectives.rl.pack import pack
from dew.objectives.rl.truncation import Truncation, policy_name, truncation_policy


def member(sample: int, reward: float, status: Status = Status.COMPLETED) -> Rollout:
    call = Call(prompt=[1, 2], completion=[3, 4], log_probs=[-0.5, -0.5], version=0)
    extra = {"truncation": "length"} if status is Status.TRUNCATED else {}
    return Rollout(RolloutKey(0, sample, 0), Task("t"), status, (call,), reward=reward, **extra)


GROUP = [member(0, 1.0), member(1, 0.0), member(2, 0.5, Status.TRUNCATED)]


def advantages_of(batch: dict[str, np.ndarray]) -> list[float]:
    """Each packed rollout's advantage, read off its first trained token (0 if none)."""
    out = []
    for i in range(3):
        at = (batch["rollout_index"] == i) & (batch["completion_mask"] > 0)
        out.append(float(batch["advantages"][at][0]))
    return out


def test_a_user_estimator_is_used_and_only_on_trained_members() -> None:
    seen: list[tuple[list[float], list[bool]]] = []

    def double(rewards: np.ndarray, trained: np.ndarray) -> np.ndarray:
        seen.append((rewards.tolist(), trained.tolist()))
        return 2.0 * rewards + 1.0

    assert advantage_estimator(double) is double and estimator_name(double) == "double"
    batch, _ = pack([GROUP], rows=2, width=8, estimator=double)
    assert seen == [([1.0, 0.0, 0.0], [True, True, False])]  # the masked one: untrained
    assert advantages_of(batch) == [3.0, 1.0, 0.0]
    named, _ = pack([GROUP], rows=2, width=8, estimator="group")
    assert advantages_of(named) == [0.5, -0.5, 0.0]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda r, t: np.zeros(len(r) + 1), r"returned shape \(4,\)"),
        (lambda r, t: np.full(len(r), np.nan), "returned a non-finite advantage"),
    ],
)
def test_a_broken_user_estimator_is_named(bad: object, message: str) -> None:
    with pytest.raises(ValueError, match=f"estimator '<lambda>' {message}"):
        pack([GROUP], rows=2, width=8, estimator=bad)  # type: ignore[arg-type]


def test_a_user_truncation_policy_is_used() -> None:
    def half(r: Rollout) -> Truncation:
        return Truncation(trained=True, reward=(r.reward or 0.0) / 2)

    assert truncation_policy(half) is half and policy_name(half) == "half"
    batch, _ = pack([GROUP], rows=2, width=8, truncation=half, estimator="group")
    # rewards [1, 0, 0.25], all trained: mean 5/12
    np.testing.assert_allclose(advantages_of(batch), [7 / 12, -5 / 12, -2 / 12], rtol=1e-6)

    def never(r: Rollout) -> Truncation:
        return Truncation(trained=False, reward=None, resubmit="unscored")

    with pytest.raises(ValueError, match="truncation='never' cannot admit"):
        pack([GROUP], rows=2, width=8, truncation=never)


@pytest.mark.parametrize("value", ["ppo", 3, None])
def test_anything_else_is_refused_naming_the_knob(value: object) -> None:
    with pytest.raises(ValueError, match=r"estimator=.* is not one of \['group'"):
        advantage_estimator(value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"truncation=.* is not one of \['mask'"):
        truncation_policy(value)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- built-in estimators

REWARDS = np.array([1.0, 0.0, 0.5, 3.0])
TRAINED = np.array([True, True, True, False])  # the last one (reward 3) stays out


def test_group_subtracts_the_trained_mean_and_zeroes_the_rest() -> None:
    group = ESTIMATORS["group"]
    assert group(REWARDS, TRAINED).tolist() == [0.5, -0.5, 0.0, 0.0]  # mean 0.5
    one = np.array([False, True, False, False])
    assert group(REWARDS, one).tolist() == [0.0, 0.0, 0.0, 0.0]  # its own baseline
    # nobody trains: zeros, without numpy's empty-mean warning (an error under pytest)
    assert group(REWARDS, np.zeros(4, bool)).tolist() == [0.0, 0.0, 0.0, 0.0]


def test_group_std_divides_by_the_trained_population_std() -> None:
    group_std = ESTIMATORS["group_std"]
    std = math.sqrt((0.5**2 + 0.5**2 + 0.0) / 3)  # population std of [1, 0, 0.5]
    expect = np.array([0.5, -0.5, 0.0, 0.0]) / (std + 1e-6)
    np.testing.assert_allclose(group_std(REWARDS, TRAINED), expect, rtol=1e-12, atol=0)
    # a single member: std 0, advantage 0 (the epsilon keeps it finite)
    one = np.array([False, False, True, False])
    assert group_std(REWARDS, one).tolist() == [0.0, 0.0, 0.0, 0.0]
    assert group_std(REWARDS, np.zeros(4, bool)).tolist() == [0.0, 0.0, 0.0, 0.0]


def test_rloo_baseline_is_the_mean_of_the_other_trained_members() -> None:
    rloo = ESTIMATORS["rloo"]
    # 1 - (0 + 0.5) / 2, 0 - (1 + 0.5) / 2, 0.5 - (1 + 0) / 2; the untrained one 0
    assert rloo(REWARDS, TRAINED).tolist() == [0.75, -0.75, 0.0, 0.0]
    two = np.array([True, False, False, True])
    assert rloo(REWARDS, two).tolist() == [-2.0, 0.0, 0.0, 2.0]  # 1 - 3, 3 - 1
    # fewer than two trained members: no "other" to compare with, so 0
    for one in (np.array([True, False, False, False]), np.zeros(4, bool)):
        assert rloo(REWARDS, one).tolist() == [0.0, 0.0, 0.0, 0.0]


def test_advantages_are_float64_and_zero_on_untrained_members() -> None:
    def float32_ones(rewards: np.ndarray, trained: np.ndarray) -> np.ndarray:
        return np.ones(len(rewards), dtype=np.float32)  # also on the untrained member

    out = advantages(float32_ones, REWARDS, TRAINED)
    assert out.dtype == np.float64
    assert out.tolist() == [1.0, 1.0, 1.0, 0.0]
    assert advantages("rloo", REWARDS, TRAINED).tolist() == [0.75, -0.75, 0.0, 0.0]


def test_an_unknown_estimator_is_refused_with_the_expected_signature() -> None:
    with pytest.raises(ValueError) as info:
        advantage_estimator("ppo")
    assert str(info.value) == (
        "estimator='ppo' is not one of ['group', 'group_std', 'rloo'] "
        "nor a callable fn(rewards, trained) -> advantages"
    )
