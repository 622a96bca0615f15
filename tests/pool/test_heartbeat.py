"""dew.pool._heartbeat in one process: the watch's rules, the rounds it interrupts, the
thread against a real store, and the connections it shuts down.

Across processes (SIGSTOP, slow steps, two launches) see test_hang.py.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from dew.pool._heartbeat import CLOSED, HangWatch, Heartbeat, own_endpoints, sever
from dew.pool._store import Missing, Rounds

# -- the watch: a state machine fed observations ----------------------------------------


def test_a_rank_silent_for_the_bound_is_named_once_and_a_beating_one_never() -> None:
    watch = HangWatch(world=3, rank=0, hang_after=10.0, now=0.0)
    assert watch.observe(0.0, ["0", "0", "0"]) == {}
    assert watch.observe(6.0, ["1", "1", "0"]) == {}  # rank 2 silent for 6 s
    assert watch.observe(9.9, ["2", "2", "0"]) == {}
    assert watch.observe(10.0, ["3", "3", "0"]) == {2: 10.0}
    assert watch.observe(30.0, ["4", "4", "0"]) == {}  # named once
    assert watch.hung == {2: 10.0}
    # Its own beat is never judged, even when it reads as silent.
    assert watch.observe(60.0, ["4", "5", "0"]) == {}


def test_a_rank_that_never_beat_is_named_from_when_watching_began() -> None:
    watch = HangWatch(world=2, rank=1, hang_after=5.0, now=100.0)
    assert watch.observe(104.0, [None, "0"]) == {}
    assert watch.observe(105.5, [None, "1"]) == {0: 5.5}


def test_a_closed_rank_has_left_and_is_never_named_hung() -> None:
    watch = HangWatch(world=2, rank=0, hang_after=1.0, now=0.0)
    assert watch.observe(0.5, ["0", CLOSED]) == {}
    assert watch.observe(50.0, ["9", CLOSED]) == {}
    assert watch.closed == {1} and watch.hung == {}


def test_the_watch_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="hang_after=0"):
        HangWatch(world=2, rank=0, hang_after=0, now=0.0)
    with pytest.raises(ValueError, match="beats: 1 values for a pool of 2"):
        HangWatch(world=2, rank=0, hang_after=1.0, now=0.0).observe(1.0, ["0"])


@settings(max_examples=200, deadline=None)
@given(
    gaps=st.lists(st.floats(0.01, 20.0), min_size=1, max_size=30),
    looks=st.lists(st.floats(0.01, 20.0), min_size=1, max_size=60),
)
def test_a_rank_is_named_exactly_when_some_observed_silence_reaches_the_bound(
    gaps: list[float], looks: list[float]
) -> None:
    # Rank 1 beats after each gap; the watcher looks at arbitrary times. Rank 1 is
    # named iff at some look it had not changed for hang_after since the look that
    # first saw its latest beat (the watcher's own clock only: beats between looks
    # are invisible).
    bound = 10.0
    beat_times = [sum(gaps[: i + 1]) for i in range(len(gaps))]
    watch = HangWatch(world=2, rank=0, hang_after=bound, now=0.0)
    now, seen, changed_at, expected = 0.0, None, 0.0, False
    for look in looks:
        now += look
        count = sum(1 for t in beat_times if t <= now)
        value = str(count)
        if value != seen:
            seen, changed_at = value, now
        elif now - changed_at >= bound:
            expected = True
        named = watch.observe(now, ["x", value])
        if named:
            assert expected and named == {1: pytest.approx(now - changed_at)}
            break
    assert (1 in watch.hung) == expected


# -- rounds decided for a hung rank -----------------------------------------------------


@pytest.fixture
def store() -> Iterator[Any]:
    server = dist.TCPStore(
        "127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False
    )
    yield server


def _client(store: Any) -> Any:
    return dist.TCPStore("127.0.0.1", store.port, 1, False, timeout=timedelta(seconds=30))


@pytest.mark.timeout(60)
def test_a_round_waiting_for_a_rank_found_hung_ends_at_once_naming_it(store: Any) -> None:
    gone: dict[int, str] = {}
    rounds = Rounds(_client(store), 0, 3, hung=lambda: dict(gone))
    result: dict[str, Any] = {}
    entered = threading.Event()

    def wait_in_round() -> None:
        entered.set()
        try:
            result["value"] = rounds.exchange("agree", "ok", timeout=30.0)
        except Missing as exc:
            result["error"] = exc

    thread = threading.Thread(target=wait_in_round)
    thread.start()
    try:
        entered.wait(10)
        helper = _client(store)
        # Rank 2 is only slow (it arrives later); rank 1 is found hung.
        deadline = time.monotonic() + 10
        while not helper.check(["agree/0/0"]):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        rounds.interrupt(helper)  # nothing known yet: the round keeps waiting
        assert thread.is_alive()
        gone[1] = "has not beaten for 30 s"
        started = time.monotonic()
        rounds.interrupt(helper)  # what the heartbeat's thread does each tick
        thread.join(10)
        assert not thread.is_alive() and time.monotonic() - started < 5
    finally:
        thread.join(40)
    error = result["error"]
    assert error.ranks == [1] and error.hung == {1: "has not beaten for 30 s"}
    # A rank arriving later reads the same decision.
    late = Rounds(_client(store), 2, 3)
    with pytest.raises(Missing) as caught:
        late.exchange("agree", "ok", timeout=5.0)
    assert caught.value.hung == {1: "has not beaten for 30 s"}


@pytest.mark.timeout(60)
def test_a_round_entered_after_a_rank_was_found_hung_fails_without_waiting(store: Any) -> None:
    rounds = Rounds(_client(store), 0, 2, hung=lambda: {1: "left the pool"})
    started = time.monotonic()
    with pytest.raises(Missing) as caught:
        rounds.exchange("agree", "ok", timeout=30.0)
    assert caught.value.hung == {1: "left the pool"}
    assert time.monotonic() - started < 5


@pytest.mark.timeout(60)
def test_a_hung_rank_that_wrote_its_payload_leaves_the_round_whole(store: Any) -> None:
    # Stopped between writing its payload and counting itself in: nothing is missing.
    _client(store).set("agree/0/1", "ok1")
    rounds = Rounds(_client(store), 0, 2, hung=lambda: {1: "has not beaten for 30 s"})
    assert rounds.exchange("agree", "ok0", timeout=30.0) == ["ok0", "ok1"]


# -- the thread against a real store ----------------------------------------------------


def _until(check: Any, seconds: float) -> float:
    """Seconds until ``check()`` holds (fails the test after ``seconds``)."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < seconds, "condition not reached"
        time.sleep(0.02)
    return time.monotonic() - started


