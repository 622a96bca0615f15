"""The gateway's session table: tokens, refusals, caps and atomic recording."""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest

from dew.core import Call, RolloutKey, Task
from dew.gateway._protocol import RequestError
from dew.gateway._sessions import Limits, SessionTable
from dew.gateway._text import Prefix

TASK = Task("7", {"q": 1})


def table(**kw) -> SessionTable:
    limits = {
        "max_turns": None,
        "max_tokens_per_session": None,
        "max_tokens_per_call": 100,
        "max_context": None,
    }
    limits.update({k: kw.pop(k) for k in list(kw) if k in limits})
    return SessionTable(Limits(**limits), **kw)


def auth(t: SessionTable, token: str):
    return t.authenticate(f"Bearer {token}")


def status_of(t: SessionTable, header: str | None) -> int:
    with pytest.raises(RequestError) as info:
        t.authenticate(header)
    return info.value.status


def call(n: int, finish: str = "stop") -> Call:
    return Call([1, 2], list(range(3, 3 + n)), [-0.5] * n, 0, finish_reason=finish)


def prefix() -> Prefix:
    return Prefix("x", np.asarray([1], dtype=np.int64))


def test_tokens_are_unique_random_and_stored_only_as_digests():
    t = table()
    tokens = {t.open(TASK, RolloutKey(0, i, 0)) for i in range(200)}
    assert len(tokens) == 200
    assert all(tok.startswith("dew-") and len(tok) >= 40 for tok in tokens)
    stored = repr(t._by_digest)
    assert not any(tok in stored or tok[4:] in stored for tok in tokens)


def test_unknown_missing_and_malformed_tokens_are_401():
    t = table()
    t.open(TASK, RolloutKey(0, 0, 0))
    for header in (None, "", "Bearer", "Bearer ", "Basic abc", "Bearer dew-nope", "dew-x"):
        assert status_of(t, header) == 401


def test_closed_session_is_410_and_superseded_is_409():
    t = table()
    first = t.open(TASK, RolloutKey(1, 2, 0))
    other = t.open(TASK, RolloutKey(1, 3, 0))
    auth(t, first)
    t.close(first)
    assert status_of(t, f"Bearer {first}") == 410
    second = t.open(TASK, RolloutKey(1, 2, 1))
    assert status_of(t, f"Bearer {first}") == 409  # superseded outranks closed
    auth(t, second)
    auth(t, other)  # another sample of the group is untouched
    # A resumed scheduler may reuse attempt numbers: the latest open still wins.
    third = t.open(TASK, RolloutKey(1, 2, 0))
    assert status_of(t, f"Bearer {second}") == 409
    auth(t, third)


def test_superseding_aborts_in_flight_requests_and_drops_their_calls():
    t = table()
    old = t.open(TASK, RolloutKey(0, 0, 0))
    a = t.grant(auth(t, old), n=1, requested=5, prompt_len=2)
    t.open(TASK, RolloutKey(0, 0, 1))
    assert a.stop.is_set()
    assert not t.record(a, [call(3)], [prefix()])
    rec = t.close(old)
    assert rec.calls == () and rec.turns == 1 and rec.tokens == 0


def test_record_is_all_or_nothing_and_close_collects_once():
    t = table()
    tok = t.open(TASK, RolloutKey(0, 0, 0))
    s = auth(t, tok)
    a = t.grant(s, n=2, requested=4, prompt_len=2)
    calls = [call(4), call(2)]
    assert t.record(a, calls, [prefix(), prefix()])
    b = t.grant(s, n=1, requested=4, prompt_len=2)
    t.abort(tok)
    assert b.stop.is_set() and not t.record(b, [call(1)], [prefix()])
    assert status_of(t, f"Bearer {tok}") == 410
    rec = t.close(tok)
    assert rec.calls == tuple(calls) and rec.tokens == 6 and rec.turns == 2
    assert rec.key == RolloutKey(0, 0, 0) and rec.task == TASK and rec.error is None
    with pytest.raises(ValueError, match="already collected"):
        t.close(tok)
    with pytest.raises(ValueError, match="unknown"):
        t.close("dew-nope")


def test_turn_cap_refuses_and_marks_truncation():
    t = table(max_turns=2)
    tok = t.open(TASK, RolloutKey(0, 0, 0))
    s = auth(t, tok)
    for _ in range(2):
        t.record(t.grant(s, n=1, requested=1, prompt_len=1), [call(1)], [prefix()])
    with pytest.raises(RequestError) as info:
        t.grant(s, n=1, requested=1, prompt_len=1)
    assert info.value.status == 400 and info.value.code == "turn_limit_exceeded"
    assert t.close(tok).truncation == "turns"


def test_token_budget_clamps_then_refuses():
    t = table(max_tokens_per_session=10)
    tok = t.open(TASK, RolloutKey(0, 0, 0))
    s = auth(t, tok)
    a = t.grant(s, n=1, requested=6, prompt_len=1)
    assert a.max_tokens == 6 and a.cause is None
    # A concurrent request sees the reservation, not just the recorded tokens.
    b = t.grant(s, n=2, requested=6, prompt_len=1)
    assert b.max_tokens == 2 and b.cause == "length"
    t.record(a, [call(6)], [prefix()])
    t.record(b, [call(2, "length"), call(1)], [prefix(), prefix()])
    last = t.grant(s, n=1, requested=5, prompt_len=1)  # the one token left
    assert last.max_tokens == 1
    t.record(last, [call(1)], [prefix()])
    with pytest.raises(RequestError) as info:
        t.grant(s, n=1, requested=1, prompt_len=1)
    assert info.value.code == "token_limit_exceeded"
    rec = t.close(tok)
    assert rec.tokens == 10 and rec.truncation == "length"


