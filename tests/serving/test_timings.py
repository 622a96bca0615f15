"""Engines report their iteration timings (:class:`dew.core.Timed`).

The in-process RolloutServer counts every decode step; ``dew serve`` answers its log on
``GET /dew/timings`` (behind its API key); an HTTPEngine reads it within its connect
timeout and names it by the server's URL; a fleet reports one entry per member, leaving
out a member that does not answer, and raises only when none does. Real ``dew serve``
processes on 127.0.0.1 (two shared by the module, started together; one more for the
test that stops it).
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import wait
from contextlib import ExitStack

import httpx
import pytest

from dew.core import EngineError, EngineTimings, IterationLog, SamplingParams, Timed
from dew.serving import RolloutServer
from dew.serving.fleet import EngineFleet
from dew.serving.http_engine import HTTPEngine

from ._fleet_helpers import start_servers
from ._helpers import WAIT, prompts
from ._launch import Served

KEY = "timings-key"
MAX_BATCH = 8
ARGS = ("--demo", "tiny", "--max-batch", str(MAX_BATCH), "--api-key", KEY)


def _decoded(log: IterationLog) -> int:
    """Tokens the logged steps decoded: each step one per active sequence."""
    return sum(active * n for active, (n, _) in log.rows().items())


def _caught_up(read: Callable[[], IterationLog], tokens: int) -> IterationLog:
    """``read()`` once its steps decoded ``tokens``: an engine logs a step just after
    the step resolved its calls, so a read right after the last call may lack it."""
    deadline = time.monotonic() + WAIT
    while True:
        log = read()
        if _decoded(log) >= tokens or time.monotonic() > deadline:
            return log
        time.sleep(0.01)


@pytest.fixture(scope="module")
def pair() -> Iterator[list[Served]]:
    with ExitStack() as stack:
        yield start_servers(stack, ARGS, ARGS)


# --------------------------------------------------------------------------- in process


@pytest.mark.timeout(60)
def test_the_in_process_engine_logs_every_step_with_its_active_count(
    server: RolloutServer,
) -> None:
    assert isinstance(server, Timed)
    [empty] = server.timings()
    assert empty == EngineTimings("local", 16, empty.iterations) and empty.iterations.rows() == {}
    k = 6
    batch = prompts(20, server.vocab_size, seed=1)  # more than max_batch=16: two waves
    futures = [server.submit(p, SamplingParams(max_tokens=k, stop_ids=())) for p in batch]
    calls = [f.result(timeout=WAIT) for f in futures]
    server.generate([5, 6, 7], SamplingParams(max_tokens=k, stop_ids=()))  # alone: active 1
    # The prefill samples a request's first token, each logged step one more per
    # sequence: every token but the first of every call, exactly.
    tokens = sum(len(c.completion) - 1 for c in calls) + k - 1
    _caught_up(lambda: server.timings()[0].iterations, tokens)
    [entry] = server.timings()
    rows = entry.iterations.rows()
    assert entry.name == "local" and entry.max_active == 16
    assert all(1 <= active <= 16 for active in rows) and 1 in rows
    assert all(n > 0 and s > 0 for n, s in rows.values())
    assert _decoded(entry.iterations) == tokens
    assert entry.iterations.iterations >= 2 * (k - 1)  # at least the two waves' steps
    assert entry.iterations.iterations == server.stats()["iterations"]  # no load, no stop
    assert entry.iterations.fit_line() is not None  # steps at several widths
    # A snapshot: later steps do not change what was returned.
    server.generate([5, 6, 7], SamplingParams(max_tokens=k, stop_ids=()))
    later = _caught_up(lambda: server.timings()[0].iterations, tokens + k - 1)
    assert entry.iterations.rows() == rows
    assert later.since(entry.iterations).rows()[1][0] == k - 1


# --------------------------------------------------------------------------- dew serve


@pytest.mark.timeout(120)
def test_dew_serve_answers_its_log_behind_the_key(pair: list[Served]) -> None:
    url = pair[0].url
    with httpx.Client(base_url=url, timeout=WAIT) as client:
        refused = client.get("/dew/timings")
        assert refused.status_code == 401
        assert refused.json()["error"]["param"] == "authorization"
        answer = client.get("/dew/timings", headers={"Authorization": f"Bearer {KEY}"})
    assert answer.status_code == 200
    [data] = answer.json()["engines"]
    assert data["name"] == "local" and data["max_active"] == MAX_BATCH
    log = IterationLog.from_json(data["iterations"])  # the documented shape
    assert all(isinstance(k, str) and len(v) == 2 for k, v in data["iterations"].items())
    assert log.iterations >= 0


@pytest.mark.timeout(120)
def test_an_http_engine_reads_the_servers_log_named_by_its_url(pair: list[Served]) -> None:
    url = pair[0].url
    with HTTPEngine(url, api_key=KEY, batch_groups=True) as engine:
        assert isinstance(engine, Timed)
        [before] = engine.timings()
        lengths = (3, 5, 7, 9)  # one /generate of four: steps at 4, 3, 2 and 1 active
        batch = prompts(len(lengths), engine.vocab_size, seed=2)
        futures = [
            engine.submit(p, SamplingParams(max_tokens=n, stop_ids=()), affinity="group")
            for p, n in zip(batch, lengths, strict=True)
        ]
        calls = [f.result(timeout=WAIT) for f in futures]
        tokens = sum(len(c.completion) - 1 for c in calls)
        _caught_up(lambda: engine.timings()[0].iterations.since(before.iterations), tokens)
        [after] = engine.timings()
        # Anything but a 200 is an EngineError naming the URL (here, a 404).
        with pytest.raises(EngineError, match=re.escape(f"{url}/dew/nothing: 404")):
            engine._block(engine._read("/dew/nothing"))
    assert before.name == after.name == url and after.max_active == MAX_BATCH
    ran = after.iterations.since(before.iterations)
    rows = ran.rows()
    assert rows and all(1 <= active <= 4 for active in rows) and 1 in rows
    assert ran.iterations >= max(lengths) - 1
    assert _decoded(ran) == tokens
    if len(rows) > 1:  # the four joined in one step or a few: either way several widths
        assert ran.fit_line() is not None


@pytest.mark.timeout(120)
def test_a_fleet_reports_one_entry_per_member(pair: list[Served]) -> None:
    urls = [s.url for s in pair]
    with EngineFleet(urls, api_key=KEY) as fleet:
        assert isinstance(fleet, Timed)
        before = fleet.timings()
        sp = SamplingParams(max_tokens=4, stop_ids=())
        futures = [fleet.submit(p, sp) for p in prompts(8, fleet.vocab_size, seed=3)]
        done, _ = wait(futures, timeout=WAIT)
        assert len(done) == len(futures) and all(f.exception() is None for f in futures)
        tokens = sum(len(f.result().completion) - 1 for f in futures)

        def ran_since() -> IterationLog:
            now = fleet.timings()
            logs = [a.iterations.since(b.iterations) for a, b in zip(now, before, strict=True)]
            return logs[0].merged(logs[1])

        _caught_up(ran_since, tokens)
        after = fleet.timings()
    assert [e.name for e in before] == [e.name for e in after] == urls
    assert all(e.max_active == MAX_BATCH for e in after)
    ran = [a.iterations.since(b.iterations) for a, b in zip(after, before, strict=True)]
    assert all(r.iterations > 0 for r in ran)  # least-work routing used both
    assert sum(_decoded(r) for r in ran) == tokens


@pytest.mark.timeout(180)
def test_a_server_that_does_not_answer_raises_naming_it_and_a_fleet_goes_on(
    pair: list[Served],
) -> None:
    other = pair[0].url
    with ExitStack() as stack:
        [gone] = start_servers(stack, ARGS)
        engine = stack.enter_context(HTTPEngine(gone.url, api_key=KEY, connect_timeout=1.0))
        both = stack.enter_context(EngineFleet([gone.url, other], api_key=KEY))
        alone = stack.enter_context(EngineFleet([gone.url], api_key=KEY))
        assert [e.name for e in both.timings()] == [gone.url, other]
        # Frozen (SIGSTOP): the connection is made, no answer comes; the read gives up
        # at the connect timeout.
        os.kill(gone.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(EngineError, match=re.escape(gone.url)) as frozen:
                engine.timings()
            assert time.monotonic() - start < 2.0  # 1 s, and not the 5 s default
            assert "\n" not in str(frozen.value)
        finally:
            os.kill(gone.pid, signal.SIGCONT)
        assert engine.timings()[0].name == gone.url  # answers again
        gone.stop()
        start = time.monotonic()
        with pytest.raises(EngineError, match=re.escape(f"{gone.url}/dew/timings")) as refused:
            engine.timings()
        assert time.monotonic() - start < 1.0 and "\n" not in str(refused.value)
        # The fleet leaves the member out of this read and goes on.
        assert [e.name for e in both.timings()] == [other]
        with pytest.raises(EngineError, match=re.escape(gone.url)) as none:
            alone.timings()
        assert "no fleet member answered" in str(none.value)
