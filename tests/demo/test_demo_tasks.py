"""The single-turn demo task: seeded prompts, the partial-credit verifier, chance level."""

from __future__ import annotations

import numpy as np
import pytest

from dew.core import Call, RolloutKey, SamplingParams, Status, Task
from dew.demo.model import make_model, make_tokenizer
from dew.demo.tasks import make_prompts, make_task, score
from dew.objectives.rl.sources import PromptSource
from dew.serving import RolloutServer

TOK = make_tokenizer()
EOS = TOK.eos_token_id


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def test_prompts_are_seeded_digit_strings() -> None:
    a = make_prompts(50, seed=1)
    assert a == make_prompts(50, seed=1) and a != make_prompts(50, seed=2)
    assert all(s.isdigit() and 2 <= len(s) <= 4 for s in a)
    assert {len(s) for s in make_prompts(200, seed=0, min_digits=3, max_digits=3)} == {3}
    with pytest.raises(ValueError, match="n must be"):
        make_prompts(0)
    with pytest.raises(ValueError, match="min_digits"):
        make_prompts(3, min_digits=4, max_digits=2)


def test_task_prompts_answers_and_ids() -> None:
    task = make_task(20, seed=3, tokenizer=TOK)
    assert task.texts == make_prompts(20, seed=3)
    for text, prompt, answer in zip(task.texts, task.prompts, task.answers, strict=True):
        assert prompt == ids(text + "=") and answer == ids(text)
    assert task.max_prompt == max(len(p) for p in task.prompts)
    assert task.eos == EOS


def test_partial_credit() -> None:
    answer = ids("407")
    assert score(answer, [*answer, EOS], EOS) == {"digits": 0.75, "stop": 0.25}
    assert sum(score(answer, [*ids("4x7"), EOS], EOS).values()) == pytest.approx(0.75)
    assert score(answer, ids("407"), EOS) == {"digits": 0.75, "stop": 0.0}  # never stopped
    assert score(answer, [*ids("4071"), EOS], EOS)["stop"] == 0.0  # stopped late
    assert sum(score(answer, [EOS], EOS).values()) == 0.0
    # the stop weighs stop_weight digit positions; at 0 only the digits count
    assert score(answer, [*ids("4x7"), EOS], EOS, stop_weight=0.0) == {
        "digits": pytest.approx(2 / 3),
        "stop": 0.0,
    }
    assert score(answer, ids("407"), EOS, stop_weight=0.0)["digits"] == 1.0
    assert score(answer, [*ids("40"), EOS], EOS, stop_weight=0.5) == {
        "digits": pytest.approx(2 / 3.5),
        "stop": 0.0,
    }
    assert score(answer, [*answer, EOS], EOS, stop_weight=0.5)["stop"] == pytest.approx(0.5 / 3.5)
    with pytest.raises(ValueError, match="stop_weight"):
        score(answer, answer, EOS, stop_weight=-1.0)
    task = make_task(5, seed=0, tokenizer=TOK)
    right = [*task.answers[2], EOS]
    call = Call(
        prompt=task.prompts[2],
        completion=right,
        log_probs=[0.0] * len(right),
        version=0,
        finish_reason="stop",
    )
    assert sum(task.verifier(Task("2"), right[:-1], call).values()) == 1.0
    digits_only = make_task(5, seed=0, tokenizer=TOK, stop_weight=0.0)
    wrong_stop = Call(
        prompt=task.prompts[2],
        completion=right[:-1],  # all digits right, no stop: full credit when it is worth 0
        log_probs=[0.0] * (len(right) - 1),
        version=0,
        finish_reason="length",
    )
    assert sum(digits_only.verifier(Task("2"), right[:-1], wrong_stop).values()) == 1.0
    assert sum(task.verifier(Task("2"), right[:-1], wrong_stop).values()) < 1.0


def demo_settings() -> dict:
    """The single task exactly as ``dew demo`` builds it."""
    from dew.demo.run import DemoConfig

    config = DemoConfig.for_task("single")
    low, high = config.digits
    task = {"min_digits": low, "max_digits": high, "stop_weight": config.stop_weight}
    return {"task": task, "max_tokens": config.max_tokens}


def test_the_demo_settings_allow_full_credit() -> None:
    settings = demo_settings()
    task = make_task(32, seed=0, tokenizer=TOK, **settings["task"])
    for prompt, answer in zip(task.prompts, task.answers, strict=True):
        best = [*answer, EOS][: settings["max_tokens"]]  # what a perfect policy emits
        call = Call(prompt, best, [0.0] * len(best), 0, "stop")
        assert sum(score(answer, call.completion, EOS, stop_weight=task.stop_weight).values()) == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["defaults", "demo"])
def test_an_untrained_model_is_far_below_the_goal(which: str) -> None:
    settings = demo_settings() if which == "demo" else {"task": {}, "max_tokens": 8}
    task = make_task(64, seed=0, tokenizer=TOK, **settings["task"])
    with (
        RolloutServer(make_model("qwen2", "tiny", seed=0), seed=0) as server,
        PromptSource(
            server,
            task.prompts,
            task.verifier,
            workers=16,
            sampling=SamplingParams(max_tokens=settings["max_tokens"], stop_ids=[EOS]),
        ) as source,
    ):
        sessions = [source.start(Task(str(i)), RolloutKey(0, i, 0)) for i in range(64)]
        rollouts = [s.result(timeout=60) for s in sessions]
    assert {r.status for r in rollouts} <= {Status.COMPLETED, Status.TRUNCATED}
    rewards = np.array([r.reward for r in rollouts], dtype=float)
    # chance is about one position in a hundred; guessing digits only would get 0.1
    assert rewards.mean() < 0.1
    assert ((rewards >= 0) & (rewards <= 1)).all()
