"""``dew train`` with ``scheduler.policy = "auto"``: the probe steps, the planner's
choice kept in plan.json with its reasons, and the rest of the run on the chosen knobs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dew.job.config import ConfigError, load_config
from dew.job.run import prepare, train
from dew.plan.auto import Adoption
from tests.job.test_train_cli import config, dew_train, make_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("model"))


def _auto(tmp_path: Path, model_dir: Path, steps: int) -> Path:
    return config(
        tmp_path,
        model_dir,
        **{
            "steps = 3": f"steps = {steps}",
            "eval_every = 2": "eval_every = 100",
            "wandb = true": "wandb = false",
            'truncation = "score"': 'truncation = "score"\npolicy = "auto"\nprobe_steps = 8',
        },
    )


def _policies(run: Path) -> list[tuple[int, int]]:
    lines = (run / "records.jsonl").read_text().splitlines()
    return [(r["step"], r["profile"]["policy"]["ahead"]) for r in map(json.loads, lines)]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_auto_probes_then_keeps_the_planners_choice_and_why(
    tmp_path: Path, model_dir: Path
) -> None:
    done = dew_train(str(_auto(tmp_path, model_dir, steps=10)))
    assert done.returncode == 0, done.stderr
    run = tmp_path / "run"
    chosen = json.loads((run / "plan.json").read_text())
    assert chosen["probe_steps"] == 8
    assert chosen["policy"] is not None and set(chosen["knobs"]) == {
        "ahead",
        "max_lag",
        "oversample",
        "admit",
    }
    # why: the fit beside the run's figures, the ranking and the choice, also said
    assert chosen["reason"][0] == "fitted on 6 steps: 2 tasks x 4 per step, policy ahead 1"
    assert chosen["reason"][-1].startswith(f"adopted {chosen['policy']}")
    assert f"dew train: plan: adopted {chosen['policy']}" in done.stderr
    policies = _policies(run)
    assert [s for s, _ in policies] == list(range(1, 11))  # each step once
    assert {a for s, a in policies if s > 8} == {chosen["knobs"]["ahead"]}


@pytest.mark.timeout(300)
def test_the_chosen_knobs_take_effect_after_the_probe_and_on_resume(
    tmp_path: Path, model_dir: Path
) -> None:
    calls: list[Any] = []

    def choose(run: Path, *, skip: int) -> Adoption:
        calls.append((run, skip))
        knobs = {"ahead": 2, "max_lag": 2, "oversample": 0, "admit": None}
        return Adoption("ahead 2", knobs, ["a reason"])

    path = _auto(tmp_path, model_dir, steps=10)
    train(prepare(load_config(path)), progress=False, choose=choose)
    run = tmp_path / "run"
    assert calls == [(run, 2)]  # a quarter of the probe left out
    assert _policies(run) == [(s, 1) for s in range(1, 9)] + [(9, 2), (10, 2)]
    # a resume goes on with the choice kept in plan.json: no second probe
    longer = load_config(path, ["--training.steps", "12"])
    train(prepare(longer, resume=True), resume=True, progress=False, choose=choose)
    assert len(calls) == 1
    assert _policies(run)[-2:] == [(11, 2), (12, 2)]


def test_auto_fields_are_checked_by_name(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"scheduler.probe_steps: .*must be >= 8"):
        load_config(_auto(tmp_path, model_dir, steps=20), ["--scheduler.probe_steps", "4"])
    with pytest.raises(ConfigError, match=r"scheduler\.probe_steps: 8 probe steps leave none"):
        load_config(_auto(tmp_path, model_dir, steps=8))
    config = load_config(_auto(tmp_path, model_dir, steps=20))
    assert config.scheduler.policy == "auto"
    assert "policy" not in config.scheduler_config().__dict__  # not a scheduler knob
    with pytest.raises(ConfigError, match=r'scheduler\.policy: "auto" needs the planner'):
        train(prepare(config), progress=False)
    assert not (tmp_path / "run").exists()  # refused before it trained: nothing left
