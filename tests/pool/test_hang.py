"""A hung process is named by every other within the heartbeat's bound; a slow one is not.

Real processes over gloo (tests/pool/pool_worker.py): one rank SIGSTOPs itself while
the others wait for it in an agreement round (``stop``: it stopped during its
rollouts) or inside the step's collectives (``stop_in_step``); or it is only slow,
there or in a rollout, for several times the heartbeat's bound. The multi-node-style
test starts two separate ``torchrun --nnodes 2`` launches, where no agent watches the
other launch's process.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.pool._launch import WORKER, Run, _alive, _collect, _config, _env, _spawn, direct

HANG = 4.0  # the heartbeat bound these tests run with, seconds
# How late a survivor may be after the bound: the bound itself, a tenth for the
# heartbeat's tick, a second for the round's poll, then leaving the pool; generous for
# a loaded 2-core machine.
SLACK = 25.0


def stopped(kind: str) -> dict[str, Any]:
    """Rank 1 SIGSTOPs itself (``kind``: ``stop`` or ``stop_in_step``) at call 2; every
    other bound far beyond the heartbeat's, so only the heartbeat can name it in time."""
    return {
        "steps": 4,
        "agree_timeout": 300.0,
        "pg_timeout": 300.0,
        "hang_timeout": HANG,
        "fail": {"rank": 1, "kind": kind, "at_version": 2},
    }


def slowed(kind: str, seconds: float) -> dict[str, Any]:
    """Rank 1 is slow but alive for ``seconds`` (``kind``: ``slow`` or ``slow_in_step``)
    from call 1; the other bounds leave room for it."""
    return {
        "steps": 3,
        "agree_timeout": 120.0,
        "pg_timeout": 120.0,
        "hang_timeout": HANG,
        "fail": {"rank": 1, "kind": kind, "at_version": 1, "seconds": seconds},
    }


def _named_hung(run: Run, survivors: list[int], hung: int, world: int) -> None:
    assert run.failed_at is not None, run.output
    for r in survivors:
        out = run.ranks.get(r)
        assert out is not None, f"rank {r} wrote no report:\n{run.output}"
        assert "error" in out, f"rank {r} did not fail: {out}"
        assert f"rank {hung} of {world} has not beaten for" in out["error"], (r, out["error"])
        bystanders = [f"rank {o} of {world}" for o in range(world) if o != hung]
        assert not any(b in out["error"] for b in bystanders), (r, out["error"])
        # Named after the bound (less one heartbeat tick: the last beat came before the
        # stop), not before it; and long before any other timeout.
        assert HANG - 1 <= out["exit_time"] - run.failed_at < HANG + SLACK, (r, out["error"])


@pytest.mark.timeout(150)
def test_a_process_stopped_inside_the_step_is_named_hung_by_the_others(tmp_path: Path) -> None:
    # The survivor is blocked in FSDP2's collectives with the stopped rank: only
    # shutting down its connections to it frees it before the 300 s group timeout.
    config = stopped("stop_in_step")
    run = direct(2, config, tmp_path, wait=[0], timeout=120)
    assert run.returncodes[0] == 3, run.output
    _named_hung(run, [0], 1, 2)
    error = run.ranks[0]["error"]
    assert "shut down its connections to hung rank(s) [1]" in error, error
    assert "post-mortem" in error, error
    assert 1 not in run.ranks  # stopped, then killed by the launcher: it wrote nothing


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_process_stopped_in_its_rollouts_is_named_by_every_other_rank(tmp_path: Path) -> None:
    # Three processes, the stop at any moment of a rank's rollouts: the survivors wait
    # for it in the agreement round, or (when its rollouts run ahead of the call it
    # agreed on) in the step's collectives; both name it, and only it.
    config = stopped("stop")
    run = direct(3, config, tmp_path, wait=[0, 2], timeout=160)
    assert run.returncodes[0] == 3 and run.returncodes[2] == 3, run.output
    _named_hung(run, [0, 2], 1, 3)


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", ["slow", "slow_in_step"])
def test_a_slow_but_live_process_is_waited_for(tmp_path: Path, kind: str) -> None:
    # Slow for three times the heartbeat's bound, in a rollout (the others wait in the
    # agreement round) or in the step (they wait inside the collectives): the run
    # finishes as if nothing happened.
    seconds = 3 * HANG
    config = slowed(kind, seconds)
    run = direct(2, config, tmp_path, timeout=160)
    assert run.leftover == [], run.output
    assert run.returncodes == [0, 0], run.output
    for r in (0, 1):
        assert "error" not in run.ranks[r], run.ranks[r].get("traceback")
        assert len(run.ranks[r]["losses"]) == 3
    assert run.failed_at is not None
    assert run.ranks[0]["exit_time"] - run.failed_at >= seconds  # it really was waited for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _two_launches(config: dict[str, Any], out: Path, *, reports: list[int], timeout: float) -> Run:
    """Two ``torchrun --nnodes 2 --nproc-per-node 1`` launches meeting at one c10d
    rendezvous; waits until the ranks in ``reports`` have written their reports (or
    both launches ended), then kills whatever is left."""
    path = _config(out, config)
    port = _free_port()
    procs = []
    try:
        for node in range(2):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2"]
            cmd += ["--nproc-per-node=1", "--rdzv-backend=c10d", "--rdzv-id=dew-hang-test"]
            cmd += [f"--rdzv-endpoint=127.0.0.1:{port}", "--max-restarts=0"]
            cmd += [str(WORKER), str(path)]
            procs.append(_spawn(cmd, out, f"log-node{node}.txt", _env({})))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all((out / f"rank{r}.json").exists() for r in reports):
                break
            if all(p.poll() is not None for p in procs):
                break
            time.sleep(0.2)
        # The launches of finished workers end on their own; give them a moment.
        return _collect(procs, out, 2, timeout=max(min(deadline - time.monotonic(), 20.0), 0.0))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_two_launches_a_stopped_process_is_named_hung(tmp_path: Path) -> None:
    # No torchrun agent watches the other launch's process: the heartbeat alone
    # frees the survivor, which is blocked in the step's collectives.
    config = stopped("stop_in_step")
    run = _two_launches(config, tmp_path, reports=[0], timeout=150)
    _named_hung(run, [0], 1, 2)
    pid = int((tmp_path / "pid1").read_text())
    deadline = time.monotonic() + 30.0  # SIGKILLed by the cleanup; gone once it is reaped
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the stopped process was left behind"


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_two_launches_a_slow_but_live_step_is_waited_for(tmp_path: Path) -> None:
    seconds = 3 * HANG
    config = slowed("slow_in_step", seconds)
    run = _two_launches(config, tmp_path, reports=[0, 1], timeout=150)
    assert sorted(run.ranks) == [0, 1], run.output
    for r in (0, 1):
        assert "error" not in run.ranks[r], run.ranks[r].get("traceback")
        assert len(run.ranks[r]["losses"]) == 3
    assert run.failed_at is not None
    assert run.ranks[0]["exit_time"] - run.failed_at >= seconds
    assert run.returncodes == [0, 0], run.output
