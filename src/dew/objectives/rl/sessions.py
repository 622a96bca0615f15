"""Rollout sessions: the vocabulary shared by sources, the scheduler and pack.

A *source* starts a *session* for a (task, key) pair; the session runs one rollout
(one or more model calls) and resolves to a :class:`Rollout` whose ``status`` says
how it ended. Failures are data only here, at the session boundary: a source that
cannot run a rollout reports ``INFRA_ERROR`` with ``error`` set, never a reward.

Invariants of :class:`ThreadedSource` (the one concurrency helper in this module):

* every session resolves exactly once: to what ``run`` returned, to the exception
  ``run`` raised (re-raised by ``result()`` with its traceback), or to a
  ``CANCELLED`` rollout when ``cancel()`` came before ``run`` returned;
* each done-callback runs exactly once, after the session resolved, on whichever
  thread resolved it (or on the caller's thread when added after that);
* the worker pool is bounded by ``workers`` and owned by the source: ``close()``
  sets every running session's stop event, drops queued ones, waits until every
  session it started has resolved (a subclass may resolve some off the pool, e.g.
  from an engine's future) and joins the workers.
"""

from __future__ import annotations

import enum
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "TRUNCATION_POLICIES",
    "Call",
    "Chain",
    "Rollout",
    "RolloutKey",
    "Session",
    "SessionSource",
    "Status",
    "Task",
    "ThreadedSource",
    "Truncation",
    "chains",
    "merge_ratio",
    "session_metrics",
    "truncation_policy",
]

_EMPTY: Mapping[str, Any] = MappingProxyType({})


class Status(enum.Enum):
    """How a rollout ended."""

    COMPLETED = "completed"  # ran to its end; scored by the verifier
    AGENT_ERROR = "agent_error"  # the policy did something invalid; still scored
    TRUNCATED = "truncated"  # cut by a length, turn, context or wall-clock limit
    INFRA_ERROR = "infra_error"  # the environment, harness or verifier broke; never scored
    CANCELLED = "cancelled"  # stopped on request; never scored


@dataclass(frozen=True)
class Task:
    """One unit of work. ``id`` is what a source looks the task up by."""

    id: str
    data: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)


class RolloutKey(NamedTuple):
    """The scheduler's label for one attempt at one sample of one group.

    A named tuple rather than a dataclass: keys are hashed on every event the
    scheduler handles, and a tuple hashes and compares in C.
    """

    group: int
    sample: int
    attempt: int

    def __str__(self) -> str:
        return f"rollout(group={self.group}, sample={self.sample}, attempt={self.attempt})"


@dataclass(frozen=True, eq=False)
class Call:
    """One model call inside a rollout, recorded token-exactly.

    ``log_probs[i]`` is the behavior log-probability of ``completion[i]`` under the
    distribution it was actually sampled from (temperature-scaled and filtered).
    ``version`` is the weights version that served the call; a call that spanned a
    weight push reports the oldest. ``support[i]``, when present, lists the token ids
    the filtered sampler could have drawn at step ``i`` (top-k / top-p).
    ``finish_reason`` is ``"stop"`` (a stop token, kept in ``completion``) or
    ``"length"`` (``max_tokens`` reached), as an engine reports it.

    Token sequences may be lists, tuples or 1-D numpy arrays; they are not copied.
    Validation happens when the call is put into a :class:`Rollout`, so the error can
    name the rollout.
    """

    prompt: Sequence[int]
    completion: Sequence[int]
    log_probs: Sequence[float]
    version: int
    temperature: float = 1.0
    support: Sequence[Sequence[int]] | None = None
    finish_reason: str | None = None


