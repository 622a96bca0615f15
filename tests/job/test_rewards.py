"""Reward functions by import path, in TRL's signature or dew's, weighted and checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from dew.core import Call, Task
from dew.job.rewards import (
    RewardError,
    boxed_format,
    combine,
    exact_answer,
    final_answer,
    labels,
    load_reward,
)

ROWS = [
    {"prompt": "2+2=", "answer": "4", "level": 1},
    {"prompt": "3+3=", "answer": "6", "level": 2},
]


def call(ids: list[int]) -> Call:
    return Call(prompt=[1, 2], completion=ids, log_probs=[-0.5] * len(ids), version=0)


def reward_file(tmp_path: Path, body: str) -> str:
    path = tmp_path / "my_rewards.py"
    path.write_text(body)
    return str(path)


def test_trl_and_dew_signatures_combine_with_weights(tmp_path: Path) -> None:
    seen: dict[str, object] = {}
    path = reward_file(
        tmp_path,
        """
def trl(prompts, completions, completion_ids, answer, level, **kwargs):
    SEEN.update(prompts=prompts, completions=completions, ids=completion_ids, level=level)
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

def dew_style(task, completion, call):
    return {"len": len(completion) / 10, "level": task.data["level"] / 10}

def unscored(prompts, completions, **kwargs):
    return [None]
""",
    )
    trl = load_reward(f"{path}:trl", 2.0)
    trl.fn.__globals__["SEEN"] = seen
    rewards = [trl, load_reward(f"{path}:dew_style", 0.5), load_reward(f"{path}:unscored")]
    assert [r.batched for r in rewards] == [True, False, True]
    verifier = combine(rewards, ROWS, prompt_column="prompt", chat=False)
    parts = verifier(Task("1"), "6", call([9]))
    assert parts == {"trl": 2.0, "dew_style": pytest.approx(0.5 * 0.3)}  # named by function
    assert seen == {"prompts": ["3+3="], "completions": ["6"], "ids": [[9]], "level": [2]}
    chat = combine(rewards[:1], ROWS, prompt_column="prompt", chat=True)
    with pytest.raises(RewardError, match="raised AttributeError"):  # a list has no strip
        chat(Task("0"), "4", call([9]))


def test_a_trl_reward_scores_a_group_in_one_call_and_a_raise_lands_on_its_rows(
    tmp_path: Path,
) -> None:
    path = reward_file(
        tmp_path,
        """
import asyncio

CALLS = []

def sevens(prompts, completions, completion_ids, answer, level, **kwargs):
    CALLS.append((list(prompts), list(completions), list(answer), list(level)))
    if any(c.endswith("7") for c in completions):
        raise ValueError("no sevens")
    return [len(c) for c in completions]

async def later(prompts, completions, **kwargs):  # TRL takes an async def too
    await asyncio.sleep(0)
    return [0.5] * len(completions)

def nan_on_b(prompts, completions, **kwargs):
    return [float("nan") if c == "b" else 1.0 for c in completions]
""",
    )
    sevens = load_reward(f"{path}:sevens")
    calls = sevens.fn.__globals__["CALLS"]
    rewards = [sevens, load_reward(f"{path}:later"), load_reward(f"{path}:nan_on_b")]
    verifier = combine(rewards, ROWS, prompt_column="prompt", chat=False)
    texts = ["a", "bb", "ccc"]
    got = verifier.score_group(Task("1"), texts, [call([1])] * 3)
    assert got == [
        {"sevens": 1.0, "later": 0.5, "nan_on_b": 1.0},
        {"sevens": 2.0, "later": 0.5, "nan_on_b": 1.0},
        {"sevens": 3.0, "later": 0.5, "nan_on_b": 1.0},
    ]
    # One call for the group, the row's prompt and columns repeated per completion.
    assert calls == [(["3+3="] * 3, texts, ["6"] * 3, [2] * 3)]
    calls.clear()
    got = verifier.score_group(Task("0"), ["a", "b7", "b"], [call([1])] * 3)
    assert len(calls) == 4  # the group's call raised: then one completion at a time
    assert got[0] == {"sevens": 1.0, "later": 0.5, "nan_on_b": 1.0}
    assert isinstance(got[1], RewardError) and "raised ValueError: no sevens" in str(got[1])
    assert isinstance(got[2], RewardError) and "nan_on_b returned nan" in str(got[2])


def test_a_failing_reward_is_an_error_naming_it_never_a_zero(tmp_path: Path) -> None:
    path = reward_file(
        tmp_path,
        """
