"""EngineFleet over real ``dew serve`` processes on 127.0.0.1.

Routing (least outstanding work, affinity), the publish sequence (every member at the
version, a member that cannot take the weights taken out, none taking them raises), a
fleet of two training the demo task, and chaos: a member SIGKILLed mid-run (the run
finishes, every task is accounted for once, the lost calls come back as
``infra_error`` resubmissions, the supervisor's restart rejoins at the current
version), and a member SIGSTOPped (its calls fail as EngineError, it is taken out;
SIGCONT: it rejoins at the current version).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from concurrent.futures import wait
from contextlib import ExitStack
from pathlib import Path

import pytest

from dew.core import Call, Engine, EngineError, Publisher, SamplingParams
from dew.serving.fleet import EngineFleet
from dew.serving.http_engine import HTTPEngine

from ._fleet_helpers import (
    ONE_THREAD,
    by_url,
    check_exactly_once,
    kill_while_it_holds_calls,
    rewards,
    start_servers,
    train,
    wait_for,
)
from ._helpers import WAIT, chaos_seed, hf_greedy, lively
from ._proxy import Proxy

LONG = SamplingParams(max_tokens=900, stop_ids=())  # far longer than any test waits
SHORT = SamplingParams(max_tokens=4, stop_ids=())


def _served_by(future: object) -> str:
    """The URL of the member a fleet future went to (the fleet's bookkeeping)."""
    return future.call.member.engine.url  # type: ignore[attr-defined]


@pytest.mark.timeout(300)
def test_routing_and_the_publish_sequence(tmp_path: Path) -> None:
    with ExitStack() as stack:
        wd = ("--weights-dir", str(tmp_path))
        a, b, small = start_servers(
            stack, ("--demo", "tiny", *wd), ("--demo", "tiny", *wd), ("--demo", "small", *wd)
        )
        # Engines of different models are refused at construction, naming the field.
        odd = stack.enter_context(HTTPEngine(b.url))
        odd._max_len = 99
        with pytest.raises(ValueError, match=r"different models.*max_len"):
            EngineFleet([a.url, odd])
        assert odd.health()  # a caller's engine is left open when construction fails

        fleet = stack.enter_context(
            EngineFleet([a.url, b.url, small.url], health_interval=0.5, weights_dir=tmp_path)
        )
        assert isinstance(fleet, Engine) and isinstance(fleet, Publisher)
        assert fleet.version == 0 and [m.state for m in fleet.members()] == ["up"] * 3
        model = lively("qwen2", 4)
        assert fleet.max_len == model.config.max_position_embeddings
        assert fleet.eos_token_ids == (model.config.eos_token_id,)

        # Publish: the member of another size cannot take the weights and is taken out;
        # its calls in flight end as EngineError; every call after load is at v1.
        running = [fleet.submit([7, 8, i + 5], LONG) for i in range(6)]
        on_small = [f for f in running if _served_by(f) == small.url]
        assert len(on_small) == 2  # least outstanding work: 2 each
        fleet.load(model, 1)
        states = {m.url: (m.state, m.version) for m in fleet.members()}
        assert states == {a.url: ("up", 1), b.url: ("up", 1), small.url: ("out", -1)}
        assert "weights v1 not taken" in by_url(fleet, small.url).reason
        for f in on_small:
            with pytest.raises(EngineError, match="taken out"):
                f.result(timeout=WAIT)
        calls = [fleet.submit([7, 8, i], SHORT) for i in range(8)]
        assert all(f.result(timeout=WAIT).version == 1 for f in calls)
        assert {_served_by(f) for f in calls} == {a.url, b.url}
        for f in running:
            fleet.abort(f)
        wait(running, timeout=WAIT)
        with pytest.raises(ValueError, match="older"):
            fleet.load(model, 0)
        fleet.load(model.state_dict(), 2)
        fleet.load(model, 3)
        assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [
            "weights-v2.safetensors",
            "weights-v3.safetensors",
        ]  # only the newest two files stay
        assert fleet.version == 3
        assert fleet.generate([7, 8], SHORT).version == 3
        # The health thread keeps trying the small one (backing off): it never rejoins.
        time.sleep(1.5)
        small_now = by_url(fleet, small.url)
        assert small_now.state == "out" and "cannot be brought to version" in small_now.reason

        # Routing: groups spread by outstanding work, a group stays on one member.
        before = {m.url: m.dispatched for m in fleet.members()}
        groups = {
            g: [fleet.submit([9, ord(g) % 20, i], LONG, affinity=g) for i in range(4)]
            for g in "wxyz"
        }
        homes = {g: {_served_by(f) for f in fs} for g, fs in groups.items()}
        assert all(len(h) == 1 for h in homes.values()), homes
        assert sorted(next(iter(h)) for h in homes.values()) == sorted([a.url, b.url] * 2)
        after = {m.url: m.dispatched for m in fleet.members()}
        assert after[small.url] == before[small.url]
        assert fleet.in_flight == 16
        # Affinity beats load: "w" goes home although its member has more work.
        home = next(iter(homes["w"]))
        extra = [fleet.submit([5, i], LONG, affinity="w") for i in range(3)]
        again = fleet.submit([9, 1, 1], LONG, affinity="w")
        assert {_served_by(f) for f in [*extra, again]} == {home}
        assert by_url(fleet, home).in_flight == 12
        for f in [*extra, again, *(f for fs in groups.values() for f in fs)]:
            fleet.abort(f)
        done, _ = wait([*extra, again, *(f for fs in groups.values() for f in fs)], timeout=WAIT)
        assert len(done) == 20 and fleet.in_flight == 0

        # A fleet in which no member takes the weights raises; its version stays.
        with EngineFleet([small.url]) as alone:
            with pytest.raises(EngineError, match="no engine of the fleet took weights v1"):
                alone.load(model, 1)
            assert alone.version == 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_fleet_of_two_trains_the_demo_task(tmp_path: Path) -> None:
    steps = 40
    with EngineFleet.launch(2, demo="tiny", env=ONE_THREAD) as fleet:
        records, dataset = train(fleet, tmp_path, steps, lr=3e-3)
        members = fleet.members()
        assert [(m.state, m.version) for m in members] == [("up", steps - 1)] * 2
        assert all(m.dispatched > 0 and m.restarts == 0 for m in members)
    check_exactly_once(records, dataset, steps)
    got = rewards(records)
    first, last = sum(got[:10]) / 10, sum(got[-10:]) / 10
    assert last > 2 * first and last > first + 0.02, (first, last)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_chaos_a_member_killed_mid_run(tmp_path: Path) -> None:
    steps = 16
    seed = chaos_seed()
    rng = random.Random(seed)
    kill_at = rng.randint(2, steps - 6)  # after this many steps, plus a random delay
    delay = rng.uniform(0.0, 0.3)
    note = f"seed {seed}: SIGKILL after step {kill_at} + {delay:.2f}s"
    seen: list[int] = []
    killed: list[int] = []
    over = threading.Event()  # the run ended: the killer gives up
    with EngineFleet.launch(2, demo="tiny", env=ONE_THREAD, health_interval=0.5) as fleet:
        index = rng.randrange(2)
        victim = fleet.members()[index]

        def kill() -> None:
            while len(seen) < kill_at and not over.wait(0.01):
                pass
            if not over.wait(delay) and kill_while_it_holds_calls(
                fleet, index, victim.pid, over, 300
            ):
                killed.append(len(seen))

        killer = threading.Thread(target=kill)
        killer.start()
        try:
            records, dataset = train(fleet, tmp_path, steps, log=[lambda r: seen.append(1)])
        finally:
            over.set()
            killer.join()
        assert killed, f"the engine was never killed ({note})"
        check_exactly_once(records, dataset, steps)
        infra = sum(r["scheduler"]["resubmitted"].get("infra_error", 0) for r in records)
        assert infra > 0, (note, [r["scheduler"]["resubmitted"] for r in records])
        # The supervisor restarted it; it rejoins at the fleet's current version.
        members = wait_for(
            fleet,
            lambda ms: all(m.state == "up" and m.version == fleet.version for m in ms),
            WAIT,
            "the killed engine did not rejoin at the current version",
        )
        assert fleet.version == steps - 1
        back = members[index]
        assert back.restarts == 1 and back.pid != victim.pid
        futures = [fleet.submit([7, 8, i], SHORT) for i in range(8)]
        assert {f.result(timeout=WAIT).version for f in futures} == {fleet.version}
        assert back.url in {_served_by(f) for f in futures}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chaos_a_stopped_member_is_taken_out_and_rejoins(tmp_path: Path) -> None:
    with ExitStack() as stack:
        a, b = start_servers(stack, ("--demo", "tiny"), ("--demo", "tiny"))
        fleet = stack.enter_context(
            EngineFleet([a.url, b.url], health_interval=0.5, max_failures=2, connect_timeout=1.0)
        )
        model = lively("qwen2", 4)
        fleet.load(model, 1)
        futures = [fleet.submit([7, 8, i + 5], LONG) for i in range(6)]
        on_b = [f for f in futures if _served_by(f) == b.url]
        assert len(on_b) == 3
        try:
            time.sleep(0.3)
            os.kill(b.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            for f in on_b:
                with pytest.raises(EngineError, match="taken out"):
                    f.result(timeout=WAIT)
            took = time.monotonic() - t0
            assert took < 8.0, took  # 2 failed checks 0.5 s apart, 1 s each at most
            assert by_url(fleet, b.url).state == "out"
            # a keeps serving: none of its calls was failed with b's (on a loaded machine
            # some may already have finished, with their completion).
            on_a = [f for f in futures if f not in on_b]
            assert all(not f.done() or isinstance(f.result(), Call) for f in on_a)
            # Publishing while b is stopped: a takes v2; calls go to a, at v2.
            fleet.load(model, 2)
            calls = [fleet.submit([7, i], SHORT) for i in range(4)]
            assert all(c.result(timeout=WAIT).version == 2 for c in calls)
            assert {_served_by(c) for c in calls} == {a.url}
            os.kill(b.pid, signal.SIGCONT)
            wait_for(
                fleet,
                lambda ms: all(m.state == "up" and m.version == 2 for m in ms),
                WAIT,
                "the continued engine did not rejoin at version 2",
            )
            again = [fleet.submit([7, 8, i], SHORT, affinity=i) for i in range(8)]
            results: list[Call] = [f.result(timeout=WAIT) for f in again]
            assert {c.version for c in results} == {2}
            assert b.url in {_served_by(f) for f in again}
        finally:
            os.kill(b.pid, signal.SIGCONT)
            os.kill(b.pid, signal.SIGKILL)
        for f in futures:
            fleet.abort(f)
        wait(futures, timeout=WAIT)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chaos_a_push_while_every_member_is_dead_waits_for_their_restart() -> None:
    with EngineFleet.launch(2, demo="tiny", env=ONE_THREAD, health_interval=0.2) as fleet:
        first, second = lively("qwen2", 4), lively("qwen2", 5)
        fleet.load(first, 1)
        for m in fleet.members():
            os.kill(m.pid, signal.SIGKILL)
        # At once, as a trainer's next push would: no member takes it, both are restarted
        # (and brought to v1 first), and the push waits for them, then lands.
        fleet.load(second, 2)
        assert fleet.version == 2
        members = wait_for(
            fleet, lambda ms: all(m.state == "up" for m in ms), WAIT, "not both back"
        )
        assert all(m.restarts == 1 and m.version == 2 for m in members), members
        prompt = [7, 8, 9]
        call = fleet.generate(prompt, SamplingParams(max_tokens=6, temperature=0, stop_ids=()))
        assert call.version == 2
        assert list(call.completion) == hf_greedy(second, prompt, 6)


@pytest.mark.timeout(180)
def test_a_restarted_member_serves_nothing_before_it_has_the_fleets_weights() -> None:
    with EngineFleet.launch(2, demo="tiny", env=ONE_THREAD, health_interval=0.2) as fleet:
        pushed = lively("qwen2", 8)
        fleet.load(pushed, 1)
        prompt = [7, 8, 9]
        greedy = SamplingParams(max_tokens=5, temperature=0, stop_ids=())
        want = hf_greedy(pushed, prompt, 5)
        victim = fleet.members()[1]
        os.kill(victim.pid, signal.SIGKILL)
        # Until it is back at v1, the restarted process (serving its initial weights) is
        # never in rotation, and every call answers with the pushed weights.
        deadline = time.monotonic() + WAIT
        while True:
            members = fleet.members()
            for m in members:
                assert m.state != "up" or m.version == 1, members
            try:
                call = fleet.generate(prompt, greedy)
            except EngineError:  # sent to the victim before it was seen dead: resubmitted
                pass  # by a scheduler; here, the next round asks again
            else:
                assert call.version == 1 and list(call.completion) == want
            back = members[1]
            if back.restarts == 1 and back.state == "up":
                break
            assert time.monotonic() < deadline, members
        futures = [fleet.submit(prompt, greedy, affinity=i) for i in range(8)]
        assert {_served_by(f) for f in futures} == {m.url for m in fleet.members()}
        assert all(list(f.result(timeout=WAIT).completion) == want for f in futures)


@pytest.mark.timeout(180)
def test_a_failed_call_keeps_new_calls_off_its_member_and_its_group_off_for_good(
    tmp_path: Path,
) -> None:
    """The picking rule alone, with the failed member's /health still answering (so no
    take-out hides it): while its health check decides, no new call goes there; once
    trusted again it takes new work, but never the group whose call it failed."""
    with ExitStack() as stack:
        wd = ("--weights-dir", str(tmp_path))
        a, b = start_servers(stack, ("--demo", "tiny", *wd), ("--demo", "tiny", *wd))
        proxy = Proxy(("127.0.0.1", int(a.url.rsplit(":", 1)[1])))
        stack.callback(proxy.close)
        fleet = stack.enter_context(EngineFleet([proxy.url, b.url], health_interval=60))
        first = fleet.submit([7, 8, 9], SHORT, affinity="g")
        assert _served_by(first) == proxy.url  # both idle: the first member
        assert first.result(timeout=WAIT).version == 0
        proxy.health_open.clear()  # the health check the failure starts waits here
        proxy.cut_next_generate.set()
        failed = fleet.submit([7, 8, 9], SHORT, affinity="g")
        with pytest.raises(EngineError):
            failed.result(timeout=WAIT)
        members = fleet.members()
        assert [(m.state, m.suspect) for m in members] == [("up", True), ("up", False)]
        # Suspect: every new call goes to b, though a has less work. (Group "g" is
        # left out here: sent to b now, b would become its home and hide the rule.)
        others = [fleet.submit([7, i], SHORT, affinity=f"h{i}") for i in range(3)]
        loose = fleet.submit([7, 8], SHORT)
        assert {_served_by(f) for f in [*others, loose]} == {b.url}
        wait([*others, loose], timeout=WAIT)
        proxy.health_open.set()
        wait_for(fleet, lambda ms: not ms[0].suspect, WAIT, "a trusted again")
        assert fleet.members()[0].state == "up" and proxy.healths >= 1
        # Trusted again: new groups go to a (the least dispatched); "g", whose home a
        # still is, never does.
        fresh = fleet.submit([7, 8, 9], SHORT, affinity="k")
        assert _served_by(fresh) == proxy.url
        regroup = [fleet.submit([7, 8, i], SHORT, affinity="g") for i in range(3)]
        assert {_served_by(f) for f in regroup} == {b.url}
        assert all(f.result(timeout=WAIT).version == 0 for f in [fresh, *regroup])


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_chaos_twenty_engine_kills_abandon_no_group(tmp_path: Path) -> None:
    """One crash costs a sample one attempt at most: its resubmission never goes back to
    the engine that failed it, and no new call goes to an engine a request just failed
    on. Over 20 SIGKILLs of a fleet member under load, no group is abandoned."""
    kills, steps = 20, 2000
    seed = chaos_seed()
    rng = random.Random(seed)
    killed: list[int] = []
    seen: list[int] = []
    over = threading.Event()
    with EngineFleet.launch(2, demo="tiny", env=ONE_THREAD, health_interval=0.2) as fleet:
        dead: set[int] = set()

        def kill() -> None:
            while len(killed) < kills and not over.is_set():
                index = rng.randrange(2)
                # Both in rotation (the one killed last restarted), then a random moment.
                while not over.wait(0.05):
                    members = fleet.members()
                    if all(m.state == "up" and m.pid not in dead for m in members):
                        break
                if over.wait(rng.uniform(0.2, 1.0)):
                    return
                victim = fleet.members()[index]
                try:
                    if kill_while_it_holds_calls(fleet, index, victim.pid, over, 60):
                        killed.append(len(seen))
                        dead.add(victim.pid)
                except ProcessLookupError:  # it died meanwhile (not by us): try again
                    dead.add(victim.pid)

        killer = threading.Thread(target=kill)
        killer.start()
        try:
            records, dataset = train(fleet, tmp_path, steps, log=[lambda r: seen.append(1)])
        finally:
            over.set()
            killer.join()
    note = f"seed {seed}: {len(killed)} kills at steps {killed}"
    assert len(killed) == kills, note
    check_exactly_once(records, dataset, steps)
    abandoned = [t for r in records for t in r["tasks"]["abandoned"]]
    assert abandoned == [], (note, abandoned)
    infra = sum(r["scheduler"]["resubmitted"].get("infra_error", 0) for r in records)
    assert infra > 0, note


def test_a_ray_fleet_at_an_address_where_nothing_listens_is_one_line_and_leaves_nothing() -> None:
    import socket

    from dew.serving._folders import weights_root

    with socket.socket() as s:  # a port of this machine that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = set(weights_root().iterdir())
    address = f"127.0.0.1:{port}"
    with pytest.raises(EngineError, match=rf"Ray cluster at {address}: nothing answers there"):
        EngineFleet.on_ray(1, demo="tiny", address=address)
    assert set(weights_root().iterdir()) <= before  # no weights folder left behind