def test_context_cap_clamps_and_refuses():
    t = table(max_context=10, max_tokens_per_call=8)
    tok = t.open(TASK, RolloutKey(0, 0, 0))
    s = auth(t, tok)
    a = t.grant(s, n=1, requested=None, prompt_len=4)
    assert a.max_tokens == 6 and a.cause == "context"
    t.record(a, [call(5)], [prefix()])  # ended before the cap: not truncated
    assert t.grant(s, n=1, requested=3, prompt_len=4).max_tokens == 3
    with pytest.raises(RequestError) as info:
        t.grant(s, n=1, requested=3, prompt_len=10)
    assert info.value.code == "context_length_exceeded"
    assert t.close(tok).truncation == "context"


def test_release_frees_the_reservation_and_keeps_the_first_engine_error():
    t = table(max_tokens_per_session=4)
    tok = t.open(TASK, RolloutKey(0, 0, 0))
    s = auth(t, tok)
    a = t.grant(s, n=1, requested=4, prompt_len=1)
    t.release(a, error="engine failure: boom")
    b = t.grant(s, n=1, requested=4, prompt_len=1)  # the reservation came back
    t.release(b, error="second")
    t.fail(s, "gateway failure: third")
    assert t.close(tok).error == "engine failure: boom"
    other = t.open(TASK, RolloutKey(0, 1, 0))
    t.fail(auth(t, other), "gateway failure: KeyError")
    assert t.close(other).error == "gateway failure: KeyError"


def test_history_keeps_the_latest_entries():
    t = table(history=2)
    tok = t.open(TASK, RolloutKey(0, 0, 0))
    s = auth(t, tok)
    entries = [Prefix(str(i), np.asarray([i])) for i in range(3)]
    for e in entries:
        t.record(t.grant(s, n=1, requested=1, prompt_len=1), [call(1)], [e])
    assert t.history(s) == tuple(entries[1:])


def test_tombstones_are_retained_then_forgotten():
    t = table(retain=2)
    tokens = [t.open(TASK, RolloutKey(0, i, 0)) for i in range(3)]
    for tok in tokens:
        t.close(tok)
    assert status_of(t, f"Bearer {tokens[0]}") == 401
    assert [status_of(t, f"Bearer {tok}") for tok in tokens[1:]] == [410, 410]


def test_a_tombstone_keeps_neither_the_task_nor_the_sessions_buffers():
    # 65,536 tombstones by default: each must be small, whatever the tasks held.
    class Payload:  # a task's data, weakly referencable
        pass

    data = Payload()
    alive = weakref.ref(data)
    t = table()
    tok = t.open(Task("big", data), RolloutKey(0, 0, 0))
    recording = t.close(tok)
    assert recording.task.data is data
    del recording, data
    gc.collect()
    assert alive() is None  # only the recording held it
    assert status_of(t, f"Bearer {tok}") == 410
    t.open(TASK, RolloutKey(0, 0, 1))
    assert status_of(t, f"Bearer {tok}") == 409  # a tombstone can still be superseded
    with pytest.raises(ValueError, match="already collected"):
        t.close(tok)


def test_close_all_stops_everything_and_refuses_new_sessions():
    t = table()
    tok = t.open(TASK, RolloutKey(0, 0, 0))
    a = t.grant(auth(t, tok), n=1, requested=1, prompt_len=1)
    t.close_all()
    assert a.stop.is_set()
    assert status_of(t, f"Bearer {tok}") == 410
    with pytest.raises(RuntimeError, match="closed"):
        t.open(TASK, RolloutKey(0, 1, 0))


def test_concurrent_admissions_never_overspend_the_budget():
    t = table(max_tokens_per_session=50, max_tokens_per_call=7)
    tok = t.open(TASK, RolloutKey(0, 0, 0))
    s = auth(t, tok)
    barrier = threading.Barrier(8)
    granted: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        barrier.wait(timeout=10)
        for _ in range(10):
            try:
                a = t.grant(s, n=1, requested=None, prompt_len=1)
            except RequestError:
                return
            with lock:
                granted.append(a.max_tokens)
            t.record(a, [call(a.max_tokens, "length")], [prefix()])

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert sum(granted) == 50
    assert t.close(tok).tokens == 50


@pytest.mark.parametrize("name", ["max_turns", "max_tokens_per_session", "max_context"])
def test_limits_are_validated(name):
    base = {
        "max_turns": None,
        "max_tokens_per_session": None,
        "max_tokens_per_call": 1,
        "max_context": None,
    }
    with pytest.raises(ValueError, match=name):
        Limits(**{**base, name: 0})
    with pytest.raises(ValueError, match="max_tokens_per_call"):
        Limits(**{**base, "max_tokens_per_call": 0})
