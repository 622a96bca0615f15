"""dew.pool across real processes (torchrun or plain processes over gloo).

Each test launches workers (tests/pool/pool_worker.py) that train the tiny demo model
with fit() through a real RolloutScheduler, and reads what each rank reported.
Every launch has a hard timeout and kills whatever it started (see _launch.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.pool._launch import Run, direct, single, torchrun

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
    # Gloo's threads, which live as long as torch's DTensor caches hold the mesh, did not
    # abort a process on its way out ("terminate called ...": exit code -6).
    assert "terminate called" not in run.output
    for out in ranks:
        assert len(out["losses"]) == STEPS and len(set(out["params"])) == STEPS
    # 1. One model: the whole weights (gathered) are the same on every process.
    assert all(out["params"] == ranks[0]["params"] for out in ranks)
    # Each share read its own part of every global batch and trained its own rows.
    shares = [ranks[r] for r in range(0, n, n // _data(ranks))]  # the first readers
    for step in range(STEPS):
        tasks = [set(out["calls"][step]["tasks"]) for out in shares]
        assert sum(len(t) for t in tasks) == len(set().union(*tasks)), "shares overlap"
        assert all(
            set(map(int, out["calls"][step]["trained"])) == t
            for out, t in zip(shares, tasks, strict=True)
        )
        assert len({out["calls"][step]["digest"] for out in shares}) == len(shares)
    # 2. Every process pushed at the same calls with the same version, and the engine
    # got the whole weights of that version: those after the step before the push.
    pushes = [[(c["updates"], c["pushed"]) for c in out["calls"]] for out in ranks]
    assert all(p == pushes[0] for p in pushes)
    assert [v for _, vs in pushes[0] for v in vs] == list(range(STEPS))
    for out in ranks:
        assert out["engine_loads"] == list(range(STEPS))
        assert out["engine_weights"][1:] == out["params"][: STEPS - 1]
    # 3. Proximal log-probs are the pool's own rescoring; the normalizer is shared.
    for out in ranks:
        for call in out["calls"]:
            assert call["proximal_equal"], call
            assert call["trained_tokens"] > 0
    assert len({c["normalizer"] for out in ranks for c in out["calls"]}) == 1


def _data(ranks: list[dict]) -> int:
    return len({out["share"] for out in ranks})


def _matches_one_process(run: Run, n: int, reference: dict) -> None:
    """The pool's step losses (the mean over its shares) and gradient norms are the
    single process's on the same global batches, to float rounding."""
    assert "error" not in reference, reference.get("traceback")
    ranks = [run.ranks[r] for r in range(n)]
    for step in range(STEPS):
        pool_loss = sum(out["losses"][step] for out in ranks) / n
        # The GRPO loss starts near 0 (importance ratio 1, advantages of mean 0), so
        # the gradient norm, a reduction over every parameter, is compared as well.
        assert pool_loss == pytest.approx(reference["losses"][step], rel=1e-4, abs=1e-7), step
        for out in ranks:
            norm = out["grad_norms"][step]
            assert norm == pytest.approx(reference["grad_norms"][step], rel=1e-5), step
    assert reference["grad_norms"][0] > 1e-3  # a real gradient, not a vacuous match


def _sizes(out: dict) -> tuple[float, float]:
    """This process's share of the parameters and of Adam's two moments."""
    sizes = out["sizes"]
    total = sizes["params_total"]
    return sizes["params_local"] / total, sizes["optimizer_local"] / (2 * total)