@dataclass(frozen=True, eq=False)
class Rollout:
    """What a session resolves to.

    ``reward`` is the verifier's score (``None`` when it never ran), ``components``
    its parts. ``truncation`` says why a ``TRUNCATED`` rollout was cut (``"length"``,
    ``"turns"``, ``"context"``, ``"wall_clock"``). ``submitted`` and ``finished`` are
    monotonic seconds stamped by the scheduler.

    Construction validates everything a source could get wrong and raises
    ``ValueError`` naming the rollout key and the field.
    """

    key: RolloutKey
    task: Task
    status: Status
    calls: Sequence[Call] = ()
    reward: float | None = None
    components: Mapping[str, float] = field(default_factory=lambda: _EMPTY)
    truncation: str | None = None
    error: str | None = None
    submitted: float | None = None
    finished: float | None = None

    def __post_init__(self) -> None:
        key = self.key
        if not isinstance(key, RolloutKey):
            raise ValueError(f"Rollout.key must be a RolloutKey, got {key!r}")
        if not isinstance(self.status, Status):
            raise ValueError(f"{key}: unknown status {self.status!r}; expected a Status member")
        if self.reward is not None:
            if not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
                raise ValueError(
                    f"{key}: reward must be a finite number or None, got {self.reward!r}"
                )
        for name, value in self.components.items():
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{key}: reward component {name!r} must be finite, got {value!r}")
        if self.status is Status.TRUNCATED and not self.truncation:
            raise ValueError(f"{key}: a TRUNCATED rollout needs truncation set to its cause")
        if self.status in _SCORED and not self.calls:
            raise ValueError(f"{key}: status {self.status.name} needs at least one call")
        for i, call in enumerate(self.calls):
            _check_call(call, key, i)
        # Read on every staleness check, so computed once; the dataclass is frozen.
        object.__setattr__(self, "_oldest", min((c.version for c in self.calls), default=None))

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.completion) for c in self.calls)

    @property
    def oldest_version(self) -> int | None:
        """The oldest weights version among the calls, or None without calls."""
        return self._oldest  # type: ignore[attr-defined]


_SCORED = frozenset({Status.COMPLETED, Status.AGENT_ERROR, Status.TRUNCATED})


def _rollout_unchecked(
    key: RolloutKey,
    task: Task,
    status: Status,
    calls: tuple[Call, ...],
    reward: float | None,
    truncation: str | None,
) -> Rollout:
    """A Rollout built without validation, for dew's own simulations only.

    The planner builds one per simulated completion from parts it made itself (a
    shared, already-checked call); validating each took a seventh of a plan. The
    fields are set exactly as the constructor would set them.
    """
    r = object.__new__(Rollout)
    object.__setattr__(
        r,
        "__dict__",
        {
            "key": key,
            "task": task,
            "status": status,
            "calls": calls,
            "reward": reward,
            "components": _EMPTY,
            "truncation": truncation,
            "error": None,
            "submitted": None,
            "finished": None,
            "_oldest": calls[0].version
            if len(calls) == 1
            else min((c.version for c in calls), default=None),
        },
    )
    return r


def _bad_call(key: RolloutKey, i: int, problem: str) -> ValueError:
    return ValueError(f"{key}: calls[{i}]{problem}")


def _check_call(call: Call, key: RolloutKey, i: int) -> None:
    # Error text is only built on failure: this runs for every finished rollout.
    if not isinstance(call, Call):
        raise _bad_call(key, i, f" must be a Call, got {type(call).__name__}")
    n = len(call.completion)
    if n == 0:
        raise _bad_call(key, i, ".completion is empty; a call produces at least one token")
    if len(call.prompt) == 0:
        raise _bad_call(key, i, ".prompt is empty")
    if len(call.log_probs) != n:
        raise _bad_call(
            key, i, f".log_probs has {len(call.log_probs)} entries but completion has {n} tokens"
        )
    version = call.version
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
        raise _bad_call(key, i, f".version must be an int, got {version!r}")
    if version < 0:
        raise _bad_call(key, i, f".version must be >= 0, got {version}")
    if not (call.temperature > 0 and math.isfinite(call.temperature)):
        raise _bad_call(key, i, f".temperature must be positive and finite, got {call.temperature}")
    if call.support is not None:
        if len(call.support) != n:
            raise _bad_call(
                key, i, f".support has {len(call.support)} rows but completion has {n} tokens"
            )
        for t, (tok, row) in enumerate(zip(call.completion, call.support, strict=True)):
            if len(row) == 0:
                raise _bad_call(key, i, f".support[{t}] is empty")
            if tok not in row:
                raise _bad_call(key, i, f".support[{t}] does not contain the sampled token {tok}")


# --------------------------------------------------------------------------- protocols


@runtime_checkable
class Session(Protocol):
    """Handle of one running rollout."""

    def cancel(self) -> None:
        """Ask the rollout to stop; returns at once and may be called any number of times."""

    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> Rollout:
        """Block until done; return the rollout or raise what the source raised."""

    def add_done_callback(self, fn: Callable[[Session], None]) -> None:
        """Call ``fn(session)`` once when done (at once if already done), from any thread."""


@runtime_checkable
class SessionSource(Protocol):
    """Where rollouts come from. ``start`` must not block."""

    def start(self, task: Task, key: RolloutKey) -> Session: ...


