"""The recording gateway's session table: who may call, what they may spend, what was recorded.

One session per (task, rollout key) attempt. Its bearer token is 32 random bytes from
:mod:`secrets`; the table stores only the token's SHA-256 digest and finds a session
by a dict lookup on the digest of the presented token, so neither the stored secret
nor the time a lookup takes depends on how much of a guess was right.

Invariants (all state is guarded by one lock; every operation holds it briefly and
never while generating):

* A request is *granted* before it generates: the session is open, its turn count
  (requests, counted when granted) is under ``max_turns``, and ``n x max_tokens`` are
  reserved from the session's token budget, clamped to what is left and to the
  context. Every :class:`Grant` ends exactly once, by :meth:`SessionTable.record`
  or :meth:`SessionTable.release`.
* A request's choices are recorded together or not at all, and only while the
  session is open and the request was not aborted. Calls are kept in the order they
  were recorded. Nothing is ever recorded for a request refused with 401, 409 or 410.
* Closing, aborting or superseding a session sets the stop event of every request
  it has in flight, so the engine aborts them; their results are then dropped.
* Opening a session for a (group, sample) supersedes every earlier session of that
  pair: their tokens answer 409 from then on, whatever attempt number was used.
* A session whose recording was collected stays as a tombstone (its token answers
  409 or 410) until ``retain`` newer ones were collected; then its token is unknown (401).
  A tombstone keeps only the key and whether it was superseded (about 200 bytes with
  its table entries, not the task or the session's buffers), so the table's memory is
  bounded by ``retain`` tombstones plus the open sessions.
"""

from __future__ import annotations

import collections
import hashlib
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from dew.core import Call, RolloutKey, Task, as_int
from dew.gateway._protocol import RequestError
from dew.gateway._text import Prefix

__all__ = ["Grant", "Limits", "Recording", "SessionTable"]


@dataclass(frozen=True)
class Recording:
    """What one session recorded.

    ``calls`` in recording order. ``truncation`` is the first session limit that cut
    the agent short (``"turns"``, ``"length"`` for the token budget, ``"context"``),
    ``error`` the first engine failure met while serving it (an infrastructure
    error, not the agent's). ``turns`` counts granted requests, ``tokens`` the
    recorded completion tokens.
    """

    key: RolloutKey
    task: Task
    calls: tuple[Call, ...]
    truncation: str | None
    error: str | None
    turns: int
    tokens: int


@dataclass(frozen=True)
class Limits:
    """Per-session caps. ``None`` means no cap (``max_tokens_per_call`` always applies)."""

    max_turns: int | None
    max_tokens_per_session: int | None
    max_tokens_per_call: int
    max_context: int | None

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens_per_session", "max_context"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, as_int(getattr(self, name), name, minimum=1))
        object.__setattr__(
            self,
            "max_tokens_per_call",
            as_int(self.max_tokens_per_call, "max_tokens_per_call", minimum=1),
        )


@dataclass(eq=False)
class _TokenSession:
    key: RolloutKey
    task: Task
    digest: bytes
    open: bool = True
    superseded: bool = False
    calls: list[Call] = field(default_factory=list)
    history: collections.deque[Prefix] = field(default_factory=collections.deque)
    inflight: set[threading.Event] = field(default_factory=set)
    turns: int = 0
    tokens: int = 0
    reserved: int = 0
    truncation: str | None = None
    error: str | None = None


@dataclass(eq=False, slots=True)
class _Tombstone:
    """What stays of a collected session: enough to answer its token with 409 or 410."""

    key: RolloutKey
    digest: bytes
    superseded: bool
    open: bool = False
    inflight: tuple[threading.Event, ...] = ()


