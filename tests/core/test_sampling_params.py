"""SamplingParams: validated once, normalized, refusals name the field."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dew.core import MIN_TEMPERATURE, SamplingParams


def test_defaults_and_normalization() -> None:
    p = SamplingParams(max_tokens=np.int64(8), temperature=1, top_k=np.int32(5), stop_ids=[3, 4])
    assert p.max_tokens == 8 and type(p.max_tokens) is int
    assert p.temperature == 1.0 and type(p.temperature) is float
    assert p.top_k == 5 and type(p.top_k) is int
    assert p.stop_ids == (3, 4)
    assert SamplingParams(max_tokens=2).stop_ids is None  # the eos of whoever owns it
    assert SamplingParams(max_tokens=2, stop_ids=range(0)).stop_ids == ()
    # Equal settings compare equal and hash alike (usable as keys).
    assert SamplingParams(4, stop_ids=[1]) == SamplingParams(4, 1.0, stop_ids=(1,))
    assert len({SamplingParams(4), SamplingParams(4)}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_tokens = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"max_tokens": True}, "max_tokens must be an int"),
        ({"max_tokens": 2.0}, "max_tokens must be an int"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"temperature": 1e-300}, r"temperature must be 0 \(greedy\) or >= 0.01"),
        ({"temperature": 0.0099}, r"temperature must be 0 \(greedy\) or >= 0.01"),
        ({"top_k": 0}, "top_k must be >= 1"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": True}, "top_p"),
        ({"stop_ids": 3}, "stop_ids"),
        ({"stop_ids": "x"}, "stop_ids"),
        ({"stop_ids": [-1]}, "stop_ids"),
        ({"stop_ids": [1.5]}, "stop_ids"),
    ],
)
def test_refusals_name_the_field(kwargs: dict[str, object], message: str) -> None:
    args = {"max_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        SamplingParams(**args)  # type: ignore[arg-type]


def test_the_lowest_temperature_and_greedy_are_taken() -> None:
    assert SamplingParams(max_tokens=1, temperature=MIN_TEMPERATURE).temperature == 0.01
    assert SamplingParams(max_tokens=1, temperature=0).temperature == 0.0