# --------------------------------------------------------------------------- ThreadedSource


def _cancelled_rollout(task: Task, key: RolloutKey, calls: Sequence[Call] = ()) -> Rollout:
    """The ``CANCELLED`` rollout of a session stopped on request (``calls``: what it
    had made by then, kept for inspection; a cancelled rollout is never scored)."""
    return Rollout(key=key, task=task, status=Status.CANCELLED, calls=calls, error="cancelled")


class _ThreadedSession:
    def __init__(self, task: Task, key: RolloutKey) -> None:
        self.task = task
        self.key = key
        self.stop = threading.Event()
        self.future: Future[Rollout] = Future()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[Session], None]] = []
        self._resolved = False
        self.settled = threading.Event()  # set once the callbacks have run

    def cancel(self) -> None:
        self.stop.set()
        # A session that has not begun running resolves now: nobody else will.
        if self.future.cancel():
            self._finish()

    def done(self) -> bool:
        return self._resolved

    def result(self, timeout: float | None = None) -> Rollout:
        try:
            return self.future.result(timeout)
        except CancelledError:
            return _cancelled_rollout(self.task, self.key)

    def add_done_callback(self, fn: Callable[[Session], None]) -> None:
        with self._lock:
            if not self._resolved:
                self._callbacks.append(fn)
                return
        fn(self)

    def _finish(self) -> None:
        with self._lock:
            if self._resolved:
                return
            self._resolved = True
            callbacks, self._callbacks = self._callbacks, []
        try:
            for fn in callbacks:
                fn(self)
        finally:
            self.settled.set()


class ThreadedSource:
    """Base for sources whose rollout is plain blocking Python.

    A subclass implements :meth:`run`; each session runs it on a bounded pool of
    ``workers`` threads. ``run`` receives a ``stop`` event that ``cancel()`` sets: it
    should check it between steps and hand it to the engine so generation aborts.
    A thread stuck inside a step cannot be reclaimed, so environments must bound
    their own step time.
    """

    def __init__(self, *, workers: int = 8) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=type(self).__name__)
        self._lock = threading.Lock()
        self._live: set[_ThreadedSession] = set()
        self._closed = False

    def run(self, task: Task, key: RolloutKey, stop: threading.Event) -> Rollout:
        raise NotImplementedError

    def start(self, task: Task, key: RolloutKey) -> Session:
        session = self._open(task, key)
        try:
            self._pool.submit(self._work, session)
        except RuntimeError:
            # The pool was shut down between the check and the submit (close() raced us).
            session.cancel()
            raise
        return session

    def _open(self, task: Task, key: RolloutKey) -> _ThreadedSession:
        """A new live session (forgotten once resolved); RuntimeError when closed."""
        session = _ThreadedSession(task, key)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{type(self).__name__} is closed")
            self._live.add(session)
        session.add_done_callback(self._forget)
        return session

    def _work(self, session: _ThreadedSession) -> None:
        if not session.future.set_running_or_notify_cancel():
            return  # cancel() already resolved it
        self._settle(session, lambda: self.run(session.task, session.key, session.stop))

    def _settle(self, session: _ThreadedSession, produce: Callable[[], Rollout]) -> None:
        """Resolve a running session with what ``produce`` returns or raises; a stop
        seen before or after it turns the outcome into ``CANCELLED``."""
        try:
            if session.stop.is_set():
                out = _cancelled_rollout(session.task, session.key)
            else:
                out = produce()
                if session.stop.is_set() and out.status is not Status.CANCELLED:
                    out = _cancelled_rollout(session.task, session.key, out.calls)
        except BaseException as exc:  # handed to result(); never swallowed
            session.future.set_exception(exc)
            session._finish()
            if not isinstance(exc, Exception):
                raise
            return
        session.future.set_result(out)
        session._finish()

    def _forget(self, session: Session) -> None:
        with self._lock:
            self._live.discard(session)  # type: ignore[arg-type]

    def close(self) -> None:
        """Stop every session, drop queued ones and join the worker threads."""
        with self._lock:
            self._closed = True
            live = list(self._live)
        for s in live:
            s.cancel()
        for s in live:  # running ones see their stop event; queued ones resolved in cancel()
            s.settled.wait()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> ThreadedSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- chains


