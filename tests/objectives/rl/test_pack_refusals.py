"""pack's refusals, message by message: each names the parameter or the rollout at fault and
says what to do, so these tests match the whole text (a substring would let a mangled
remedy or a wrong parameter name through)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from dew.core import Call, Rollout, RolloutKey, Status
from dew.objectives.rl.pack import pack
from dew.objectives.rl.truncation import Truncation

from .test_pack import TASK, call, rollout, support_group, three_rollouts


def whole(message: str) -> str:
    """A pattern that matches exactly ``message``."""
    return f"^{re.escape(message)}$"


# --------------------------------------------------------------------------- parameters


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rows": 0}, "rows must be a positive int, got 0"),
        ({"width": -2}, "width must be a positive int, got -2"),
        ({"support_capacity": 0}, "support_capacity must be a positive int, got 0"),
        # A bool is an int to Python, but rows=True is a slip, not a row count.
        ({"rows": True}, "rows must be a positive int, got True"),
        # Neither a float nor a numeric string is silently rounded or parsed.
        ({"width": 2.5}, "width must be a positive int, got 2.5"),
        ({"support_capacity": "3"}, "support_capacity must be a positive int, got '3'"),
    ],
)
def test_bad_size_names_the_parameter(kwargs: dict[str, object], message: str) -> None:
    args = {"rows": 2, "width": 8} | kwargs
    with pytest.raises(ValueError, match=whole(message)):
        pack([three_rollouts()], **args)


def test_numpy_sizes_are_accepted() -> None:
    # Sizes read from arrays or configs are often numpy ints; they count as ints.
    batch, stats = pack([three_rollouts()], rows=np.int64(2), width=np.int32(6))
    assert batch["tokens"].shape == (2, 6)
    assert stats.packed == (0,)


# --------------------------------------------------------------------------- admission


def test_support_without_capacity_message() -> None:
    with pytest.raises(
        ValueError,
        match=whole(
            "rollout(group=0, sample=0, attempt=0): its calls carry support but "
            "support_capacity is None; pass support_capacity to pack filtered-sampling rollouts"
        ),
    ):
        pack([support_group()], rows=1, width=8)


@pytest.mark.parametrize(
    ("calls", "missing"),
    [
        ([call([1], [2], support=[[2, 3]]), call([7], [4])], 1),
        ([call([1], [2]), call([1, 2], [4], support=[[4]])], 0),
    ],
)
def test_rollout_mixing_support_and_none_message(calls: list[Call], missing: int) -> None:
    # The message points at the first call without support, wherever it is.
    with pytest.raises(
        ValueError,
        match=whole(
            f"rollout(group=0, sample=0, attempt=0): calls[{missing}] carries no support while "
            "other calls do; every call of a rollout must carry support or none may"
        ),
    ):
        pack([[rollout(0, 0, calls)]], rows=1, width=8, support_capacity=4)


@pytest.mark.parametrize("status", [Status.INFRA_ERROR, Status.CANCELLED])
def test_unscored_status_message(status: Status) -> None:
    bad = Rollout(RolloutKey(2, 5, 1), TASK, status, error="boom")
    with pytest.raises(
        ValueError,
        match=whole(
            f"rollout(group=2, sample=5, attempt=1): status {status.name} is never scored and "
            "cannot be packed; only COMPLETED, AGENT_ERROR and TRUNCATED rollouts are admitted"
        ),
    ):
        pack([[rollout(2, 0, [call([1], [2])]), bad]], rows=1, width=8)


def trains_unscored(r: Rollout) -> Truncation:
    """A user's truncation policy with a bug: it trains a rollout but gives no reward."""
    return Truncation(trained=True, reward=None)


def test_policy_that_trains_without_a_reward_is_named() -> None:
    # The fault is the policy's, not the rollout's: the message names the policy by its
    # function name so the user knows which of their functions to fix.
    group = [
        rollout(0, 0, [call([1], [2])], reward=1.0),
        rollout(0, 1, [call([1], [3])], reward=None, status=Status.TRUNCATED),
    ]
    with pytest.raises(
        ValueError,
        match=whole(
            "rollout(group=0, sample=1, attempt=0): truncation='trains_unscored' trains it "
            "but gives no reward"
        ),
    ):
        pack([group], rows=1, width=8, truncation=trains_unscored)


# --------------------------------------------------------------------------- never fits


def test_never_fits_names_the_rollout_with_the_longest_chain() -> None:
    # The longest chain (6 tokens, one more than a row) is in the group's *first* member,
    # so naming the last member, or the wrong one's lengths, would not match.
    group = [
        rollout(0, 0, [call([1, 2, 3], [4, 5, 6]), call([7], [8, 9])]),  # chains [6, 3]
        rollout(0, 1, [call([1], [2])]),  # chain [2]
    ]
    with pytest.raises(
        ValueError,
        match=whole(
            "rollout rollout(group=0, sample=0, attempt=0): its group can never be packed "
            "(rows=4, width=5): its chains are [6, 3] tokens long (longest of the group: 6), "
            "and the group's 2 rollouts need 11 tokens in all; every step would cut it. "
            "Raise width to at least the longest chain (prompt + completion tokens), "
            "rows so that a whole group fits, or lower the sampling's max_tokens"
        ),
    ):
        pack([group], rows=4, width=5)


def test_never_fits_with_support_names_the_capacity() -> None:
    # Every chain fits a row; the group's 6 support ids do not fit a row's 5.
    with pytest.raises(
        ValueError,
        match=whole(
            "rollout rollout(group=0, sample=0, attempt=0): its group can never be packed "
            "(rows=1, width=16, support_capacity=5): its chains are [3] tokens long (longest "
            "of the group: 3), and the group's 3 rollouts need 7 tokens in all; every step "
            "would cut it. Raise width to at least the longest chain (prompt + completion "
            "tokens), rows so that a whole group fits, or lower the sampling's max_tokens"
        ),
    ):
        pack([support_group()], rows=1, width=16, support_capacity=5)
