"""A very short demo end to end through the ``dew`` entry point: train, resume, plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dew.train import latest_checkpoint, read_records

DEW = Path(sys.executable).with_name("dew")
SMALL = ["--batch-size", "2", "--group-size", "4", "--no-progress"]


def dew(*args: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([str(DEW), *args], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def check_run(run: Path, steps: int, starts: tuple[int, ...] = (1,)) -> list[dict]:
    """Check a demo run folder; ``starts``: the steps a process began at (resumes)."""
    records = read_records(run)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        sched = r["scheduler"]
        assert sched["updates"] == r["step"] - 1
        # ahead=1: a process's first batch is sampled by the weights it starts with; each
        # later one was submitted a step before it is trained on, one version behind.
        assert sched["lag"] == (0 if r["step"] in starts else 1), (r["step"], sched)
        assert sched["groups"] + sched["cut"] + sched["abandoned"] <= 2
        assert sum(len(ids) for ids in r["tasks"].values()) == 2  # every task accounted for
    assert latest_checkpoint(run) == run / f"checkpoints/step-{steps:08d}"
    assert (run / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return records


@pytest.mark.timeout(600)
def test_demo_trains_resumes_and_plots(tmp_path: Path) -> None:
    task = "single"
    run = tmp_path / "run"
    out = dew("demo", "--task", task, "--steps", "3", "--run-dir", str(run), *SMALL)
    assert "mean reward, first 10% of steps" in out.stdout
    config = json.loads((run / "config.json").read_text())
    assert config["task"] == task and config["steps"] == 3 and config["ahead"] == 1
    first = check_run(run, 3)
    assert any("reward/mean" in r["scheduler"]["metrics"] for r in first)

    dew("demo", "--resume", str(run), "--steps", "5", "--no-progress")
    records = check_run(run, 5, starts=(1, 4))
    assert records[:3] == first  # the resumed run kept the history it restored
    assert json.loads((run / "config.json").read_text())["steps"] == 5

    (run / "plot.png").unlink()
    out = dew("plot", str(run))
    assert out.stdout.strip() == str(run / "plot.png")
    assert (run / "plot.png").stat().st_size > 10_000


@pytest.mark.timeout(600)
@pytest.mark.parametrize("task", ["guess", "agent", "tail", "tail-turns"])
def test_the_other_example_tasks_run(tmp_path: Path, task: str) -> None:
    run = tmp_path / task
    out = dew("demo", "--task", task, "--steps", "2", "--run-dir", str(run), *SMALL)
    records = check_run(run, 2)
    if task in ("agent", "tail-turns"):  # every episode packs into one chain
        merged = [r["scheduler"]["metrics"].get("merge_ratio") for r in records]
        assert all(m == 1.0 for m in merged if m is not None)
    if task.startswith("tail"):  # the workload's parameters are printed with the result
        from dew.demo.tail import Workload

        assert Workload().describe() in out.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_on_a_fleet_of_two_engine_processes(tmp_path: Path) -> None:
    run = tmp_path / "fleet"
    dew("demo", "--engines", "2", "--steps", "3", "--run-dir", str(run), *SMALL)
    records = check_run(run, 3)
    assert json.loads((run / "config.json").read_text())["engines"] == 2
    assert any("reward/mean" in r["scheduler"]["metrics"] for r in records)


def test_engines_must_be_a_count() -> None:
    from dew.demo.run import DemoConfig

    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match=r"engines=.* must be an int >= 0"):
            DemoConfig(engines=bad)  # type: ignore[arg-type]


@pytest.mark.timeout(300)
def test_harness_processes_run_the_agent_demo_in_processes_of_its_own() -> None:
    import os

    from dew.core import RolloutKey, Status, Task
    from dew.demo.model import make_model, make_tokenizer
    from dew.demo.run import TASKS, DemoConfig, demo_recipe
    from dew.recipe import Needs
    from dew.serving import RolloutServer

    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match=r"harness_processes=.* must be an int >= 0"):
            DemoConfig(harness_processes=bad)  # type: ignore[arg-type]
    config = DemoConfig.for_task("agent", harness_processes=2)
    recipe = demo_recipe(config)
    with RolloutServer(make_model(max_positions=config.positions), max_batch=8) as server:
        needs = Needs(None, 0, 8, recipe.sampling, 0)  # the agent source reads the last two
        parts = TASKS["agent"](config, server, make_tokenizer(), needs)
        try:
            pids = parts.source._procs.pids()  # type: ignore[attr-defined]
            assert len(pids) == 2 and os.getpid() not in pids
            rollout = parts.source.start(Task("0"), RolloutKey(0, 0, 0)).result(120)
        finally:
            parts.close()
    assert rollout.status is Status.COMPLETED and len(rollout.calls) == 2


def test_a_tensor_axis_needs_torchrun(tmp_path: Path) -> None:
    from dew.demo.run import DemoConfig, DemoError, run_demo

    with pytest.raises(ValueError, match="tensor=0 must be an int >= 1"):
        DemoConfig(tensor=0)
    with pytest.raises(DemoError, match="tensor=2 needs that many processes"):
        run_demo(DemoConfig(steps=1, tensor=2), run_dir=tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_the_demo_bounds_every_rollout_attempt() -> None:
    from contextlib import ExitStack

    from dew.demo.run import DemoConfig, build_job

    assert DemoConfig().timeout == 120.0  # the library's default (None) never gives up
    with ExitStack() as stack:
        job = build_job(DemoConfig(steps=1, timeout=7.5), stack)
        assert job.scheduler.config.timeout == 7.5


def test_the_demo_passes_its_scheduling_knobs_on() -> None:
    from dew.demo.run import DemoConfig

    config = DemoConfig.for_task("tail", oversample=2, ahead=2, max_lag=2)
    sched = config.scheduler_config()
    assert (sched.oversample, sched.ahead, sched.max_lag) == (2, 2, 2)
    assert sched.truncation == "score"  # the heavy-tailed tasks score truncated answers
    assert DemoConfig().scheduler_config().oversample == 0
    with pytest.raises(ValueError, match="oversample"):
        DemoConfig(oversample=-1)


def test_the_heavy_tailed_tasks_build_a_model_their_chains_fit() -> None:
    from contextlib import ExitStack

    from dew.demo.run import DemoConfig, build_job

    assert DemoConfig().positions == 256
    for task in ("tail", "tail-turns"):
        config = DemoConfig.for_task(task, steps=1, batch_size=2, group_size=2)
        with ExitStack() as stack:
            job = build_job(config, stack)
            assert job.model.config.max_position_embeddings == config.positions == 512
            # the engine serves the whole chain (EnvironmentSource refuses a context
            # wider than the engine's at construction)
            assert job.engine.max_len == config.positions
            assert "lognormal" in job.describe
            # stale rollouts keep most of their correction (the task's cap, not 2)
            assert job.objective.importance_cap == config.importance_cap == 10.0
            # and stop pushing what the policy already moved since they were sampled
            assert config.clip_behavior is True
            assert job.objective.clip_behavior == "both"


def test_the_demo_passes_its_objective_knobs_on() -> None:
    from contextlib import ExitStack

    from dew.demo.run import DemoConfig, build_job

    assert DemoConfig().importance is None  # None: the objective's own default
    with ExitStack() as stack:
        config = DemoConfig(
            steps=1, importance="mask", importance_cap=3.0, clip_behavior="negative"
        )
        job = build_job(config, stack)
        assert (job.objective.importance, job.objective.importance_cap) == ("mask", 3.0)
        assert job.objective.clip_behavior == "negative"
        default = build_job(DemoConfig(steps=1), stack).objective
        assert (default.importance, default.importance_cap) == ("truncate", 2.0)
        assert default.clip_behavior is False


def test_the_demo_passes_admit_wait_to_its_engine() -> None:
    import inspect
    from contextlib import ExitStack

    from dew.demo.run import DemoConfig, build_job
    from dew.serving import RolloutServer

    served = inspect.signature(RolloutServer).parameters["admit_wait"].default
    with ExitStack() as stack:
        assert build_job(DemoConfig(steps=1), stack).engine.admit_wait == served
        assert build_job(DemoConfig(steps=1, admit_wait=0), stack).engine.admit_wait == 0