@dataclass(frozen=True, eq=False)
class Chain:
    """A token sequence trained as one causal sequence.

    ``tokens`` [n]; ``trained`` [n] bool (completion tokens); ``log_probs`` [n] the
    behavior log-prob of each trained token (0 elsewhere); ``versions`` [n] the
    version of the call that produced or consumed each token; ``support`` holds, for
    each trained token in order, its support row (empty when the calls carry none).
    """

    tokens: np.ndarray
    trained: np.ndarray
    log_probs: np.ndarray
    versions: np.ndarray
    support: tuple[Sequence[int], ...]


class _Run(NamedTuple):
    """A stretch of one chain that came from one call, as one piece.

    ``tokens`` [n] int64; ``trained`` says whether they are completion tokens (then
    ``log_probs`` [n] holds their behavior log-probs and ``support`` their support
    rows, when the call carries any) or prompt tokens the call consumed (then both
    are None); ``version`` is the call's weights version.
    """

    tokens: np.ndarray
    trained: bool
    log_probs: np.ndarray | None
    version: int
    support: Sequence[Sequence[int]] | None


def _as_i64(x: Sequence[int]) -> np.ndarray:
    return np.asarray(x, dtype=np.int64).reshape(-1)


def _chain_runs(calls: Sequence[Call]) -> list[list[_Run]]:
    """Merge a rollout's calls into chains, each given as its runs in token order.

    Call k extends the current chain when its prompt starts with the chain's tokens
    so far; the prompt's extra tokens (observations, tool results, the next user
    turn) join the chain as an untrained run. Otherwise it opens a new chain.
    Comparison is token-exact: nothing is re-tokenized. Runs, not joined arrays, so
    that ``pack`` can write many chains with one concatenation per field.
    """
    if len(calls) == 1:  # the single-turn case, without the merge bookkeeping
        call = calls[0]
        lp = np.asarray(call.log_probs, dtype=np.float64).reshape(-1)
        return [
            [
                _Run(_as_i64(call.prompt), False, None, call.version, None),
                _Run(_as_i64(call.completion), True, lp, call.version, call.support),
            ]
        ]
    out: list[list[_Run]] = []
    runs: list[_Run] = []
    current: np.ndarray | None = None  # the open chain's tokens so far
    for call in calls:
        prompt = _as_i64(call.prompt)
        completion = _as_i64(call.completion)
        n = len(current) if current is not None else 0
        if current is not None and len(prompt) >= n and np.array_equal(prompt[:n], current):
            extra = prompt[n:]
        else:
            if runs:
                out.append(runs)
            runs, extra, current = [], prompt, np.empty(0, dtype=np.int64)
        if len(extra):
            runs.append(_Run(extra, False, None, call.version, None))
        lp = np.asarray(call.log_probs, dtype=np.float64).reshape(-1)
        runs.append(_Run(completion, True, lp, call.version, call.support))
        current = np.concatenate([current, extra, completion])
    if runs:
        out.append(runs)
    return out


def _trained_mask(runs: Sequence[_Run]) -> np.ndarray:
    """[n] bool over a chain's tokens: True on completion tokens."""
    return np.repeat(np.array([r.trained for r in runs], dtype=bool), [len(r.tokens) for r in runs])


def _join_runs(runs: Sequence[_Run]) -> Chain:
    """The :class:`Chain` made of ``runs`` (as :func:`_chain_runs` gives them)."""
    lengths = [len(r.tokens) for r in runs]
    flags = _trained_mask(runs)  # [n]
    log_probs = np.zeros(len(flags))  # [n]
    trained_lp = [r.log_probs for r in runs if r.log_probs is not None]
    if trained_lp:
        log_probs[flags] = np.concatenate(trained_lp)
    support: list[Sequence[int]] = []
    for r in runs:
        if r.support is not None:
            support.extend(r.support)
    return Chain(
        np.concatenate([r.tokens for r in runs]),
        flags,
        log_probs,
        np.repeat(np.asarray([r.version for r in runs], dtype=np.int64), lengths),
        tuple(support),
    )


def chains(calls: Sequence[Call]) -> list[Chain]:
    """Merge a rollout's calls into chains (see :func:`_chain_runs` for the rule)."""
    return [_join_runs(runs) for runs in _chain_runs(calls)]


def merge_ratio(rollouts: Sequence[Rollout]) -> float:
    """Merged calls over calls after each rollout's first (1.0 when nothing to merge)."""
    later = merged = 0
    for r in rollouts:
        if len(r.calls) > 1:
            later += len(r.calls) - 1
            merged += len(r.calls) - len(chains(r.calls))
    return merged / later if later else 1.0


