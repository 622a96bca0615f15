"""A running ``dew serve`` serves one trainer run after another: a new run counts its
versions from its own start, a live holder is never pushed over without a takeover,
and a run taken over finds out at its next push. The rule itself is tested as the
plain state machine it is (:mod:`dew.serving._claim`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dew.core import EngineError, SamplingParams
from dew.serving._claim import Claim, ClaimRefused
from dew.serving.fleet import EngineFleet
from dew.serving.http_engine import HTTPEngine
from dew.serving.weights import write_weights

from ._helpers import WAIT, lively
from ._launch import Served, serve

LONG = SamplingParams(max_tokens=1000, temperature=1.0, stop_ids=())


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return lively("qwen2", 4)


@pytest.fixture
def server() -> Iterator[Served]:
    with serve("--demo", "tiny", "--max-batch", "8") as served:
        yield served


def held_by(server: Served) -> object:
    with server.client() as client:
        return client.get("/health").json()["dew_run"]


@pytest.mark.timeout(120)
def test_a_second_run_counts_from_0_once_the_first_released_the_server(
    server: Served, model: torch.nn.Module
) -> None:
    first = HTTPEngine(server.url, run="first")
    try:
        first.load(model, 3)
        first.load(model, 5)
        assert held_by(server) == "first"
        with HTTPEngine(server.url, run="second") as second:
            assert second.held_by == "first" and second.version == 5
            with pytest.raises(ValueError, match=r"409.*held by run 'first'.*takeover"):
                second.load(model, 0)
            assert second.version == 5 and held_by(server) == "first"  # nothing changed
            first.close()  # releases the server
            assert held_by(server) is None
            second.load(model, 0)  # its own sequence: 0 after another run's 5
            assert second.version == 0 and held_by(server) == "second"
            assert second.generate([5, 6], SamplingParams(max_tokens=3)).version == 0
            second.load(model, 1)
            with pytest.raises(ValueError, match="not newer"):  # within a run: newer only
                second.load(model, 0)
        assert held_by(server) is None
    finally:
        first.close()


@pytest.mark.timeout(120)
def test_a_takeover_aborts_the_holders_calls_and_refuses_its_next_push(
    server: Served, model: torch.nn.Module
) -> None:
    with HTTPEngine(server.url, run="old") as old:
        old.load(model, 7)
        running = old.submit([5, 6, 7], LONG)
        with server.client() as client:  # until the server is generating it
            while client.get("/health").json()["dew_in_flight"] == 0:
                assert not running.done()
        with HTTPEngine(server.url, run="new", takeover=True) as new:
            new.load(model, 0)  # held by a live run: passes only as a takeover
            with pytest.raises(EngineError, match="aborted"):
                running.result(timeout=WAIT)
            with pytest.raises(ValueError, match=r"409.*held by run 'new'"):
                old.load(model, 8)
            assert new.version == 0 and held_by(server) == "new"
            old.close()  # not the holder: its close leaves the new run's hold alone
            assert held_by(server) == "new"


@pytest.mark.timeout(120)
def test_the_same_run_resumed_takes_its_server_back_from_its_checkpoint(
    server: Served, model: torch.nn.Module
) -> None:
    crashed = HTTPEngine(server.url, run="mine")
    try:
        crashed.load(model, 9)  # then "killed": never closed, so never released
        with HTTPEngine(server.url, run="mine") as resumed:
            resumed.load(model, 4)  # the checkpoint's step, below what the server had
            assert resumed.version == 4 and held_by(server) == "mine"
        with HTTPEngine(server.url, run="someone") as other:
            other.load(model, 0)  # the resumed run closed: released
    finally:
        crashed._pushed = False  # its server moved on; its close must not release
        crashed.close()


@pytest.mark.timeout(120)
def test_a_push_without_a_run_goes_only_to_a_server_nobody_holds(
    server: Served, model: torch.nn.Module
) -> None:
    with HTTPEngine(server.url, run="holder") as holder:
        holder.load(model, 1)
        path = write_weights(model, holder._folder(), 2)
        body = {"model_path": str(path), "dew_version": 2}
        with server.client() as client:
            refused = client.post("/update_weights_from_disk", json=body)
            assert refused.status_code == 409 and "held by run 'holder'" in refused.text
            released = client.post("/dew/release", json={"dew_run": "holder"}).json()
            assert released["success"] is True
            again = client.post("/dew/release", json={"dew_run": "holder"}).json()
            assert again["success"] is False  # released already
            took = client.post("/update_weights_from_disk", json=body)
            assert took.status_code == 200, took.text
            assert client.get("/health").json() == {
                "status": "ok",
                "dew_version": 2,
                "dew_in_flight": 0,
                "dew_run": None,  # a push without a run holds nothing
            }
        holder._pushed = False  # released above


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_fleet_of_a_new_run_publishes_from_0_on_servers_another_fleet_left_at_5(
    model: torch.nn.Module,
) -> None:
    with serve("--demo", "tiny") as a, serve("--demo", "tiny") as b:
        with EngineFleet([a.url, b.url], engine_options={"run": "run-1"}) as fleet:
            fleet.load(model, 5)
            assert [m.held_by for m in fleet.members()] == ["run-1", "run-1"]
        with EngineFleet([a.url, b.url], engine_options={"run": "run-2"}) as fleet:
            assert fleet.version == 5 and [m.held_by for m in fleet.members()] == [None, None]
            fleet.load(model, 0)
            assert fleet.version == 0 and [m.version for m in fleet.members()] == [0, 0]
            assert fleet.generate([5, 6], SamplingParams(max_tokens=3)).version == 0
            fleet.load(model, 1)
            with pytest.raises(ValueError, match="older than the fleet's 1"):
                fleet.load(model, 0)  # past its first publish, the fleet's rule holds


# ------------------------------------------------------------------ the rule itself


def test_the_claim_rule() -> None:
    claim = Claim()
    assert claim.check(None, restart=False, takeover=False, now=0) is False
    claim.took(None, 0)
    assert claim.held_by is None  # a push without a run holds nothing
    assert claim.check("a", restart=False, takeover=False, now=1) is True  # a new run
    claim.took("a", 1)
    assert claim.check("a", restart=False, takeover=False, now=2) is False  # same sequence
    assert claim.check("a", restart=True, takeover=False, now=2) is True  # resumed
    with pytest.raises(ClaimRefused, match=r"held by run 'a' \(its last push 9 s ago\)"):
        claim.check("b", restart=True, takeover=False, now=10)
    with pytest.raises(ClaimRefused, match="must name its run"):
        claim.check(None, restart=False, takeover=False, now=10)
    assert claim.held_by == "a"  # a refused check changed nothing
    assert claim.check("b", restart=True, takeover=True, now=10) is True
    assert claim.release("b") is False and claim.held_by == "a"  # b never took it
    assert claim.release("a") is True and claim.held_by is None
    assert claim.check("b", restart=True, takeover=False, now=11) is True
    assert claim.check(None, restart=False, takeover=False, now=11) is False


RUNS = st.sampled_from([None, "a", "b"])
PUSH = st.tuples(st.just("push"), RUNS, st.booleans(), st.booleans())
RELEASE = st.tuples(st.just("release"), st.sampled_from(["a", "b"]), st.just(False), st.just(False))


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(PUSH, RELEASE), max_size=40))
def test_the_claim_rule_holds_over_any_sequence_of_pushes_and_releases(
    events: list[tuple[str, str | None, bool, bool]],
) -> None:
    claim = Claim()
    holder: str | None = None  # the run of the last push that named one
    released = False
    for now, (kind, run, restart, takeover) in enumerate(events):
        if kind == "release":
            assert run is not None
            let_go = holder == run and not released
            assert claim.release(run) is let_go
            released = released or let_go
            continue
        held = None if released else holder
        allowed = held is None or (run is not None and (held == run or takeover))
        try:
            fresh = claim.check(run, restart=restart, takeover=takeover, now=float(now))
        except ClaimRefused:
            assert not allowed
            assert claim.held_by == held  # a refusal changes nothing
            continue
        assert allowed
        assert fresh == (run is not None and (restart or run != holder))
        claim.took(run, float(now))
        if run is not None:
            holder, released = run, False
        assert claim.held_by == (None if released else holder)