def boom(prompts, completions, **kwargs):
    raise KeyError("answer")

def nan(prompts, completions, **kwargs):
    return [float("nan")]

def two(prompts, completions, **kwargs):
    return [1.0, 0.0]

def none(prompts, completions, **kwargs):
    return [None]

def text(task, completion, call):
    return "1.0"
""",
    )
    for name, message in [
        ("boom", r"reward .*:boom raised KeyError"),
        ("nan", r"reward .*:nan returned nan, not a finite number"),
        ("two", r"reward .*:two returned \[1.0, 0.0\], not a list of one value"),
        ("none", r"no reward function scored this rollout"),
        ("text", r"reward .*:text returned '1.0', not a finite number"),
    ]:
        verifier = combine(
            [load_reward(f"{path}:{name}")], ROWS, prompt_column="prompt", chat=False
        )
        with pytest.raises(RewardError, match=message):
            verifier(Task("0"), "4", call([9]))


def test_numpy_scalars_score_as_in_trl_and_an_overflow_names_the_function(
    tmp_path: Path,
) -> None:
    path = reward_file(
        tmp_path,
        """
import numpy as np

def f32(prompts, completions, **kwargs):
    return [np.float32(0.5)]

def i64(prompts, completions, **kwargs):
    return [np.int64(2)]

def huge(prompts, completions, **kwargs):
    return [10**400]

def parts(task, completion, call):
    return {"a": np.float64(0.25), "b": 10**400}
""",
    )
    for name, want in (("f32", 0.5), ("i64", 2.0)):
        verifier = combine(
            [load_reward(f"{path}:{name}")], ROWS, prompt_column="prompt", chat=False
        )
        (value,) = verifier(Task("0"), "4", call([9])).values()
        assert value == want and type(value) is float
    for name in ("huge", "parts"):
        verifier = combine(
            [load_reward(f"{path}:{name}")], ROWS, prompt_column="prompt", chat=False
        )
        with pytest.raises(RewardError, match=rf"reward .*:{name} returned 1000.*not a finite"):
            verifier(Task("0"), "4", call([9]))


def test_loading_errors_name_the_function(tmp_path: Path) -> None:
    path = reward_file(tmp_path, "import not_a_module_anywhere\n")
    cases = [
        ("nowhere.py:fn", "no such file"),
        ("dew_no_such_package.sub:fn", "no such module"),
        (f"{path}:fn", "importing .* failed: ModuleNotFoundError"),
        ("dew.job.rewards:nothing_here", "has no 'nothing_here'"),
        ("dew.job.rewards:__all__", "is not callable"),
        ("dew.job.rewards:final_answer", r"expected TRL's signature .* got \(text\)"),
        ("justaname", "name a function as"),
    ]
    for spec, message in cases:
        with pytest.raises(RewardError, match=message):
            load_reward(spec)


def test_builtins() -> None:
    assert final_answer("so \\boxed{12} or \\boxed{ 13 }") == "13"
    assert final_answer("it is 7, then -3.5") == "-3.5"
    assert final_answer("no number") is None
    got = exact_answer(
        ["q"] * 4,
        ["\\boxed{4}", "4.0", [{"role": "assistant", "content": "x = 5"}], "nothing"],
        answer=["4", "4", "5", "4"],
    )
    assert got == [1.0, 1.0, 1.0, 0.0]
    assert boxed_format(["q"] * 3, ["\\boxed{1}", "\\boxed{1}\\boxed{2}", "1"]) == [1.0, 0.0, 0.0]
    builtin = load_reward("dew.job.rewards:exact_answer")
    assert builtin.batched
    verifier = combine([builtin], ROWS, prompt_column="prompt", chat=False)
    assert verifier(Task("0"), "the answer is \\boxed{4}", call([9])) == {"exact_answer": 1.0}
    assert verifier(Task("1"), "5", call([9])) == {"exact_answer": 0.0}


def test_rewards_are_named_by_function_unless_two_share_a_name(tmp_path: Path) -> None:
    path = reward_file(tmp_path, "def exact_answer(task, completion, call):\n    return 1.0\n")
    mine = load_reward(f"{path}:exact_answer")
    builtin = load_reward("dew.job.rewards:exact_answer")
    fmt = load_reward("dew.job.rewards:boxed_format")
    assert labels([builtin, fmt]) == ["exact_answer", "boxed_format"]
    assert labels([mine, builtin, fmt]) == [mine.name, builtin.name, "boxed_format"]