@dataclass(frozen=True, eq=False)
class Grant:
    """One request allowed to generate: its token budget, abort event and reservation.

    (Named apart from the scheduler's admission of rollouts into groups: a grant is the
    gateway letting one HTTP request spend its session's turns and tokens.)
    """

    session: _TokenSession
    max_tokens: int
    cause: str | None  # the session limit that clamped max_tokens, if any
    stop: threading.Event
    reserved: int
    history: tuple[Prefix, ...]


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class SessionTable:
    def __init__(self, limits: Limits, *, retain: int = 65536, history: int = 8) -> None:
        if retain < 0:
            raise ValueError(f"retain must be >= 0, got {retain}")
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        self.limits = limits
        self._retain = retain
        self._history = history
        self._lock = threading.Lock()
        self._by_digest: dict[bytes, _TokenSession | _Tombstone] = {}
        self._latest: dict[tuple[int, int], _TokenSession | _Tombstone] = {}
        self._tombstones: collections.deque[bytes] = collections.deque()
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    def open(self, task: Task, key: RolloutKey) -> str:
        token = "dew-" + secrets.token_urlsafe(32)
        digest = _digest(token)
        session = _TokenSession(key=key, task=task, digest=digest)
        with self._lock:
            if self._closed:
                raise RuntimeError("the gateway is closed; no session can be opened")
            previous = self._latest.get((key.group, key.sample))
            if previous is not None:
                previous.superseded = True
                self._stop(previous)
            self._latest[(key.group, key.sample)] = session
            self._by_digest[digest] = session
        return token

    def abort(self, token: str) -> None:
        """Refuse the session's further requests and abort those in flight; keep its calls."""
        with self._lock:
            self._stop(self._find(token))

    def close(self, token: str) -> Recording:
        """Close the session and hand over its recording (once)."""
        with self._lock:
            s = self._find(token)
            if isinstance(s, _Tombstone):
                raise ValueError(f"{s.key}: the session's recording was already collected")
            self._stop(s)
            out = Recording(s.key, s.task, tuple(s.calls), s.truncation, s.error, s.turns, s.tokens)
            s.calls = []
            s.history.clear()
            stone = _Tombstone(s.key, s.digest, s.superseded)
            self._by_digest[s.digest] = stone
            pair = (s.key.group, s.key.sample)
            if self._latest.get(pair) is s:
                self._latest[pair] = stone
            self._tombstones.append(s.digest)
            while len(self._tombstones) > self._retain:
                self._forget(self._tombstones.popleft())
        return out

    def close_all(self) -> None:
        with self._lock:
            self._closed = True
            for s in self._by_digest.values():
                self._stop(s)

    def _find(self, token: str) -> _TokenSession | _Tombstone:
        s = self._by_digest.get(_digest(token)) if isinstance(token, str) else None
        if s is None:
            raise ValueError("unknown session token")
        return s

    def _stop(self, s: _TokenSession | _Tombstone) -> None:
        s.open = False
        for event in s.inflight:
            event.set()

    def _forget(self, digest: bytes) -> None:
        s = self._by_digest.pop(digest, None)
        if s is not None and self._latest.get((s.key.group, s.key.sample)) is s:
            del self._latest[(s.key.group, s.key.sample)]

    # ------------------------------------------------------------------ requests

    def authenticate(self, authorization: str | None) -> _TokenSession:
        """The open session an ``Authorization`` header names, or a 401/409/410."""
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise RequestError(
                401,
                "missing bearer token: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                kind="authentication_error",
            )
        with self._lock:
            s = self._by_digest.get(_digest(token))
            if s is None:
                raise RequestError(
                    401, "invalid API key", code="invalid_api_key", kind="authentication_error"
                )
            self._check_open(s)
        assert isinstance(s, _TokenSession)  # a tombstone is never open
        return s

    @staticmethod
    def _check_open(s: _TokenSession | _Tombstone) -> None:
        if s.superseded:
            raise RequestError(
                409,
                f"{s.key} was superseded by a newer attempt of this sample",
                code="session_superseded",
                kind="conflict_error",
            )
        if not s.open:
            raise RequestError(410, f"{s.key} is closed", code="session_closed", kind="gone_error")

    def history(self, s: _TokenSession) -> tuple[Prefix, ...]:
        with self._lock:
            return tuple(s.history)

    def grant(self, s: _TokenSession, *, n: int, requested: int | None, prompt_len: int) -> Grant:
        """Reserve the request's turn and tokens, or refuse it with a 4xx."""
        lim = self.limits
        with self._lock:
            self._check_open(s)
            if lim.max_turns is not None and s.turns >= lim.max_turns:
                s.truncation = s.truncation or "turns"
                raise RequestError(
                    400,
                    f"{s.key} reached its turn limit (max_turns={lim.max_turns})",
                    code="turn_limit_exceeded",
                )
            budget = min(requested or lim.max_tokens_per_call, lim.max_tokens_per_call)
            cause = None
            if lim.max_context is not None:
                room = lim.max_context - prompt_len
                if room < 1:
                    s.truncation = s.truncation or "context"
                    raise RequestError(
                        400,
                        f"the prompt has {prompt_len} tokens; the context holds "
                        f"{lim.max_context} (max_context)",
                        param="messages",
                        code="context_length_exceeded",
                    )
                if room < budget:
                    budget, cause = room, "context"
            if lim.max_tokens_per_session is not None:
                left = (lim.max_tokens_per_session - s.tokens - s.reserved) // n
                if left < 1:
                    s.truncation = s.truncation or "length"
                    raise RequestError(
                        400,
                        f"{s.key} spent its token budget "
                        f"(max_tokens_per_session={lim.max_tokens_per_session})",
                        code="token_limit_exceeded",
                    )
                if left < budget:
                    budget, cause = left, "length"
            stop = threading.Event()
            s.turns += 1
            s.reserved += n * budget
            s.inflight.add(stop)
            return Grant(s, budget, cause, stop, n * budget, tuple(s.history))

    def _unreserve(self, a: Grant) -> None:
        a.session.reserved -= a.reserved
        a.session.inflight.discard(a.stop)

    def record(self, a: Grant, calls: Sequence[Call], prefixes: Sequence[Prefix]) -> bool:
        """Record all of a request's calls, unless its session closed or it was aborted."""
        with self._lock:
            self._unreserve(a)
            s = a.session
            if not s.open or a.stop.is_set():
                return False
            s.calls.extend(calls)
            s.tokens += sum(len(c.completion) for c in calls)
            s.history.extend(prefixes)
            while len(s.history) > self._history:
                s.history.popleft()
            cut = any(
                c.finish_reason == "length" and len(c.completion) >= a.max_tokens for c in calls
            )
            if a.cause is not None and cut:
                s.truncation = s.truncation or a.cause
            return True

    def release(self, a: Grant, *, error: str | None = None) -> None:
        """End a grant that records nothing; ``error`` marks an engine failure."""
        with self._lock:
            self._unreserve(a)
            if error is not None and a.session.error is None:
                a.session.error = error

    def fail(self, s: _TokenSession, error: str) -> None:
        """Mark the session as failed by the gateway (kept: the first such error)."""
        with self._lock:
            if s.error is None:
                s.error = error

    def status(self, s: _TokenSession) -> RequestError | None:
        """Why the session no longer serves (its 409/410), or None while open."""
        with self._lock:
            try:
                self._check_open(s)
            except RequestError as err:
                return err
            return None