@pytest.mark.slow  # multi-process: the slow step (keeps `make test` in its budget)
@pytest.mark.timeout(200)
def test_two_processes_shard_the_model_and_match_one_process(tmp_path: Path) -> None:
    config = {"steps": STEPS, "global_tasks": 4}
    run = torchrun(2, config, tmp_path / "pool")
    _check_pool(run, 2)
    _matches_one_process(run, 2, single({**config, "shares": 2}, tmp_path / "one"))
    for out in run.ranks.values():
        params, moments = _sizes(out)
        # FSDP2 shards every parameter by rows; a shard is padded to equal length.
        assert params == pytest.approx(0.5, abs=0.01), out["sizes"]
        assert moments == pytest.approx(0.5, abs=0.01), out["sizes"]
        assert out["logged"] == STEPS
        assert out["started"] >= 2 * 2 * STEPS  # groups x tasks per share x steps


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_data_and_tensor_axes_shard_the_model_and_match_one_process(tmp_path: Path) -> None:
    config = {"steps": STEPS, "global_tasks": 4, "tensor": 2}
    run = torchrun(4, config, tmp_path / "pool", timeout=240)
    _check_pool(run, 4)
    _matches_one_process(run, 4, single({**config, "shares": 2}, tmp_path / "one"))
    ranks = [run.ranks[r] for r in range(4)]
    assert [(o["share"], o["reader"]) for o in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for first, later in ((ranks[0], ranks[1]), (ranks[2], ranks[3])):
        # Read once: the first reader sampled and logged; the later one started nothing
        # and trained on exactly the rows the first reader packed.
        assert first["started"] > 0 and first["logged"] == STEPS
        assert later["started"] == 0 and later["logged"] == 0
        assert [c["digest"] for c in later["calls"]] == [c["digest"] for c in first["calls"]]
        assert later["losses"] == first["losses"]
    assert ranks[0]["calls"][0]["digest"] != ranks[2]["calls"][0]["digest"]
    for out in ranks:
        params, moments = _sizes(out)
        # Along data, half of everything; along tensor, the projections halve again
        # (embeddings and norms stay whole there): between a quarter and a half.
        assert 0.25 < params < 0.4 and 0.25 < moments < 0.4, out["sizes"]


FAILURES = {
    # kind: (failing rank, extra config, what survivors must name as the cause)
    "raise": (1, {}, "RuntimeError: scripted source failure on rank 1"),
    # The kill lands on a source thread at any moment: before the agreement (survivors
    # time out there) or just after it (their next collective fails; the post-mortem
    # round names the dead rank, by its deadline or, when a survivor was held longer
    # in a collective with another survivor, by its silent heartbeat).
    "kill": (3, {}, ("did not reach ", "has not beaten for")),
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
            causes = (cause,) if isinstance(cause, str) else cause
            assert any(c in out["error"] for c in causes), (r, out["error"])
        assert out["exit_time"] - run.failed_at < 60.0
        assert f"rank {r}: " in run.output  # the error is on the process's stderr too
    if killed:
        assert run.returncodes[rank] == -9
    if kind == "hang":
        assert "arrived after the pool gave up on it" in run.ranks[rank]["error"]


@pytest.mark.timeout(150)
def test_a_process_whose_share_trains_nothing_stops_every_process_at_the_same_step(
    tmp_path: Path,
) -> None:
    # Rank 1's source fails every attempt from call 1 on: its share trains no token,
    # rank 0's trains on. At rank 1's bound every process raises TrainingStalled at the
    # same step, naming rank 1 and its errors, instead of rank 1 alone.
    config = {
        "steps": 8,
        "max_attempts": 1,
        "max_empty_steps": 2,
        "fail": {"rank": 1, "kind": "infra", "at_version": 1},
    }
    run = direct(2, config, tmp_path, timeout=120)
    assert run.leftover == [], run.output
    assert run.returncodes == [3, 3], run.output
    errors = [run.ranks[r]["error"] for r in (0, 1)]
    assert errors[0] == errors[1], errors  # one agreed error
    assert errors[0].startswith("TrainingStalled: rank 1 of 2: 2 steps in a row ("), errors
    assert "sandbox gone on rank 1" in errors[0] and "rank 0 of 2" not in errors[0]
    steps = [len(run.ranks[r]["losses"]) for r in (0, 1)]
    assert steps[0] == steps[1] < 8, steps  # both stopped after the same step
    stopped_at = int(errors[0].split("..")[1].split(")")[0])
    assert steps[0] == stopped_at


def _records(run_dir: Path, rank: int) -> list[dict]:
    from dew.train import read_records

    return read_records(run_dir if rank == 0 else run_dir / f"rank{rank}")


def _same_steps(a: list[dict], b: list[dict], steps: range) -> None:
    """Records of the same steps in two runs: the same data position, the same tasks by
    outcome, the same tokens trained, the same loss and gradient norm. (Groups are
    packed in the order they complete, which thread timing decides, so the sums behind
    loss and norm may round differently: equal to float rounding, not bit for bit.)"""
    for step in steps:
        (x,) = [r for r in a if r["step"] == step]
        (y,) = [r for r in b if r["step"] == step]
        assert x["position"] == y["position"] and x["trained_tokens"] == y["trained_tokens"]
        assert {k: sorted(v) for k, v in x["tasks"].items()} == {
            k: sorted(v) for k, v in y["tasks"].items()
        }, step
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4, abs=1e-7), step
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5), step


