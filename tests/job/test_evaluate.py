"""Evaluation: k samples per eval row from the trainer's model, scored by the rewards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dew.core import Call, SamplingParams, Task
from dew.demo.model import make_model, make_tokenizer
from dew.job.data import load_rows
from dew.job.evaluate import evaluate
from dew.job.rewards import RewardError


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Any]:
    path = tmp_path_factory.mktemp("eval") / "e.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"{d}=", "answer": d}) + "\n" for d in ("12", "34", "56"))
    )
    tok = make_tokenizer()
    rows = load_rows(
        str(path), column="prompt", chat=False, tokenizer=tok, max_len=64, max_tokens=4
    )
    return make_model(size="tiny", max_positions=64), tok, rows


def run(setup: tuple[Any, Any, Any], verifier: Any, **kw: Any) -> dict[str, Any]:
    model, tok, rows = setup
    args = {"samples": 3, "temperature": 1.0, "threshold": 1.0, "chat": False}
    return evaluate(model, tok, rows, verifier, SamplingParams(max_tokens=4), **(args | kw))


def test_mean_reward_and_pass_at_k(setup: tuple[Any, Any, Any]) -> None:
    seen: list[tuple[str, str, int]] = []

    def first_id(task: Task, text: str, call: Call) -> dict[str, float]:
        seen.append((task.id, text, len(call.completion)))
        return {"r": 1.0 if call.completion[0] % 2 == 0 else 0.0}

    got = run(setup, first_id)
    assert len(seen) == 9 and {t for t, _, _ in seen} == {"0", "1", "2"}
    assert all(1 <= n <= 4 for _, _, n in seen)
    assert got["rows"] == 3 and got["samples"] == 3 and got["errors"] == 0
    assert 0.0 <= got["reward/mean"] <= 1.0 and 0.0 <= got["pass@3"] <= 1.0
    always = run(setup, lambda task, text, call: {"r": 1.0})
    assert (always["reward/mean"], always["pass@3"]) == (1.0, 1.0)
    never = run(setup, lambda task, text, call: {"r": 0.5})
    assert (never["reward/mean"], never["pass@3"]) == (0.5, 0.0)
    assert run(setup, lambda t, x, c: {"r": 0.5}, threshold=0.5)["pass@3"] == 1.0


def test_greedy_is_repeatable_and_sampling_follows_the_seed(setup: tuple[Any, Any, Any]) -> None:
    texts: list[list[str]] = [[], [], [], []]

    def keep(i: int) -> Any:
        return lambda task, text, call: texts[i].append(text) or {"r": 0.0}

    run(setup, keep(0), temperature=0.0, samples=2)
    run(setup, keep(1), temperature=0.0, samples=2)
    assert texts[0] == texts[1] and texts[0][0] == texts[0][1]  # greedy: one answer
    run(setup, keep(2), seed=1)
    run(setup, keep(3), seed=1)
    assert texts[2] == texts[3]


def test_a_failing_reward_is_counted_not_scored(setup: tuple[Any, Any, Any]) -> None:
    def broken(task: Task, text: str, call: Call) -> dict[str, float]:
        raise RewardError("reward my.py:fn raised KeyError: 'answer'")

    got = run(setup, broken)
    assert got["errors"] == 9 and got["pass@3"] == 0.0
    assert got["first_error"] == "reward my.py:fn raised KeyError: 'answer'"
    assert got["reward/mean"] != got["reward/mean"]  # nan: nothing was scored


def test_eval_config_is_checked(tmp_path: Path) -> None:
    from dew.job.config import ConfigError, load_config

    from .test_config import BASE

    path = tmp_path / "c.toml"
    path.write_text(BASE.replace("steps = 10", "steps = 10\neval_every = 5"))
    with pytest.raises(ConfigError, match=r"training\.eval_every: set data\.eval_path"):
        load_config(path)


def test_probe_tries_the_first_rows_on_the_models_own_short_completions(
    setup: tuple[Any, Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import dew.job.evaluate as evaluate_module

    model, tok, rows = setup
    seen: list[tuple[str, int]] = []

    def fails_on_row_1(task: Task, text: str, call: Call) -> dict[str, float]:
        seen.append((task.id, len(call.completion)))
        if task.id == "1":
            raise RewardError("reward r raised KeyError: 'answer'")
        return {"r": 1.0}

    monkeypatch.setattr(evaluate_module, "PROBE_TOKENS", 5)  # the model has 64 positions
    sampling = SamplingParams(max_tokens=20)
    got = evaluate_module.probe(model, tok, rows, fails_on_row_1, sampling, chat=False, seed=0)
    assert got == (1, 3, "reward r raised KeyError: 'answer'")
    assert [t for t, _ in seen] == ["0", "1", "2"]  # one completion of each row
    assert max(n for _, n in seen) == 5  # cut short: a probe, not a run