# --------------------------------------------------------------------------- truncation


@dataclass(frozen=True)
class Truncation:
    """What a truncation policy makes of one TRUNCATED rollout.

    ``trained``: its tokens carry loss and it joins its group's baseline.
    ``reward``: the reward it trains on. ``resubmit``: a cause (``"unscored"``) when
    it cannot be admitted at all and must run again as a failed attempt.
    """

    trained: bool
    reward: float | None
    resubmit: str | None = None


def _mask(r: Rollout) -> Truncation:
    return Truncation(trained=False, reward=r.reward)


def _score(r: Rollout) -> Truncation:
    if r.reward is None:
        return Truncation(trained=False, reward=None, resubmit="unscored")
    return Truncation(trained=True, reward=r.reward)


def _zero(r: Rollout) -> Truncation:
    return Truncation(trained=True, reward=0.0)


# mask: agentic limits (context, turns, wall clock) say nothing about the policy's answer.
# score: single-turn RLVR, where the verifier can judge a cut answer.
# zero: a length penalty.
TRUNCATION_POLICIES: Mapping[str, Callable[[Rollout], Truncation]] = MappingProxyType(
    {"mask": _mask, "score": _score, "zero": _zero}
)


def truncation_policy(name: str) -> Callable[[Rollout], Truncation]:
    try:
        return TRUNCATION_POLICIES[name]
    except KeyError:
        raise ValueError(
            f"truncation={name!r} is not one of {sorted(TRUNCATION_POLICIES)}"
        ) from None


# --------------------------------------------------------------------------- metrics


def _percentiles(values: Sequence[float], prefix: str, out: dict[str, float]) -> None:
    if not values:
        return
    arr = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    out[f"{prefix}_p50"] = float(p50)
    out[f"{prefix}_p90"] = float(p90)
    out[f"{prefix}_p99"] = float(p99)
    out[f"{prefix}_max"] = float(arr.max())


def session_metrics(
    rollouts: Sequence[Rollout],
    batch: Mapping[str, np.ndarray] | None = None,
    *,
    updates: int | None = None,
) -> dict[str, float]:
    """Summary figures over admitted rollouts and, when given, their packed batch.

    Keys: ``merge_ratio``; ``status/<name>`` shares; ``reward/mean`` and
    ``reward/<component>``; ``latency_p50|p90|p99|max`` (submission to finish,
    seconds); from the batch: ``masked_share`` (share of real tokens not trained),
    ``token_lag_mean|max`` (``updates - version`` over trained tokens, when
    ``updates`` is given) and ``trained_tokens``.
    """
    out: dict[str, float] = {}
    n = len(rollouts)
    if n == 0:
        return out
    out["merge_ratio"] = merge_ratio(rollouts)
    for status in Status:
        out[f"status/{status.value}"] = sum(r.status is status for r in rollouts) / n
    rewards = [r.reward for r in rollouts if r.reward is not None]
    if rewards:
        out["reward/mean"] = float(np.mean(rewards))
    names = sorted({k for r in rollouts for k in r.components})
    for name in names:
        vals = [r.components[name] for r in rollouts if name in r.components]
        out[f"reward/{name}"] = float(np.mean(vals))
    lat = [
        r.finished - r.submitted
        for r in rollouts
        if r.finished is not None and r.submitted is not None
    ]
    _percentiles(lat, "latency", out)
    out["completion_tokens_mean"] = float(np.mean([r.completion_tokens for r in rollouts]))
    if batch is not None:
        mask = np.asarray(batch["loss_mask"]) > 0
        real = np.asarray(batch["segments"]) > 0
        versions = np.asarray(batch["versions"])
        out["trained_tokens"] = float(mask.sum())
        # Share of completion tokens that carry no loss (masked truncations).
        completion = real & (versions >= 0) & _completion_positions(batch)
        out["masked_share"] = float((completion & ~mask).sum() / max(completion.sum(), 1))
        if updates is not None and mask.any():
            lag = updates - versions[mask]
            out["token_lag_mean"] = float(lag.mean())
            out["token_lag_max"] = float(lag.max())
    return out


def _completion_positions(batch: Mapping[str, np.ndarray]) -> np.ndarray:
    # pack records which real tokens were sampled (completion) as opposed to prompt.
    if "completion_mask" in batch:
        return np.asarray(batch["completion_mask"]) > 0
    return np.asarray(batch["loss_mask"]) > 0
