"""The examples as a newcomer runs them: the assets made, then ``dew train`` on its
defaults, which must train from the first step and say so at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.mark.timeout(300)
def test_the_addition_example_trains_on_its_defaults_from_the_first_step(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    made = subprocess.run(
        [sys.executable, str(EXAMPLES / "make_assets.py")], cwd=tmp_path, env=env, check=False
    )
    assert made.returncode == 0
    argv = [sys.executable, "-m", "dew.cli", "train", str(EXAMPLES / "add.toml"), "--no-progress"]
    argv += ["--rewards.0.function", f"{EXAMPLES / 'add_reward.py'}:add_reward"]
    argv += ["--training.steps", "3"]
    done = subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "examples" / "add"
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    # 8 prompts x 4 samples x at most 3 tokens: most of them train from the first step
    # (a completion cut at max_tokens is scored, not masked).
    assert records[0]["trained_tokens"] >= 48, records[0]
    said = [line for line in done.stderr.splitlines() if line.startswith("dew train: ")]
    first = records[0]["trained_tokens"]
    assert said[-3].startswith("dew train: 3 steps in ") and f"{first} at the first" in said[-3]
    assert said[-1].startswith("dew train: done; exported to runs/examples/add/export")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_multi_gpu_example_checks_its_devices_then_runs_where_it_is_told(
    tmp_path: Path,
) -> None:
    """Its GPUs are checked against this machine before anything runs; told to put the
    trainer and its three engines (behind the router) on the CPU, it trains."""
    import torch

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    made = subprocess.run(
        [sys.executable, str(EXAMPLES / "make_assets.py")], cwd=tmp_path, env=env, check=False
    )
    assert made.returncode == 0
    argv = [sys.executable, "-m", "dew.cli", "train", str(EXAMPLES / "multi-gpu.toml")]
    argv += ["--no-progress", "--rewards.0.function", f"{EXAMPLES / 'add_reward.py'}:add_reward"]

    def train(*more: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*argv, *more], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=380,
            check=False,
        )  # fmt: skip

    run = tmp_path / "runs" / "examples" / "multi-gpu"
    if torch.cuda.device_count() < 4:
        done = train()
        assert done.returncode == 2, done.stderr[-3000:]
        assert done.stderr.startswith("dew train: error: training.device: cuda:0: ")
        assert done.stderr.count("\n") == 1 and not run.exists()
    done = train(
        "--training.device", "cpu", "--engine.devices", "cpu,cpu,cpu",
        "--training.steps", "2", "--training.tasks", "4",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and records[0]["trained_tokens"] > 0
