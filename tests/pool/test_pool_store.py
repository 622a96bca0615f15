"""The bounded agreement rounds of dew.pool._store, driven in one process.

Each "rank" is a thread with its own store client; the store runs in this process.
Every thread is joined with a timeout.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from dew.pool._store import Missing, Rounds


@pytest.fixture
def store() -> Any:
    return dist.TCPStore(
        "127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False
    )


def _client(store: Any) -> Any:
    return dist.TCPStore("127.0.0.1", store.port, 1, False, timeout=timedelta(seconds=10))


def _run(store: Any, world: int, ranks: list[int], payload: str, timeout: float) -> dict:
    """Ranks in ``ranks`` each exchange once in a thread; returns rank -> result/error."""
    out: dict[int, Any] = {}

    def go(rank: int) -> None:
        rounds = Rounds(_client(store), rank, world)
        try:
            out[rank] = rounds.exchange("t", f"{payload}{rank}", timeout)
        except Missing as exc:
            out[rank] = exc

    threads = [threading.Thread(target=go, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
        assert not t.is_alive()
    return out


@pytest.mark.timeout(60)
def test_complete_round_returns_every_payload_by_rank(store: Any) -> None:
    out = _run(store, 3, [0, 1, 2], "p", timeout=10.0)
    assert out == {r: ["p0", "p1", "p2"] for r in range(3)}


@pytest.mark.timeout(60)
def test_missing_rank_is_named_within_the_deadline_and_a_late_one_fails_too(store: Any) -> None:
    t0 = time.monotonic()
    out = _run(store, 3, [0, 2], "p", timeout=0.5)
    assert time.monotonic() - t0 < 5.0
    for r in (0, 2):
        assert isinstance(out[r], Missing) and out[r].ranks == [1]
    late = _run(store, 3, [1], "p", timeout=10.0)  # arrives after the decision
    assert isinstance(late[1], Missing) and late[1].ranks == [1]


@pytest.mark.timeout(60)
def test_all_payloads_written_without_a_decision_counts_as_complete(store: Any) -> None:
    # Rank 1 wrote its payload but died before counting itself in: the round is whole.
    client = _client(store)
    client.set("t/0/1", "p1")
    out = _run(store, 2, [0], "p", timeout=0.3)
    assert out[0] == ["p0", "p1"]


@pytest.mark.timeout(60)
def test_rounds_are_numbered_per_tag(store: Any) -> None:
    a = Rounds(_client(store), 0, 1)
    assert a.exchange("x", "1", 1.0) == ["1"]
    assert a.exchange("x", "2", 1.0) == ["2"]
    assert a.next_name("x") == "x/2" and a.next_name("y") == "y/0"
