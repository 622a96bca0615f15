"""The rules every layer shares, written once in dew.core: int arguments and the
temperature a greedy call is reported under."""

from __future__ import annotations

import numpy as np
import pytest

import dew.core
from dew.core import MIN_TEMPERATURE, SamplingParams, as_int, is_real, scored_temperature


def test_the_shared_checks_are_public() -> None:
    for name in ("as_int", "is_real", "scored_temperature"):
        assert name in dew.core.__all__


def test_as_int_takes_python_and_numpy_ints_and_refuses_the_rest_by_name() -> None:
    assert as_int(3, "n") == 3
    got = as_int(np.int64(7), "n")
    assert got == 7 and type(got) is int
    for bad in (True, 2.0, "3", None):
        with pytest.raises(ValueError, match=r"^n must be an int, got "):
            as_int(bad, "n")


def test_as_int_with_a_minimum_names_it() -> None:
    assert as_int(0, "processes", minimum=0) == 0
    assert as_int(np.int32(2), "max_context", minimum=2) == 2
    for bad in (1, -1, True, 2.5, "2"):
        with pytest.raises(ValueError, match=r"^max_context must be an int >= 2, got "):
            as_int(bad, "max_context", minimum=2)


def test_is_real_excludes_bools() -> None:
    assert is_real(1) and is_real(0.5) and is_real(np.float32(2.0)) and is_real(np.int8(1))
    assert not is_real(True) and not is_real("1") and not is_real(None)


def test_greedy_is_reported_under_temperature_one() -> None:
    assert scored_temperature(0.0) == 1.0
    assert scored_temperature(SamplingParams(max_tokens=1, temperature=0).temperature) == 1.0
    for t in (MIN_TEMPERATURE, 0.7, 1.0, 2.5):
        assert scored_temperature(t) == t
