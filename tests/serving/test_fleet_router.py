"""EngineFleet behind a real sglang-router, over real ``dew serve`` workers on 127.0.0.1.

The router relays ``/generate``; the fleet pushes weights, sends aborts and checks
health at each worker directly, and keeps the router's worker list in step: a worker
that cannot take the weights leaves the list (so nothing is served at the old version
through the router), a worker that catches up joins it again. The slow test trains the
demo task through the router while a worker is SIGKILLed mid-run.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

import pytest

from dew.core import Aborted, SamplingParams
from dew.serving.fleet import EngineFleet
from dew.serving.fleet._router import RouterAdmin, RouterProcess
from dew.serving.http_engine import HTTPEngine

from ._fleet_helpers import (
    ONE_THREAD,
    by_url,
    check_exactly_once,
    rewards,
    start_servers,
    train,
    wait_for,
)
from ._helpers import WAIT, chaos_seed, lively

LONG = SamplingParams(max_tokens=900, stop_ids=())
SHORT = SamplingParams(max_tokens=4, stop_ids=())


def _router(stack: ExitStack, urls: list[str], policy: str = "round_robin") -> str:
    process = RouterProcess(urls, policy=policy)
    stack.callback(process.stop, 10.0)
    return process.start(120.0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_fleet_behind_sglang_router(tmp_path: Path) -> None:
    with ExitStack() as stack:
        a, b, small = start_servers(
            stack, ("--demo", "tiny"), ("--demo", "tiny"), ("--demo", "small")
        )
        model = lively("qwen2", 4)
        with HTTPEngine(a.url) as direct:
            direct.load(model, 1)  # a is ahead: b and small start out of rotation
        router = _router(stack, [a.url, b.url, small.url])
        admin = stack.enter_context(closing(RouterAdmin(router, api_key=None, timeout=30)))
        fleet = stack.enter_context(
            EngineFleet([a.url, b.url, small.url], router=router, health_interval=0.3)
        )
        # Behind at the start: out of rotation, and off the router's list.
        assert fleet.version == 1
        assert {m.url: m.state for m in fleet.members()} == {
            a.url: "up",
            b.url: "out",
            small.url: "out",
        }
        assert set(admin.workers()) == {a.url}
        calls = [fleet.submit([7, 8, i], SHORT) for i in range(6)]
        assert {f.result(timeout=WAIT).version for f in calls} == {1}

        # Publish v2: b and small catch up from the fleet's file; small (another model
        # size) cannot take it and stays off the list, so the router never sends a call
        # there to be served at its old version.
        fleet.load(model, 2)
        wait_for(
            fleet,
            lambda ms: by_url(fleet, b.url).state == "up",
            WAIT,
            "b did not rejoin at version 2",
        )
        assert set(admin.workers()) == {a.url, b.url}
        assert by_url(fleet, small.url).state == "out"
        calls = [fleet.submit([7, 8, i], SHORT) for i in range(12)]
        assert {f.result(timeout=WAIT).version for f in calls} == {2}

        # Aborts reach the worker through the fleet (the router does not relay them):
        # by a stop event and by fleet.abort, each with the tokens made so far.
        stop = threading.Event()
        stopped = fleet.submit([5, 6, 7], LONG, stop=stop)
        aborted = fleet.submit([5, 6, 8], LONG)
        time.sleep(0.3)
        stop.set()
        fleet.abort(aborted)
        for f in (stopped, aborted):
            with pytest.raises(Aborted) as info:
                f.result(timeout=WAIT)
            assert 0 < info.value.tokens < LONG.max_tokens
        assert fleet.in_flight == 0

        # A worker taken out (here: SIGSTOPped, it stops answering during the push of
        # v3) leaves the router's list before load returns; after SIGCONT it catches up
        # and joins the list again.
        os.kill(b.pid, signal.SIGSTOP)
        try:
            fleet.load(model, 3)
            assert by_url(fleet, b.url).state == "out"
            assert set(admin.workers()) == {a.url}
            calls = [fleet.submit([7, 8, i], SHORT) for i in range(6)]
            assert {f.result(timeout=WAIT).version for f in calls} == {3}
        finally:
            os.kill(b.pid, signal.SIGCONT)
        wait_for(
            fleet,
            lambda ms: by_url(fleet, b.url).state == "up",
            WAIT,
            "b did not rejoin after SIGCONT",
        )
        assert set(admin.workers()) == {a.url, b.url}


class _GatedAdmin:
    """The fleet's real RouterAdmin, except that ``remove`` waits for the test's gate."""

    def __init__(self, inner: RouterAdmin) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.gate = threading.Event()

    def remove(self, url: str) -> None:
        self.entered.set()
        self.gate.wait(WAIT)
        self.inner.remove(url)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_load_returns_only_once_a_member_taken_out_during_the_push_left_the_list() -> None:
    # The health thread may take a stopped member out while a push waits on it; load
    # saw it leave, so it must not return before the router dropped it (here the
    # router's answer is held back by the test until load was seen waiting).
    with ExitStack() as stack:
        a, b = start_servers(stack, ("--demo", "tiny"), ("--demo", "tiny"))
        router = _router(stack, [a.url, b.url])
        admin = stack.enter_context(closing(RouterAdmin(router, api_key=None, timeout=30)))
        fleet = stack.enter_context(EngineFleet([a.url, b.url], router=router, health_interval=1.0))
        gated = _GatedAdmin(fleet._admin)  # type: ignore[arg-type]
        fleet._admin = gated  # type: ignore[assignment]
        pool = stack.enter_context(ThreadPoolExecutor(max_workers=1))
        stack.callback(gated.gate.set)  # first out of the stack: nothing waits on it
        os.kill(b.pid, signal.SIGSTOP)
        try:
            loaded = pool.submit(fleet.load, lively("qwen2", 4), 2)
            assert gated.entered.wait(WAIT), "b was never taken off the router's list"
            with pytest.raises(FutureTimeout):
                loaded.result(timeout=1.0)  # b is still on the list
            gated.gate.set()
            loaded.result(timeout=WAIT)
            assert by_url(fleet, b.url).state == "out"
            assert set(admin.workers()) == {a.url}
        finally:
            gated.gate.set()
            os.kill(b.pid, signal.SIGCONT)


def test_router_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="router policy must be one of"):
        RouterProcess(["http://127.0.0.1:1"], policy="fastest")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_fleet_behind_sglang_router_trains_through_a_killed_worker(tmp_path: Path) -> None:
    steps = 24
    seed = chaos_seed()
    rng = random.Random(seed)
    kill_at = rng.randint(3, 10)
    note = f"seed {seed}: SIGKILL after step {kill_at}"
    seen: list[int] = []
    killed: list[int] = []
    with EngineFleet.launch(
        2, demo="tiny", env=ONE_THREAD, router="cache_aware", health_interval=0.5
    ) as fleet:
        index = rng.randrange(2)
        victim = fleet.members()[index]

        def kill() -> None:
            deadline = time.monotonic() + 300
            while len(seen) < kill_at and time.monotonic() < deadline:
                time.sleep(0.01)
            while fleet.in_flight == 0 and time.monotonic() < deadline:
                time.sleep(0.001)
            assert victim.pid is not None
            os.kill(victim.pid, signal.SIGKILL)
            killed.append(len(seen))

        killer = threading.Thread(target=kill)
        killer.start()
        try:
            records, dataset = train(
                fleet, tmp_path, steps, lr=3e-3, log=[lambda r: seen.append(1)]
            )
        finally:
            killer.join()
        assert killed, f"the worker was never killed ({note})"
        check_exactly_once(records, dataset, steps)
        got = rewards(records)
        first, last = sum(got[:8]) / 8, sum(got[-8:]) / 8
        assert last > first, (note, first, last)
        # Restarted on its own port, brought to the fleet's version, back on the list.
        members = wait_for(
            fleet,
            lambda ms: all(m.state == "up" and m.version == fleet.version for m in ms),
            WAIT,
            f"the killed worker did not rejoin ({note})",
        )
        back = members[index]
        assert back.restarts == 1 and back.url == victim.url and back.pid != victim.pid
        admin = RouterAdmin(fleet._router_process.url, api_key=None, timeout=30)  # type: ignore[union-attr]
        try:
            listed = admin.workers()
        finally:
            admin.close()
        assert set(listed) == {m.url for m in members}
        assert all(w["is_healthy"] for w in listed.values())