@pytest.mark.timeout(60)
def test_heartbeats_name_a_silent_peer_and_not_a_live_one(store: Any) -> None:
    # All three "processes" are this one: they publish no endpoints, or finding one
    # hung would shut down the store connections of all (test_hang.py severs for real).
    beats = [Heartbeat(_client(store), r, 3, 0.5, endpoints=list) for r in range(3)]
    for b in beats:
        b.start()
    try:
        time.sleep(1.5)  # three bounds of everyone beating: nobody is named
        assert all(b.gone() == {} for b in beats)
        # Rank 2's thread stops as a SIGSTOP would stop it: no closing beat.
        beats[2]._stop.set()
        beats[2]._thread.join(10)  # type: ignore[union-attr]
        waited = _until(lambda: 2 in beats[0].gone() and 2 in beats[1].gone(), 10.0)
        assert waited < 5.0
        assert "has not beaten for" in beats[0].gone()[2]
        assert 1 not in beats[0].gone() and 0 not in beats[1].gone()
        # Rank 1 leaves properly: it is gone, not hung.
        beats[1].close()
        _until(lambda: 1 in beats[0].gone(), 10.0)
        assert beats[0].gone()[1] == "left the pool (closed it) before this round"
        assert beats[0].hung() == {2: pytest.approx(0.5, abs=0.5)}
    finally:
        for b in beats:
            b.close()
    assert all(b._thread is None for b in beats)


# -- shutting down the connections to a peer --------------------------------------------


@pytest.mark.timeout(30)
def test_sever_shuts_down_only_the_connections_to_the_peer() -> None:
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    clients, accepted = [], []
    try:
        for listener in listeners:
            client = socket.create_connection(listener.getsockname())
            clients.append(client)
            accepted.append(listener.accept()[0])
        peer = [listeners[0].getsockname()]  # the "hung" process's listening port
        ends = own_endpoints()
        assert all(listener.getsockname() in ends for listener in listeners)
        assert sever(peer) == 1
        clients[0].settimeout(5)
        assert clients[0].recv(1) == b""  # shut down: reads end at once
        clients[1].settimeout(0.2)
        with pytest.raises(TimeoutError):  # the other connection is untouched
            clients[1].recv(1)
        accepted[1].sendall(b"x")
        clients[1].settimeout(5)
        assert clients[1].recv(1) == b"x"
        assert clients[0].fileno() >= 0  # shut down, not closed: the fd is its owner's
    finally:
        for s in [*clients, *accepted, *listeners]:
            s.close()


# -- the pool starts and joins it -------------------------------------------------------


def _heartbeat_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dew-heartbeat")]


@pytest.mark.timeout(60)
def test_init_pool_runs_a_heartbeat_with_its_bound_and_close_joins_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dew.pool import init_pool

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    pool = init_pool("gloo", hang_timeout=2.0)
    try:
        assert pool.heartbeat is not None and pool.heartbeat.hang_after == 2.0
        assert pool.heartbeat.interval == pytest.approx(0.2)
        assert len(_heartbeat_threads()) == 1
    finally:
        pool.close()
    assert _heartbeat_threads() == []
    off = init_pool("gloo", hang_timeout=None)  # hangs found by the timeouts alone
    try:
        assert off.heartbeat is None and _heartbeat_threads() == []
    finally:
        off.close()


@pytest.mark.parametrize("value", [0, -1.0, True, "30"])
def test_init_pool_refuses_a_bad_hang_timeout(monkeypatch: pytest.MonkeyPatch, value: Any) -> None:
    from dew.pool import init_pool

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=f"hang_timeout={value!r} must be a positive number"):
        init_pool("gloo", hang_timeout=value)
