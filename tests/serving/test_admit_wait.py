"""A busy engine puts off admitting a few arrivals so later ones share their prefill.

The rule (``dew.serving.server._admit_now``) worked by hand and as a property, then the
real engine: with ``_BUSY`` long requests running, a lone arrival waits ``admit_wait``
iterations (none with ``admit_wait=0``, none beside a small batch), and ``_ENOUGH``
arrivals are admitted together at once.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dew.core import Call, SamplingParams
from dew.serving import RolloutServer
from dew.serving.server import _BUSY, _ENOUGH, _admit_now

from ._helpers import WAIT, prompts, wait_until

LONG = SamplingParams(max_tokens=600, temperature=0, stop_ids=())
ONE = SamplingParams(max_tokens=1, temperature=0, stop_ids=())


def test_the_rule_by_hand() -> None:
    # nothing pending, or a small batch, or enough pending: admit now, whatever the wait
    assert _admit_now(active=100, pending=0, deferred=0, admit_wait=4)
    assert _admit_now(active=_BUSY - 1, pending=1, deferred=0, admit_wait=4)
    assert _admit_now(active=100, pending=_ENOUGH, deferred=0, admit_wait=4)
    # busy, few pending: wait until admit_wait iterations were put off in a row
    assert not _admit_now(active=_BUSY, pending=1, deferred=0, admit_wait=4)
    assert not _admit_now(active=_BUSY, pending=_ENOUGH - 1, deferred=3, admit_wait=4)
    assert _admit_now(active=_BUSY, pending=1, deferred=4, admit_wait=4)
    assert _admit_now(active=_BUSY, pending=1, deferred=0, admit_wait=0)


@given(
    st.integers(0, 8),
    st.lists(st.tuples(st.integers(0, 64), st.integers(0, 12)), min_size=1, max_size=60),
)
def test_no_request_waits_more_than_admit_wait_iterations(
    admit_wait: int, iterations: list[tuple[int, int]]
) -> None:
    # drive the rule as the engine does: count the iterations put off in a row
    deferred = 0
    for active, pending in iterations:
        if _admit_now(active, pending, deferred, admit_wait):
            deferred = 0
        else:
            assert pending > 0 and active >= _BUSY and pending < _ENOUGH
            deferred += 1
        assert deferred <= admit_wait


def _busy(
    server: RolloutServer, count: int, stop: threading.Event, *, seed: int = 3
) -> list[Future[Call]]:
    """``count`` more long greedy requests, running once this returns."""
    total = server.stats()["active"] + count
    vocab = server.vocab_size
    futures = [server.submit(p, LONG, stop=stop) for p in prompts(count, vocab, seed=seed)]
    wait_until(lambda: server.stats()["active"] == total, f"{total} active requests")
    return futures


def _engine_iteration(server: RolloutServer) -> tuple[int, bool]:
    """The server's iteration count, and whether the engine thread asks."""
    engine = threading.current_thread().name == "RolloutServer-engine"
    return server.stats()["iterations"], engine


def _lone_wait(server: RolloutServer) -> int:
    """Iterations from a lone one-token request's arrival to its admission.

    Its arrival is known to an iteration only when the test thread ran the submit
    without being preempted; a probe where more than one iteration passed is made again.
    """
    prompt = prompts(1, server.vocab_size, seed=9)[0]
    for _ in range(50):
        admitted: list[tuple[int, bool]] = []
        before = server.stats()["iterations"]
        future = server.submit(prompt, ONE)
        arrived = server.stats()["iterations"]
        # run on the engine thread, the callback sees the iteration that admitted it (on
        # this thread, the request was done before the callback was added)
        future.add_done_callback(lambda _, seen=admitted: seen.append(_engine_iteration(server)))
        assert isinstance(future.result(timeout=WAIT), Call)
        iteration, on_engine = admitted[0]
        if arrived - before <= 1 and on_engine:
            return iteration - before
    raise AssertionError("no probe ran its submit within one engine iteration")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("admit_wait", [0, 6])
def test_a_lone_arrival_waits_admit_wait_iterations_beside_a_busy_batch(
    qwen: torch.nn.Module, admit_wait: int
) -> None:
    stop = threading.Event()
    with RolloutServer(qwen, max_batch=64, admit_wait=admit_wait) as server:
        assert server.admit_wait == admit_wait
        try:
            running = _busy(server, _BUSY, stop)
            waited = _lone_wait(server)
        finally:
            stop.set()
        for f in running:
            f.exception(timeout=WAIT)  # aborted: the busy batch was only a load
    if admit_wait == 0:
        assert waited <= 2  # the iteration under way, then the next admits it
    else:
        assert admit_wait <= waited <= admit_wait + 2


@pytest.mark.timeout(120)
def test_a_small_batch_and_enough_arrivals_are_admitted_at_once(qwen: torch.nn.Module) -> None:
    stop = threading.Event()
    with RolloutServer(qwen, max_batch=64, admit_wait=1000) as server:
        try:
            small = _busy(server, _BUSY - 1, stop)
            assert _lone_wait(server) <= 2  # beside fewer than _BUSY: no wait
            big = _busy(server, 1, stop, seed=5)  # admitted at once: the batch is small
            before = server.stats()["admissions"]
            seen: list[tuple[int, int]] = []  # (iteration, active) at each admission

            def note(_: Future[Call]) -> None:  # on the engine thread, as it admits
                stats = server.stats()
                seen.append((stats["iterations"], stats["active"]))

            *first, last = prompts(_ENOUGH, server.vocab_size, seed=11)
            burst = [server.submit(p, ONE) for p in first]
            for f in burst:  # fewer than _ENOUGH wait (1000 iterations: beyond the busy batch)
                f.add_done_callback(note)
            burst.append(server.submit(last, ONE))  # ... and now they are a batch
            calls = [f.result(timeout=WAIT) for f in burst]
            assert server.stats()["admissions"] == before + 1
            assert len(seen) == _ENOUGH - 1
            assert len({iteration for iteration, _ in seen}) == 1  # admitted together
            assert all(active == _BUSY for _, active in seen)  # at once, beside the busy
            assert all(isinstance(c, Call) for c in calls)
        finally:
            stop.set()
        for f in [*small, *big]:
            f.exception(timeout=WAIT)


def test_admit_wait_is_checked(qwen: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="admit_wait must be >= 0"):
        RolloutServer(qwen, admit_wait=-1)
    with pytest.raises((TypeError, ValueError), match="admit_wait"):
        RolloutServer(qwen, admit_wait=1.5)
