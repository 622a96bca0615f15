"""dew.pool across real processes (torchrun or plain processes over gloo).

Each test launches workers (tests/pool/pool_worker.py) that train the tiny demo model
with fit() through a real RolloutScheduler, and reads what each rank reported.
Every launch has a hard timeout and kills whatever it started (see _launch.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.pool._launch import Run, direct, torchrun

STEPS = 3


def _ok(run: Run, n: int) -> None:
    assert run.leftover == [], f"processes left running: {run.leftover}\n{run.output}"
    assert run.returncodes and all(rc == 0 for rc in run.returncodes), run.output
    assert sorted(run.ranks) == list(range(n)), run.output
    for r, out in run.ranks.items():
        assert "error" not in out, f"rank {r}: {out.get('traceback')}"


def _check_pool(run: Run, n: int) -> None:
    try:
        _check_pool_runs(run, n)
    except AssertionError as exc:  # say what every rank saw
        raise AssertionError(
            f"{exc}\n{json.dumps(run.ranks)[:6000]}\n{run.output[-3000:]}"
        ) from exc


def _check_pool_runs(run: Run, n: int) -> None:
    _ok(run, n)
    ranks = [run.ranks[r] for r in range(n)]
    # 1. Synchronized after every update, and the updates really changed the model.
    for out in ranks:
        # Closing the pool stopped gloo's threads (none left to die with the interpreter).
        assert out["threads_after_close"] in (None, 1), out["threads_after_close"]
        assert out["synchronized"] == list(range(1, STEPS + 1))
        assert len(set(out["params"])) == STEPS
    assert all(out["params"] == ranks[0]["params"] for out in ranks)
    # Each process read its own share of every global batch and trained its own rows.
    for step in range(STEPS):
        tasks = [set(out["calls"][step]["tasks"]) for out in ranks]
        assert sum(len(t) for t in tasks) == len(set().union(*tasks)), "shares overlap"
        assert all(
            set(map(int, out["calls"][step]["trained"])) == t
            for out, t in zip(ranks, tasks, strict=True)
        )
        assert len({out["calls"][step]["digest"] for out in ranks}) == n
    # 2. Every process pushed at the same calls with the same version.
    pushes = [[(c["updates"], c["pushed"]) for c in out["calls"]] for out in ranks]
    assert all(p == pushes[0] for p in pushes)
    assert [v for _, vs in pushes[0] for v in vs] == list(range(STEPS))
    assert all(out["engine_loads"] == list(range(STEPS)) for out in ranks)
    # 3. Proximal log-probs are this process's own rescoring; the normalizer is shared.
    for out in ranks:
        for call in out["calls"]:
            assert call["proximal_equal"], call
            assert call["trained_tokens"] > 0
    assert len({c["normalizer"] for out in ranks for c in out["calls"]}) == 1
    for out in ranks:
        assert out["logged"] == STEPS
        assert out["started"] >= 2 * 2 * STEPS  # groups x tasks per share x steps


@pytest.mark.timeout(150)
def test_two_processes_train_in_lockstep(tmp_path: Path) -> None:
    run = torchrun(2, {"steps": STEPS, "diverge_check": True}, tmp_path)
    _check_pool(run, 2)
    # The synchronization check is not vacuous: a perturbed parameter is caught everywhere.
    for out in run.ranks.values():
        assert "rank 1: parameter" in out["divergence_caught"], out
        assert out["grad_mean_ok"], out


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_four_processes_train_in_lockstep(tmp_path: Path) -> None:
    _check_pool(torchrun(4, {"steps": STEPS}, tmp_path), 4)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_shares_first_reader_samples_later_readers_follow(tmp_path: Path) -> None:
    run = torchrun(4, {"steps": STEPS, "readers_per_share": 2}, tmp_path)
    _ok(run, 4)
    ranks = [run.ranks[r] for r in range(4)]
    assert [(o["share"], o["reader"]) for o in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for first, later in ((ranks[0], ranks[1]), (ranks[2], ranks[3])):
        assert first["started"] > 0 and first["logged"] == STEPS
        assert later["started"] == 0 and later["logged"] == 0
        # The later reader trains on exactly the rows the first reader packed.
        assert [c["digest"] for c in later["calls"]] == [c["digest"] for c in first["calls"]]
        assert all(c["proximal_equal"] for c in later["calls"])
    assert ranks[0]["calls"][0]["digest"] != ranks[2]["calls"][0]["digest"]
    assert all(o["params"] == ranks[0]["params"] for o in ranks)
    assert all(o["pushes"] == list(range(STEPS)) for o in ranks)


FAILURES = {
    # kind: (failing rank, extra config, what survivors must name as the cause)
    "raise": (1, {}, "RuntimeError: scripted source failure on rank 1"),
    # The kill lands on a source thread at any moment: before the agreement (survivors
    # time out there) or just after it (their next collective fails; the post-mortem
    # round names the dead rank).
    "kill": (3, {}, "did not reach "),
    # Killed after the pool agreed on the call: the survivors' gradient collective
    # breaks and the post-mortem round names the dead rank.
    "kill_in_step": (1, {}, "did not reach post-mortem/0"),
    "hang": (2, {"rollout_timeout": 16.0, "max_attempts": 1}, "did not reach agree/"),
}


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", sorted(FAILURES))
def test_one_failing_process_fails_the_whole_pool(tmp_path: Path, kind: str) -> None:
    rank, extra, cause = FAILURES[kind]
    config = {
        "steps": 4,
        # Generous against a loaded machine: a healthy but slow process must not be
        # named instead of the failing one. The hang outlasts it (rollout_timeout).
        "agree_timeout": 8.0,
        "pg_timeout": 15.0,  # bounds a survivor stuck in a collective with another survivor
        "fail": {"rank": rank, "kind": kind, "at_version": 2},
        **extra,
    }
    run = direct(4, config, tmp_path)
    assert run.leftover == [], f"processes left running: {run.leftover}\n{run.output}"
    assert run.failed_at is not None, run.output
    killed = kind.startswith("kill")
    survivors = [r for r in range(4) if r != rank] if killed else list(range(4))
    assert sorted(run.ranks) == survivors, run.output
    for r in survivors:
        out = run.ranks[r]
        assert run.returncodes[r] == 3, (r, run.returncodes, run.output)
        assert f"rank {rank} of 4" in out["error"], (r, out["error"])
        others = [f"rank {o} of 4" for o in range(4) if o != rank]
        assert not any(o in out["error"] for o in others), (r, out["error"])  # no bystander
        if r != rank or kind == "raise":
            assert cause in out["error"], (r, out["error"])
        assert out["exit_time"] - run.failed_at < 60.0
        assert f"rank {r}: " in run.output  # the error is on the process's stderr too
    if killed:
        assert run.returncodes[rank] == -9
    if kind == "hang":
        assert "arrived after the pool gave up on it" in run.ranks[rank]["error"]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_resume_after_a_killed_process_trains_every_task_once(tmp_path: Path) -> None:
    import numpy as np

    from dew.data import Dataset
    from dew.train import read_records

    steps, runs = 6, tmp_path / "runs"
    base = {"steps": steps, "run_dir": str(runs), "checkpoint_every": 1}
    killed = torchrun(
        2, {**base, "fail": {"rank": 1, "kind": "kill", "at_version": 3}}, tmp_path / "a"
    )
    assert killed.leftover == [], killed.output
    assert killed.returncodes[0] != 0 and killed.failed_at is not None, killed.output
    partial = [len(read_records(runs / f"rank{r}")) for r in range(2)]
    assert all(0 < n < steps for n in partial), partial

    run = torchrun(2, {**base, "resume": True}, tmp_path / "b")
    _ok(run, 2)
    assert all(out["resumed_from"] for out in run.ranks.values())
    # Every task of every global batch is accounted for exactly once across the pool.
    dataset = Dataset({"task_id": np.arange(64)}, batch_size=2 * 2, seed=1)
    records = [read_records(runs / f"rank{r}") for r in range(2)]
    assert [len(rs) for rs in records] == [steps, steps]
    for position in range(steps):
        seen: list[str] = []
        for rs in records:
            (record,) = [rec for rec in rs if rec["position"] == position]
            for outcome in ("trained", "abandoned", "cut", "dropped"):
                seen += record["tasks"].get(outcome, [])
        expected = sorted(str(int(t)) for t in dataset.batch(position)["task_id"])
        assert sorted(seen) == expected, (position, seen, expected)
