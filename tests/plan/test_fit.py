"""dew plan --from-run: a run folder made from known parameters is fitted back to them.

The records are written the way a run writes them: rollouts of known lengths go through
the scheduler's :class:`StepProfiler`, with a source whose time outside the engine and
an engine fleet whose iterations are drawn from known distributions.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dew.core import (
    Call,
    EngineTimings,
    IterationLog,
    LogHistogram,
    Rollout,
    RolloutKey,
    Status,
    Task,
)
from dew.objectives.rl.config import SchedulerConfig
from dew.objectives.rl.profile import StepProfiler
from dew.plan import cli
from dew.plan.fit import MIN_STEPS, RunError, fit_records, fit_run

TRUE = {
    "median": 300.0,
    "sigma_task": 0.5,
    "sigma_sample": 0.6,
    "cap": 4096,
    "latency": 0.2,
    "latency_sigma": 0.5,
    "T": 1.5,
    "a": 4e-3,
    "b": 5e-5,
    "max_active": 64,
    "sharing": 0.6,
}
TASKS, GROUP, ENGINES = 16, 8, 2


class _Fleet:
    """Two engines' cumulative iteration logs, fed by the test."""

    def __init__(self) -> None:
        self.logs = [IterationLog() for _ in range(ENGINES)]

    def timings(self) -> list[EngineTimings]:
        return [
            EngineTimings(f"http://127.0.0.1:{9000 + i}", TRUE["max_active"], log.snapshot())
            for i, log in enumerate(self.logs)
        ]


class _Source:
    def __init__(self) -> None:
        self.outside = LogHistogram()
        self.engine = _Fleet()


def _rollout(task: int, sample: int, length: int, cap: int) -> Rollout:
    truncated = length >= cap
    n = min(length, cap)
    call = Call(
        np.zeros(40, dtype=np.int64),
        np.zeros(n, dtype=np.int64),
        np.zeros(n),
        0,
        finish_reason="length" if truncated else "stop",
    )
    return Rollout(
        RolloutKey(task, sample, 0),
        Task(str(task)),
        Status.TRUNCATED if truncated else Status.COMPLETED,
        (call,),
        reward=0.0,
        truncation="length" if truncated else None,
    )


def write_run(folder: Path, steps: int = 30, seed: int = 0) -> Path:
    """A run folder whose records were made from ``TRUE``."""
    rng = np.random.default_rng(seed)
    source = _Source()
    config = SchedulerConfig(groups=GROUP, ahead=1, max_lag=1)
    profiler = StepProfiler(config, source)
    folder.mkdir(parents=True, exist_ok=True)
    lines: list[dict[str, Any]] = []
    beside: list[float] = []  # per step: engine seconds beside the trainer (engine mean)
    for step in range(steps):
        mu = math.log(TRUE["median"])
        task_means = rng.normal(mu, TRUE["sigma_task"], size=TASKS)
        groups = []
        for t in range(TASKS):
            lengths = np.rint(np.exp(rng.normal(task_means[t], TRUE["sigma_sample"], GROUP)))
            groups.append(
                [
                    _rollout(step * TASKS + t, s, max(int(n), 1), TRUE["cap"])
                    for s, n in enumerate(lengths)
                ]
            )
        for x in TRUE["latency"] * np.exp(TRUE["latency_sigma"] * rng.normal(size=TASKS * GROUP)):
            source.outside.add(float(x))
        # beside the trainer's work (its last step's training, this one's push), then
        # alone while it waits: the same loads, iterations 1 / sharing times as long
        beside_seconds = [0.0] * ENGINES
        for alone in (False, True):
            if alone:
                profiler.wait_begins()
            for i, log in enumerate(source.engine.logs):
                for k in rng.integers(1, TRUE["max_active"] + 1, size=150):
                    noise = float(np.exp(rng.normal(0.0, 0.05)))
                    took = (TRUE["a"] + TRUE["b"] * int(k)) * noise
                    if not alone:
                        took /= TRUE["sharing"]
                        beside_seconds[i] += took
                    log.add(int(k), took)
        profiler.wait_ends()
        waited = float(rng.uniform(0.1, 0.5))
        beside.append(sum(beside_seconds) / ENGINES)
        lines.append(
            {
                "step": step + 1,
                "waited": waited,
                "scheduler": {"waited": waited, "groups": TASKS},
                "profile": profiler.step(groups, [], []),
            }
        )
    # the trainer's busy time stretched by the engine seconds beside it (counted in the
    # next step's profile): work T alone, (1 - sharing) of each engine second lost
    for k, r in enumerate(lines):
        e = beside[min(k + 1, len(beside) - 1)]
        work = TRUE["T"] * float(np.exp(rng.normal(0.0, 0.02)))
        r["seconds"] = work + (1 - TRUE["sharing"]) * e + r.pop("waited")
    (folder / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (folder / "config.json").write_text(json.dumps({"task": "tail", "max_tokens": TRUE["cap"]}))
    return folder


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_run(tmp_path_factory.mktemp("run"))


def test_the_fit_recovers_the_parameters_the_records_were_made_from(run: Path) -> None:
    fit = fit_run(run, skip=2)
    p = fit.lengths
    # 448 task means of sigma 0.5: the log-median's standard error is about 0.026, so
    # three of them and half a bucket of the sketch make the bound
    assert math.exp(p.mu) == pytest.approx(TRUE["median"], rel=0.1)
    assert p.sigma == pytest.approx(math.hypot(TRUE["sigma_task"], TRUE["sigma_sample"]), abs=0.06)
    assert p.sigma_task == pytest.approx(TRUE["sigma_task"], abs=0.1)
    assert p.sigma_sample == pytest.approx(TRUE["sigma_sample"], abs=0.1)
    assert p.cap == TRUE["cap"]
    assert fit.latency == pytest.approx(TRUE["latency"], rel=0.06)
    assert fit.latency_sigma == pytest.approx(TRUE["latency_sigma"], abs=0.05)
    assert fit.sharing == pytest.approx(TRUE["sharing"], rel=0.03)
    assert fit.T == pytest.approx(TRUE["T"], rel=0.03)
    assert fit.engine.a == pytest.approx(TRUE["a"], rel=0.05)
    assert fit.engine.b == pytest.approx(TRUE["b"], rel=0.05)
    assert fit.engine.max_active == TRUE["max_active"]
    assert (fit.engines, fit.tasks, fit.group, fit.steps) == (ENGINES, TASKS, GROUP, 28)
    assert set(fit.per_engine) == {"http://127.0.0.1:9000", "http://127.0.0.1:9001"}
    assert fit.policy.name == "ahead 1"
    assert fit.warnings == ()
    # the run's own limit, step by step: max(its train time, its tokens at full throughput)
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()][2:]
    full = fit.engine.full_throughput * ENGINES
    limit = sum(
        max(
            r["seconds"] - r["scheduler"]["waited"],
            LogHistogram.from_json(r["profile"]["lengths"]["finished"]).mean * TASKS * GROUP / full,
        )
        for r in records
    )
    elapsed = sum(r["seconds"] for r in records)
    assert fit.measured.limit_fraction == pytest.approx(limit / elapsed)
    assert fit.measured.profile_cpu > 0


