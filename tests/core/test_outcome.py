"""dew.core.parse_reward: what a verifier may return, and one clear error otherwise."""

from __future__ import annotations

import numpy as np
import pytest

from dew.core import parse_reward


def test_numbers_numpy_scalars_and_mappings_of_them_are_rewards() -> None:
    assert parse_reward(1) == (1.0, {})
    assert parse_reward(np.float32(0.5)) == (0.5, {})
    reward, parts = parse_reward({"a": np.int64(2), "b": 0.25})
    assert (reward, parts) == (2.25, {"a": 2.0, "b": 0.25})
    assert all(type(v) is float for v in (reward, *parts.values()))


@pytest.mark.parametrize(
    ("out", "why"),
    [
        (True, "expected a number"),
        ("1", "expected a number"),
        (float("nan"), "not a finite number"),
        (10**400, "not a finite number"),
        ({}, "empty mapping"),
        ({"a": None}, "'a' is None, not a number"),
        ({"a": 10**400}, "'a' is 1000.*, not finite"),
        ({"a": 1e308, "b": 1e308}, "sum to inf"),
    ],
)
def test_anything_else_is_refused_in_one_line(out: object, why: str) -> None:
    with pytest.raises(ValueError, match=why) as caught:
        parse_reward(out)
    assert "\n" not in str(caught.value)
