"""bench/vs_trl_tail.py --load: the figures rendered from saved runs, ratios rounded down."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ._tiny import BENCH
from .test_bench_vs_trl_smoke import RunResult, RunSpec


def _saved(folder: Path, label: str, system: str, reach: float, ahead: int = 2) -> None:
    spec = RunSpec(
        system, "tail", seed=0, threads=1, max_seconds=900.0, max_steps=400,
        stop_at_reward=True, ahead=ahead, oversample=2 if ahead else 0, threshold=0.15,
    )  # fmt: skip
    # ten steps of reward 1.0, the tenth (the first full window) ending at ``reach`` s
    result = RunResult(
        spec=spec,
        rows=64,
        rewards=[1.0] * 10,
        step_seconds=[reach * (i + 1) / 10 for i in range(10)],
        idle=[0.0] * 10,
        stopped="reward",
        peak_rss_mb=500.0,
    )
    (folder / f"tail-{label}-0.json".replace(" ", "_")).write_text(result.to_json())


@pytest.mark.timeout(120)
def test_a_ratio_just_under_its_target_never_reads_as_the_target(tmp_path: Path) -> None:
    _saved(tmp_path, "dew (ahead 2, os 2)", "dew", 10.0)
    _saved(tmp_path, "dew sync (ahead 0)", "dew", 17.984, ahead=0)  # 1.7984x: under 1.8
    _saved(tmp_path, "TRL GRPOTrainer", "trl", 40.0)
    (tmp_path / "run.json").write_text(json.dumps({"command": "saved"}))
    out = subprocess.run(
        [sys.executable, str(BENCH / "vs_trl_tail.py"), "--tasks", "tail", "--load", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "| dew sync (ahead 0) | median | 18.0 s |" in text
    # rounded half up this would read 1.80x beside "NOT met"
    assert "vs dew sync: 1.79x (1 run); completions/s 1.79x; target >= 1.8x: NOT met" in text
    assert "vs TRL: 4.00x (1 run); completions/s 4.00x; target >= 2x: met" in text
