"""Estimators and truncation policies: a user's function works wherever a name does."""

from __future__ import annotations

import numpy as np
import pytest

from dew.core import Call, Rollout, RolloutKey, Status, Task
from dew.objectives.rl.estimators import advantage_estimator, estimator_name
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
