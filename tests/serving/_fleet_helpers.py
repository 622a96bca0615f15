"""Helpers of the fleet tests: servers started at once, waits, and a demo training run."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from dew.serving.fleet import EngineFleet, MemberInfo

from ._launch import Served, launch

OUTCOMES = ("trained", "cut", "abandoned", "dropped")
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # the env of the engine processes of a training run


def start_servers(stack: ExitStack, *argsets: Sequence[str]) -> list[Served]:
    """``dew serve ARGS`` for each argset, started concurrently; stopped by ``stack``."""
    with ThreadPoolExecutor(max_workers=len(argsets)) as pool:
        futures = [pool.submit(launch, *args) for args in argsets]
    served = []
    for f in futures:
        if f.exception() is None:
            stack.callback(f.result().stop)
            served.append(f.result())
    for f in futures:
        if f.exception() is not None:
            raise f.exception()  # type: ignore[misc]
    return served


def wait_for(
    fleet: EngineFleet, what: Callable[[list[MemberInfo]], bool], within: float, why: str
) -> list[MemberInfo]:
    """Poll ``fleet.members()`` until ``what`` holds; fail naming ``why`` after ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        members = fleet.members()
        if what(members):
            return members
        assert time.monotonic() < deadline, f"{why}: {members}"
        time.sleep(0.05)


def kill_while_it_holds_calls(
    fleet: EngineFleet, index: int, pid: int, over: threading.Event, within: float
) -> bool:
    """SIGKILL ``pid``, member ``index``'s process, while it holds calls it has not
    answered; False when ``over`` was set first (the run ended).

    A call in flight at the kill is not enough: its answer may sit in the socket
    already, and the fleet reads it after the process is gone. So the member is frozen
    (SIGSTOP), the fleet is given time to read what was sent, and the kill lands only
    if calls still wait on it (else SIGCONT, and the next calls are tried)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        while fleet.members()[index].in_flight == 0 and not over.wait(0.001):
            pass
        if over.is_set():
            return False
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.5)
        if fleet.members()[index].in_flight > 0:
            break
        os.kill(pid, signal.SIGCONT)
    os.kill(pid, signal.SIGKILL)
    return True


def by_url(fleet: EngineFleet, url: str) -> MemberInfo:
    return next(m for m in fleet.members() if m.url == url)


def train(
    fleet: EngineFleet,
    run_dir: Path,
    steps: int,
    *,
    log: Sequence[Callable[[Mapping[str, Any]], None]] = (),
    **overrides: Any,
) -> tuple[list[dict[str, Any]], Any]:
    """Train the demo's single-turn task on ``fleet`` (engine and publisher) for
    ``steps``; returns the run's records and the dataset (to check the task ids)."""
    from dew.demo.run import DemoConfig, build_job
    from dew.train import fit, read_records

    config = DemoConfig.for_task("single", steps=steps, **overrides)
    with ExitStack() as stack:
        # One torch thread here and in each engine process (ONE_THREAD): on a small
        # machine, processes each spinning on every core slow each other down badly.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        stack.callback(torch.set_num_threads, threads)
        job = build_job(config, stack, engine=fleet)
        model, optimizer, dataset = job.model, job.optimizer, job.dataset
        scheduler, objective = job.scheduler, job.objective
        result = fit(
            model,
            optimizer,
            dataset,
            scheduler,
            objective,
            steps=steps,
            run_dir=run_dir,
            checkpoint_every=steps,
            tensorboard=False,
            log=log,
        )
        assert result.updates == steps
    return read_records(run_dir), dataset


def rewards(records: Sequence[Mapping[str, Any]]) -> list[float]:
    return [
        float(r["scheduler"]["metrics"]["reward/mean"])
        for r in records
        if "reward/mean" in r["scheduler"]["metrics"]
    ]


def check_exactly_once(records: Sequence[Mapping[str, Any]], dataset: Any, steps: int) -> None:
    """Every task id the stream produced is accounted for once, at the step of its batch
    (as in tests/train/test_exactly_once.py)."""
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    produced = Counter(str(int(i)) for p in range(steps) for i in dataset.batch(p)["task_id"])
    accounted = Counter(t for r in records for what in OUTCOMES for t in r["tasks"][what])
    assert accounted == produced  # none lost, none twice
    for p, r in enumerate(records):
        ids = {str(int(i)) for i in dataset.batch(p)["task_id"]}
        assert {t for what in OUTCOMES for t in r["tasks"][what]} == ids
    assert sum(len(r["tasks"]["trained"]) for r in records) > 0