def test_the_cli_prints_the_fit_beside_the_run_and_the_overrides_to_run_its_choice(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        cli.main(["--from-run", str(run), "--skip-steps", "2", "--steps", "8", "--warmup", "2"])
        == 0
    )
    out = capsys.readouterr().out
    assert "fitted on 28 steps: 16 tasks x 8 per step, policy ahead 1" in out
    assert "run's" in out  # each fitted figure beside the run's own
    assert "ahead 1 (this run)" in out
    assert "this run, predicted against measured:" in out
    recommended = [line for line in out.splitlines() if line.startswith("recommended: ")]
    assert len(recommended) == 1
    assert "  run it: dew demo --task tail --ahead " in out


def test_a_run_with_too_few_steps_or_old_records_gets_one_line_saying_what_is_missing(
    run: Path, tmp_path: Path
) -> None:
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    with pytest.raises(RunError, match=f"at least {MIN_STEPS}") as short:
        fit_records(records[:6], skip=3)
    assert "\n" not in str(short.value)
    old = [{k: v for k, v in r.items() if k != "profile"} for r in records]
    with pytest.raises(RunError, match="no profile: records from a dew older") as stale:
        fit_records(old)
    assert "\n" not in str(stale.value)
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    done = subprocess.run(
        [sys.executable, "-m", "dew.cli", "plan", "--from-run", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith("dew plan: error: steps 1..30 have no profile")
    with pytest.raises(RunError, match="no step records"):
        fit_run(tmp_path / "nothing-here")


def test_from_run_refuses_the_flags_it_fits(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--from-run", str(run), "--T", "0.5"])
    assert exit_.value.code == 2
    assert "--from-run fits --T from the run's records" in capsys.readouterr().err


def test_a_run_that_cut_its_tail_is_fitted_with_a_warning(tmp_path: Path) -> None:
    records = [
        json.loads(line)
        for line in (write_run(tmp_path, steps=8).joinpath("records.jsonl"))
        .read_text()
        .splitlines()
    ]
    for r in records:
        r["profile"]["policy"]["oversample"] = 2
    fit = fit_records(records, skip=1)
    assert any("biased short" in w for w in fit.warnings)
    assert fit.policy.oversample == 2