@pytest.mark.timeout(120)
def test_a_sharded_checkpoint_missing_one_ranks_shard_is_refused_on_every_process(
    tmp_path: Path,
) -> None:
    run = direct(2, {"lose_a_shard": True, "run_dir": str(tmp_path / "run")}, tmp_path / "out")
    _ok(run, 2)
    for out in run.ranks.values():
        assert out["latest"] == "step-00000001"  # the one before, whole
        assert "step-00000002/__1_0.distcp" in out["refused"], out["refused"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_killed_process_fails_the_pool_and_resume_continues_exactly(tmp_path: Path) -> None:
    steps = 5
    base = {"steps": steps, "checkpoint_every": 1, "global_tasks": 4}
    # The run that is never interrupted.
    whole = tmp_path / "whole"
    _ok(torchrun(2, {**base, "run_dir": str(whole)}, tmp_path / "a"), 2)

    # Rank 1 dies by SIGKILL inside step 4 (after the pool agreed on its call).
    cut = tmp_path / "cut"
    fail = {"rank": 1, "kind": "kill_in_step", "at_version": 3}
    killed = direct(
        2,
        {**base, "run_dir": str(cut), "fail": fail, "agree_timeout": 8.0, "pg_timeout": 15.0},
        tmp_path / "b",
    )
    assert killed.leftover == [] and killed.failed_at is not None, killed.output
    assert killed.returncodes == [3, -9], killed.output
    error = killed.ranks[0]["error"]
    assert "PoolError" in error and "rank 1 of 2" in error, error
    assert killed.ranks[0]["exit_time"] - killed.failed_at < 60.0
    names = sorted(p.name for p in (cut / "checkpoints").iterdir())
    assert names == ["step-00000002", "step-00000003"], names  # keep=2

    # The newest checkpoint loses one process's shard: it is not a checkpoint any more.
    (cut / "checkpoints" / "step-00000003" / "__1_0.distcp").unlink()
    resumed = torchrun(2, {**base, "run_dir": str(cut), "resume": True}, tmp_path / "c")
    _ok(resumed, 2)
    for out in resumed.ranks.values():
        assert out["resumed_from"].endswith("step-00000002"), out["resumed_from"]
    # From the checkpoint on, the records are the uninterrupted run's; none is missing
    # or repeated.
    for rank in range(2):
        a, b = _records(whole, rank), _records(cut, rank)
        assert [r["step"] for r in b] == list(range(1, steps + 1))
        _same_steps(a, b, range(1, steps + 1))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_on_fewer_processes_restores_model_and_optimizer_exactly(
    tmp_path: Path,
) -> None:
    base = {"steps": 2, "checkpoint_every": 1, "global_tasks": 4, "run_dir": str(tmp_path)}
    two = torchrun(2, base, tmp_path / "two")
    _ok(two, 2)
    # One process takes the job over from the two processes' sharded checkpoint: its
    # whole model and optimizer state are the ones the two left, bit for bit.
    one = torchrun(1, {**base, "resume": True}, tmp_path / "one")
    _ok(one, 1)
    out = one.ranks[0]
    assert out["resumed_from"].endswith("step-00000002")
    assert out["final_weights"] == two.ranks[0]["final_weights"]
    assert out["final_optimizer"] == two.ranks[0]["final_optimizer"]
    # ... and it trains on from there.
    more = torchrun(1, {**base, "steps": 3, "resume": True}, tmp_path / "more")
    _ok(more, 1)
    assert [r["step"] for r in _records(tmp_path, 0)] == [1, 2, 3]
