"""The multi-turn demo environment: higher/lower feedback, agent errors, latency, scores."""

from __future__ import annotations

import pytest

from dew.core import Task
from dew.demo.guess import GuessEnv, make_env, target_of
from dew.objectives.rl.sources import AgentError, Environment


def test_binary_search_solves_it() -> None:
    env = GuessEnv(low=0, high=99, seed=4)
    assert isinstance(env, Environment)
    assert env.reset(Task("17")) == "guess 0-99"
    low, high, guesses = 0, 99, 0
    while True:
        mid = (low + high) // 2
        guesses += 1
        hint = env.step(f" {mid}\n")
        if hint is None:
            break
        low, high = (mid + 1, high) if hint == "higher" else (low, mid - 1)
    assert mid == env.target and guesses <= 7
    assert env.score() == {"solved": 1.0, "quick": 1.0 / guesses}


def test_invalid_replies_are_the_agents_fault() -> None:
    env = GuessEnv(low=1, high=5)
    env.reset(Task("0"))
    for reply in ["", "five", "3.5", "-1", "6", "٣"]:
        with pytest.raises(AgentError):
            env.step(reply)
    assert env.score() == {"solved": 0.0, "quick": 0.0}


def test_targets_are_reproducible_and_respect_task_data() -> None:
    targets = [target_of(Task(str(i)), low=0, high=9, seed=1) for i in range(200)]
    assert targets == [target_of(Task(str(i)), low=0, high=9, seed=1) for i in range(200)]
    assert set(targets) == set(range(10))
    assert targets != [target_of(Task(str(i)), low=0, high=9, seed=2) for i in range(200)]
    env = GuessEnv()
    env.reset(Task("3", {"target": 7}))
    assert env.step("7") is None
    with pytest.raises(ValueError, match="outside"):
        GuessEnv(high=5).reset(Task("3", {"target": 7}))


def test_latency_is_spent_in_every_step() -> None:
    slept: list[float] = []
    env = GuessEnv(latency=0.25, sleep=slept.append)
    env.reset(Task("0", {"target": 2}))
    env.step("1")
    env.step("2")
    assert slept == [0.25, 0.25]


def test_factory_validates_and_makes_fresh_envs() -> None:
    make = make_env(low=0, high=3, latency=0.0)
    a, b = make(), make()
    assert a is not b and (a.low, a.high) == (0, 3)
    with pytest.raises(ValueError, match="low"):
        make_env(low=5, high=1)
    with pytest.raises(ValueError, match="latency"):
        make_env(latency=-1)
    with pytest.raises(RuntimeError, match="reset"):
        GuessEnv().step("1")
