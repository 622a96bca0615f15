"""bench/async_steps.py: a variant's fields reach the run, and the table's figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ._tiny import BENCH, bench_module, run_tiny
from .test_bench_vs_trl_smoke import RunResult, RunSpec


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_async_steps_bench_tiny_runs_each_variant_with_its_fields(tmp_path: Path) -> None:
    run_tiny(
        "async_steps.py",
        280,
        "--variant", "sync:ahead=0,max_lag=0",
        "--variant", "masked:ahead=1,max_lag=1,importance='mask',importance_cap=1.5",
        "--save", str(tmp_path),
    )  # fmt: skip
    saved = {p.name: RunResult.from_json(p.read_text()) for p in tmp_path.glob("tail-*.json")}
    assert set(saved) == {"tail-sync-0.json", "tail-masked-0.json"}
    masked = saved["tail-masked-0.json"]
    assert masked.spec.overrides == {
        "ahead": 1, "max_lag": 1, "importance": "mask", "importance_cap": 1.5
    }  # fmt: skip
    assert masked.steps == 2 and masked.load is not None
    assert masked.diagnostics["lag"] >= 0
    # the objective it trained with: the overrides over the task's own settings
    assert "importance='mask'" in masked.objective and "importance_cap=1.5" in masked.objective
    assert "clip_behavior='both'" in masked.objective  # the tail task's, not overridden


def _saved(folder: Path, name: str, seed: int, steps: int, ahead: int, objective: str = "") -> None:
    spec = RunSpec(
        "dew", "tail", seed=seed, threads=1, max_seconds=600.0, max_steps=300,
        stop_at_reward=True, threshold=0.15, overrides={"ahead": ahead},
    )  # fmt: skip
    result = RunResult(
        spec=spec,
        rows=64,
        rewards=[0.1] * (steps - 2) + [0.4, 0.4],  # the window reaches 0.15 at the last step
        step_seconds=[0.2 * (i + 1) for i in range(steps)],
        idle=[0.0] * steps,
        stopped="reward",
        load=0.01,
        diagnostics={"lag": float(ahead), "admitted_len": 40.0, "behavior_clipped": 0.0125},
        objective=objective,
    )
    (folder / f"tail-{name}-{seed}.json").write_text(result.to_json())


@pytest.mark.timeout(120)
def test_the_table_pairs_each_variant_with_sync_seed_by_seed(tmp_path: Path) -> None:
    for seed, (sync, ahead) in enumerate([(100, 110), (120, 120), (110, 132)]):
        _saved(tmp_path, "sync", seed, sync, 0)
        _saved(tmp_path, "a2", seed, ahead, 2, "GRPOObjective(clip=0.2)")
    (tmp_path / "run.json").write_text(json.dumps({"command": "saved"}))
    out = subprocess.run(
        [sys.executable, str(BENCH / "async_steps.py"), "--load", str(tmp_path),
         "--variant", "sync:ahead=0", "--variant", "a2:ahead=2"],
        capture_output=True, text=True, timeout=100, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    # what each ran with; sync's runs predate the saved objective
    assert "- sync: `{'ahead': 0}`\n" in out.stdout
    assert "- a2: `{'ahead': 2}`, trained with `GRPOObjective(clip=0.2)`\n" in out.stdout
    # a2 / sync per seed: 1.10, 1.00, 1.20; the reward at step 100 is 0.1, but for the
    # sync seed that reaches the threshold right there (0.16)
    assert (
        "| a2 | 0-2 | 110, 120, 132 | 120 (110-132) | 1.10x (1.00x-1.20x) | 0.100 (0.100-0.100) |"
        in (out.stdout)
    )
    assert "| sync | 0-2 | 100, 120, 110 | 110 (100-120) | - | 0.100 (0.100-0.160) |" in out.stdout
    # seconds to it are 0.2 a step: sync 20, 24, 22 against a2 22, 24, 26.4; medians 22
    # over 24 = 0.9166.. (rounded down), per seed 0.91, 1.00, 0.83
    assert "| 24.0 (22.0-26.4) | 0.91x; 0.91x (0.83x-1.00x) |" in out.stdout
    assert "| 22.0 (20.0-24.0) | - |" in out.stdout
    assert "| 2.00 | 40.0 | - | - | 1.25% |" in out.stdout  # lag, lengths, KL, behavior clip
    assert "quiet: other work took at most 0.01 cores" in out.stdout


@pytest.mark.timeout(120)
def test_load_with_seeds_renders_only_those_seeds(tmp_path: Path) -> None:
    for seed, (sync, ahead) in enumerate([(100, 110), (120, 120), (110, 132)]):
        _saved(tmp_path, "sync", seed, sync, 0)
        _saved(tmp_path, "a2", seed, ahead, 2)
    (tmp_path / "run.json").write_text(json.dumps({"command": "saved"}))

    def render(*seeds: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(BENCH / "async_steps.py"), "--load", str(tmp_path),
             "--variant", "sync:ahead=0", "--variant", "a2:ahead=2", *seeds],
            capture_output=True, text=True, timeout=100, check=False,
        )  # fmt: skip

    half = render("--seeds", "1,2")
    assert half.returncode == 0, half.stderr[-3000:]
    assert "### tail (seeds 1, 2)" in half.stdout
    assert "| a2 | 1-2 | 120, 132 |" in half.stdout
    assert "| sync | 1-2 | 120, 110 |" in half.stdout
    assert "| a2 | 0-2 | 110, 120, 132 |" in render().stdout  # no --seeds: every saved seed
    none = render("--seeds", "7")
    assert none.returncode != 0 and "no saved runs of seeds [7]" in none.stderr


def test_a_variant_is_parsed_and_a_name_that_is_no_file_name_refused() -> None:
    steps = bench_module("async_steps")
    name, fields = steps.parse_variant("a 2:ahead=2,importance='mask',clip_high=None")
    assert (name, fields) == ("a 2", {"ahead": 2, "importance": "mask", "clip_high": None})
    # the name goes into each saved run's file name: refused before anything runs
    with pytest.raises(SystemExit, match=r"the name '1 to 2/3' may not hold '/'"):
        steps.parse_variant("1 to 2/3:ahead=3")
