"""bench/vs_trl.py end to end for a couple of steps, and the pieces its figures rest on."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from dew.core import Task
from dew.demo.model import make_tokenizer

from ._tiny import BENCH, run_tiny


def _load_common() -> ModuleType:
    # loaded from its file, so bench/ never goes onto sys.path for the other tests
    spec = importlib.util.spec_from_file_location(
        "bench_vs_trl_common", BENCH / "_vs_trl_common.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


common = _load_common()
RunResult, RunSpec, TwoTurnCopyEnv = common.RunResult, common.RunSpec, common.TwoTurnCopyEnv
make_two_turn, time_to_reward = common.make_two_turn, common.time_to_reward
two_turn_max_chain = common.two_turn_max_chain


def test_time_to_reward_needs_a_full_window_at_the_threshold() -> None:
    seconds = [float(i + 1) for i in range(14)]
    # one perfect step early on is not a window of 10
    assert time_to_reward([1.0] + [0.0] * 13, seconds) is None
    rewards = [0.0] * 4 + [1.0] * 10
    # windows ending at steps 10..14 average 0.6, 0.7, ..., 1.0: the first is enough
    assert time_to_reward(rewards, seconds) == (10, 10.0)
    assert time_to_reward([0.59] * 30, [1.0] * 30) is None
    assert time_to_reward([0.6] * 10, seconds[:10]) == (10, 10.0)
    with pytest.raises(ValueError, match="differ in length"):
        time_to_reward([0.1], [])


def test_run_result_figures_and_json_round_trip() -> None:
    spec = RunSpec(
        "trl", "single", seed=3, threads=2, max_seconds=9.0, max_steps=20, stop_at_reward=True
    )
    result = RunResult(
        spec=spec, rows=128, rewards=[0.7] * 10, step_seconds=[0.5 * (i + 1) for i in range(10)]
    )
    assert result.completions_per_second == pytest.approx(10 * 128 / 5.0)
    assert result.seconds_per_step == pytest.approx(0.5)
    assert result.reached() == (10, 5.0)
    assert RunResult.from_json(result.to_json()) == result
    with pytest.raises(ValueError, match="system="):
        RunSpec("vllm", "single", 0, 2, 1.0, 1, True)
    # the heavy-tailed runs: their own threshold, the trainer's idle share, peak memory
    tail = RunSpec("dew", "tail", 0, 2, 9.0, 20, stop_at_reward=True, threshold=0.19, oversample=2)
    rewards = [0.1] * 7 + [0.3] * 10
    waited = RunResult(
        spec=tail,
        rows=64,
        rewards=rewards,
        step_seconds=[float(i + 1) for i in range(17)],
        idle=[0.5] * 17,
        peak_rss_mb=812.5,
    )
    # windows ending at steps 10, 11, 12 average 0.16, 0.18, 0.20: the spec's 0.19, not
    # the default threshold, decides
    assert waited.reached() == (12, 12.0)
    assert waited.idle_share == pytest.approx(8.5 / 17)
    assert RunResult.from_json(waited.to_json()) == waited
    assert RunResult(spec=tail, rows=64).idle_share == 0.0
    with pytest.raises(ValueError, match="oversample=-1"):
        RunSpec("dew", "tail", 0, 2, 9.0, 20, True, oversample=-1)
    with pytest.raises(ValueError, match="task="):
        RunSpec("dew", "tails", 0, 2, 9.0, 20, True)


def test_two_turn_env_scores_each_turn_with_the_demo_verifier() -> None:
    tokenizer = make_tokenizer()
    task = make_two_turn(4, seed=0, tokenizer=tokenizer)
    slept: list[float] = []
    env = TwoTurnCopyEnv(task, latency=0.02, sleep=slept.append)
    first, second = task.parts[2]
    assert env.reset(Task(id="2")) == first + "="
    assert env.step(first) == second + "="  # all three digits right
    wrong = "".join("1" if c != "1" else "2" for c in second)
    assert env.step(second[0] + wrong[1:]) is None  # one of three right; the episode ends
    assert env.score() == pytest.approx({"turn1": 0.5, "turn2": 0.5 / 3})
    assert slept == [0.02, 0.02]
    with pytest.raises(ValueError, match="no such two-turn task"):
        env.reset(Task(id="4"))
    # the longest episode: chat prompt, 3 tokens, end of turn + next user turn, 3 tokens
    assert two_turn_max_chain(tokenizer, 3) > 2 * 3 + len(first)


def _figures(text: str) -> list[str]:
    """The headings, table rows and ratio lines of a vs_trl.py report."""
    return [line for line in text.splitlines() if line.startswith(("###", "|", "- "))]


# Slow step: a whole benchmark run, which make test's ten minutes cannot spare.
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_vs_trl_bench_tiny(tmp_path: Path) -> None:
    out = run_tiny("vs_trl.py", 150, "--latency", "0.01", "--save", str(tmp_path))
    text = out.stdout
    assert "### two-turn copy task, 10 ms environment latency" in text
    # every run's result and how they were made; --load renders the same figures again
    assert len(list(tmp_path.glob("*-0.json"))) == 5
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["command"].endswith(f"--tiny --latency 0.01 --save {tmp_path}")
    assert run["seconds"] > 0
    again = subprocess.run(
        [sys.executable, str(BENCH / "vs_trl.py"), "--load", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=25,
        check=False,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    # the settings are the saved runs' (10 ms latency here), not this command's defaults
    assert _figures(again.stdout) == _figures(text) and len(_figures(text)) > 10
    rate = r"[\d,]+"
    for system in ("dew", "TRL"):
        row = re.search(
            rf"^\| {system} \| 0 \| not reached in 2 steps \| 2 \| ({rate}) \| (\d+\.\d+) \|$",
            text,
            re.M,
        )
        assert row, text
        assert int(row[1].replace(",", "")) > 0 and float(row[2]) > 0
        assert re.search(
            rf"^\| {system} \| median \| .+ \| 2 \| {rate} \| \d+\.\d+ \|$", text, re.M
        )
    for run in (
        "dew async \\(ahead 1\\)",
        "dew sync \\(ahead 0\\)",
        "TRL GRPOTrainer \\(rollout_func\\)",
    ):
        row = re.search(
            rf"^\| {run} \| 0 \| 2 \| (\d+\.\d+) \| ({rate}) "
            rf"\| not reached in 2 steps \| (\d+\.\d+) \|$",
            text,
            re.M,
        )
        assert row, text
        assert float(row[1]) > 0 and int(row[2].replace(",", "")) > 0
        # Two steps of an untrained model: a digit right now and then, nowhere near the
        # bench's threshold (a reward on the wrong scale, or always 1, would be).
        assert 0.0 <= float(row[3]) < 0.3, row[0]
    assert re.search(r"^- completions/s, dew / TRL \(medians\): \d+\.\d+x$", text, re.M), text
    assert re.search(r"^- completions/s, dew async / dew sync: \d+\.\d+x$", text, re.M), text
