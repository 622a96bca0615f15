"""HarnessSource(processes=N): a callable harness in long-lived processes of its own,
through a live gateway and RolloutServer."""

from __future__ import annotations

import os
import signal
import sys
import types

import pytest

from dew.core import RolloutKey, Status, Task
from dew.gateway import HarnessOutcome, HarnessSource

from . import _harnesses as h
from ._live import TASK, TOK, WAIT, length_verifier


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(180)
def test_runs_go_to_the_processes_and_come_back_recorded(gateway, spy):
    seen: list[HarnessOutcome] = []

    def verifier(task: Task, outcome: HarnessOutcome) -> float:
        seen.append(outcome)
        return float(len(outcome.calls))

    with HarnessSource(gateway, h.pid_and_reply, verifier, workers=4, processes=2) as src:
        pids = src._procs.pids()  # type: ignore[union-attr]
        sessions = [src.start(TASK, RolloutKey(0, i, 0)) for i in range(8)]
        rollouts = [s.result(WAIT) for s in sessions]
    assert len(pids) == 2 and os.getpid() not in pids
    assert all(r.status is Status.COMPLETED and r.reward == 2.0 for r in rollouts)
    assert sorted(c.completion for r in rollouts for c in r.calls) == sorted(
        c.completion for c in spy.calls
    )
    ran_in = {o.value[0] for o in seen}
    assert ran_in <= set(pids) and len(ran_in) == 2  # both processes took runs
    for o in seen:  # what the harness read is what the gateway recorded
        last = o.calls[-1].completion
        assert o.value[1] == TOK.decode([int(t) for t in last if t != TOK.eos_token_id])
    assert not any(_alive(p) for p in pids)  # close() stopped and joined them


@pytest.mark.timeout(180)
def test_failures_in_a_process_map_to_statuses(gateway):
    with HarnessSource(gateway, h.raises_after_a_call, length_verifier, processes=1) as src:
        r = src.start(TASK, RolloutKey(0, 0, 0)).result(WAIT)
    assert r.status is Status.AGENT_ERROR and r.reward == 1.0
    assert "misformatted" in r.error and "Traceback" in r.error
    with HarnessSource(gateway, h.quits, length_verifier, processes=1) as src:
        r = src.start(TASK, RolloutKey(0, 1, 0)).result(WAIT)
    assert r.status is Status.AGENT_ERROR and "status 2" in r.error
    with HarnessSource(
        gateway, h.returns_what_cannot_be_pickled, length_verifier, processes=1
    ) as src:
        r = src.start(TASK, RolloutKey(0, 2, 0)).result(WAIT)
    assert r.status is Status.AGENT_ERROR and "cannot be sent back" in r.error


@pytest.mark.timeout(180)
def test_a_stop_reaches_the_harness_in_its_process(gateway, spy):
    values: list[object] = []

    def verifier(task: Task, outcome: HarnessOutcome) -> float:
        values.append(outcome.value)
        return 1.0

    # The timeout: the run is TRUNCATED and scored with what the harness returned after
    # its endpoint.stop was set over there.
    with HarnessSource(gateway, h.waits_for_stop, verifier, timeout=2.0, processes=1) as src:
        r = src.start(TASK, RolloutKey(0, 0, 0)).result(WAIT)
        assert r.status is Status.TRUNCATED and r.truncation == "wall_clock"
        assert values == ["stopped"]
        # A cancel: CANCELLED, and the process is free for the next run.
        session = src.start(TASK, RolloutKey(0, 1, 0))
        assert spy.wait_entered(2)
        session.cancel()
        assert session.result(WAIT).status is Status.CANCELLED


@pytest.mark.timeout(180)
def test_a_process_that_dies_is_an_infra_error_and_is_started_again(gateway, spy):
    with HarnessSource(gateway, h.waits_for_stop, length_verifier, processes=1) as src:
        (pid,) = src._procs.pids()  # type: ignore[union-attr]
        session = src.start(TASK, RolloutKey(0, 0, 0))
        assert spy.wait_entered(1)
        os.kill(pid, signal.SIGKILL)
        r = session.result(WAIT)
        assert r.status is Status.INFRA_ERROR and f"harness process {pid} exited" in r.error
        assert "-9" in r.error and r.reward is None
        again = src.start(TASK, RolloutKey(0, 1, 0))  # a new process takes it
        assert spy.wait_entered(2)
        (new_pid,) = src._procs.pids()  # type: ignore[union-attr]
        assert new_pid != pid
        again.cancel()
        assert again.result(WAIT).status is Status.CANCELLED
    assert not _alive(new_pid)


def test_processes_is_validated(gateway):
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="processes must be an int"):
            HarnessSource(gateway, h.quits, length_verifier, processes=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="only a callable harness"):
        HarnessSource(gateway, ["true"], length_verifier, processes=1)
    with pytest.raises(ValueError, match="harness: with processes=1 it must be picklable"):
        HarnessSource(gateway, lambda t, ep: None, length_verifier, processes=1)


@pytest.mark.timeout(120)
def test_a_harness_the_processes_cannot_import_fails_at_construction(gateway, monkeypatch):
    # A module that exists in this process only: the harness pickles by reference here,
    # and the process that unpickles it cannot import it, so it dies while starting.
    module = types.ModuleType("dew_test_only_here")
    exec("def harness(task, ep):\n    return None\n", module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with pytest.raises(RuntimeError, match=r"exited \(code 1\) while starting"):
        HarnessSource(gateway, module.harness, length_verifier, processes=1)
