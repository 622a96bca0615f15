"""The scheduler's driver thread: the one owner of admission and the session table.

:class:`Driver` runs the :class:`~dew.objectives.rl.admission.Admission` state machine
on a thread of its own. Every other thread (session done-callbacks, the trainer's
stream reads and calls, ``close``) only appends events to its inbox; the driver
handles them in order, carries out the resulting starts and cancels against the
source, and enforces deadlines whenever one passes, whether or not a call waits.
A session that resolves on the driver thread itself (inside the source's ``start`` or
``cancel``) is queued without the lock and handled as soon as the actions under way
have been carried out: with fast sources that is most of them, thousands a call.

A trainer call whose batch is already complete gets it before the rollouts the call
itself submits (the batches ``ahead``) are started: submitting a batch's rollouts to an
engine takes time the trainer would otherwise wait through, though its batch is ready.
The state machine's steps run in the same order either way; only the carrying out of
the call's actions moves after the hand-over.

A source whose ``start`` or ``result`` raises breaks the driver's work: everything in
flight is cancelled, the exception is kept as :attr:`Driver.failure`, and the trainer
call that waits (or, when none waits, the next one) fails with that exception itself.
A reopened stream clears it. The trainer-side half (weight pushes, packing,
rescoring, records) is :class:`dew.objectives.rl.scheduler.RolloutScheduler`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from functools import partial
from typing import Any

from dew.core import Rollout, RolloutKey, Session, SessionSource
from dew.objectives.rl.admission import Admission, Cancel, Consumed, Start

__all__ = ["Driver"]

_POLL = 0.05  # seconds between looks at a driver thread that may have died


@dataclass
class _Reply:
    """A trainer call waiting on the driver."""

    batch: Any
    updates: int
    future: Future[tuple[Consumed, dict[str, Any]]]


class Driver:
    """Owns the admission state machine, the session table and the thread driving them."""

    def __init__(self, admission: Admission, source: SessionSource) -> None:
        self._admission = admission
        self._source = source
        self._cond = threading.Condition()
        self._inbox: deque[tuple[Any, ...]] = deque()
        self._stopping = False
        # Driver-thread state.
        # Sessions in flight and when each was started, in two maps rather than a pair per
        # session: fewer objects in flight for the cyclic collector to walk.
        self._sessions: dict[RolloutKey, Session] = {}
        self._submitted: dict[RolloutKey, float] = {}
        self._failure: BaseException | None = None
        self._failure_raised = False  # whether a trainer call has raised _failure itself
        self._waiting: _Reply | None = None
        self._late_cancelled: list[Rollout] = []
        # Sessions resolved on the driver thread, as key, session, when, key, session, ...
        # (flat, not a tuple each, for the collector's sake); only that thread touches it.
        self._own: list[Any] = []
        self._ident: int | None = None  # the driver thread's, once it runs
        self._thread = threading.Thread(target=self._drive, name="dew-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread

    def post(self, *event: Any) -> None:
        """Queue an event for the driver thread."""
        with self._cond:
            self._inbox.append(event)
            self._cond.notify()

    def request(self, kind: str) -> None:
        """Post ``reopen`` or ``close`` and wait until the driver handled it."""
        done: Future[None] = Future()
        self.post(kind, done)
        # A driver that died of an error (it fails the waiting call first, then ends)
        # never answers: stop waiting once its thread is gone.
        while not wait([done], timeout=_POLL).done:
            if not self._thread.is_alive() and not done.done():
                return
        done.result()

    def call(self, batch: Any, updates: int) -> Future[tuple[Consumed, dict[str, Any]]]:
        """Hand over the trainer's ``batch`` at ``updates``; resolves once it is consumed.

        The result is the consumed groups and the record window's counts; it fails with
        the source's exception, or a ``RuntimeError`` saying why no batch can come.
        """
        reply = _Reply(batch, updates, Future())
        self.post("call", reply)
        return reply.future

    def stop(self) -> None:
        """Cancel everything in flight and join the thread (once)."""
        if self._thread.is_alive():
            self.request("close")
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    @property
    def in_flight(self) -> int:
        return self._admission.in_flight

    def _on_done(self, key: RolloutKey, session: Session) -> None:
        at = time.monotonic()
        if threading.get_ident() == self._ident:
            self._own += (key, session, at)  # drained by the loop before it waits
        else:
            self.post("finished", key, session, at)

    # ------------------------------------------------------------------ driver thread

    def _drive(self) -> None:
        self._ident = threading.get_ident()
        try:
            self._loop()
        except BaseException as exc:
            # Never leave a trainer waiting on a dead driver; then let it propagate.
            self._failure = self._failure or exc
            self._fail_waiting(exc)
            raise

    def _loop(self) -> None:
        adm = self._admission
        while True:
            with self._cond:
                # Finishes left in _own by the expiry or consumption below (a resubmission
                # or a cancel that resolved at once) are work too: never wait past them.
                while not self._inbox and not self._own and not self._stopping:
                    deadline = adm.next_deadline()
                    wait = None if deadline is None else deadline - time.monotonic()
                    if wait is not None and wait <= 0:
                        break
                    self._cond.wait(wait)
                if self._stopping and not self._inbox and not self._own:
                    return
                events = list(self._inbox)
                self._inbox.clear()
            for event in events:
                self._handle(event)
            self._drain_own()
            now = time.monotonic()
            if self._failure is None and not adm.closed:
                self._guard(lambda now=now: adm.expire(now))
            self._try_consume()

    def _handle(self, event: tuple[Any, ...]) -> None:
        adm = self._admission
        kind = event[0]
        if kind == "finished":
            self._finished(*event[1:])
        elif kind == "register":
            _, tasks, batch = event
            adm.register(tasks, batch)
        elif kind == "pushing":
            adm.pushing(event[1])
        elif kind == "pushed":
            adm.pushed(event[1])
        elif kind == "call":
            reply: _Reply = event[1]
            self._start_call(reply)
        elif kind == "reopen":
            done: Future[None] = event[1]
            self._fail_waiting(RuntimeError("the stream was reopened while a call waited"))
            self._execute(adm.reopen())
            self._failure = None
            self._failure_raised = False
            adm.reset_counts()
            done.set_result(None)
        elif kind == "close":
            done = event[1]
            self._fail_waiting(RuntimeError("the scheduler was closed while a call waited"))
            self._execute(adm.close())
            done.set_result(None)

    def _finished(self, key: RolloutKey, session: Session, at: float) -> None:
        if self._sessions.pop(key, None) is None:  # cancelled by us: the result is fenced off
            self._observe_late(session)
            return
        submitted = self._submitted.pop(key)
        if self._failure is not None:
            return
        # As _guard, without a closure per event: this runs once per rollout.
        try:
            rollout = _stamp(session.result(), submitted, at)
            actions = self._admission.finished(key, rollout, at)
            if actions:
                self._execute(actions)
        except Exception as exc:
            self._break(exc)

    def _drain_own(self) -> None:
        """Handle the sessions that resolved on this thread, and any that resolve meanwhile."""
        own = self._own
        i = 0
        while i < len(own):
            self._finished(own[i], own[i + 1], own[i + 2])
            i += 3
        own.clear()

    def _start_call(self, reply: _Reply) -> None:
        adm = self._admission
        failure = self._failure
        if failure is not None:
            if not self._failure_raised:
                # The source broke while no call waited: this call is the first to hear
                # of it, and raises the source's own exception, with where it came from.
                self._failure_raised = True
                failure.add_note(_BETWEEN_CALLS)
                reply.future.set_exception(failure)
                return
            err = RuntimeError(
                "the scheduler stopped after its source failed; reopen the stream to resume"
            )
            err.__cause__ = failure
            reply.future.set_exception(err)
            return
        if self._waiting is not None:
            reply.future.set_exception(RuntimeError("another trainer call is already waiting"))
            return
        oldest = adm.oldest()
        if oldest is None or oldest is not reply.batch:
            reply.future.set_exception(
                ValueError(
                    "the rollout was handed a batch that is not the oldest one registered by "
                    "scheduler.tasks(dataset).stream(); hand batches over in reading order"
                )
            )
            return
        self._waiting = reply
        try:
            held = adm.call(reply.updates, time.monotonic())
        except Exception as exc:
            self._break(exc)
            return
        # With rollouts ahead of the trainer its batch is often complete already: hand it
        # over before starting the call's new rollouts, which it need not wait for.
        self._try_consume(held)

    def _try_consume(self, held: Sequence[Start | Cancel] = ()) -> None:
        """Hand the waiting call its batch once it is complete. ``held``: actions the
        state machine gave just before (the call's), carried out after the hand-over
        and before the consume's own, in the order it gave them."""
        reply = self._waiting
        if reply is None:
            return
        if self._failure is not None:
            self._waiting = None
            self._failure_raised = True
            reply.future.set_exception(self._failure)
            return
        adm = self._admission
        try:
            consumed, actions = adm.consume(reply.updates, time.monotonic())
        except Exception as exc:
            self._break(exc)
            self._try_consume()
            return
        if consumed is not None:
            counts = {
                "resubmitted": dict(adm.resubmitted),
                "cancelled": adm.cancelled,
                "abandoned": adm.abandoned,
                "dropped_rollouts": list(adm.dropped_rollouts),
                "late_cancelled": self._late_cancelled,
            }
            self._late_cancelled = []
            adm.reset_counts()
            self._waiting = None
            reply.future.set_result((consumed, counts))
        self._guard(lambda: [*held, *actions] if held else actions)
        if self._failure is not None:
            self._try_consume()  # a start that raised fails the call still waiting

    def _guard(self, step: Callable[[], Sequence[Start | Cancel]]) -> None:
        """Run a state-machine step and its actions; a raising source stops everything."""
        try:
            self._execute(step())
        except Exception as exc:
            self._break(exc)

    def _execute(self, actions: Sequence[Start | Cancel]) -> None:
        sessions, submitted = self._sessions, self._submitted
        start, on_done, now = self._source.start, self._on_done, time.monotonic
        for action in actions:
            if isinstance(action, Start):
                key = action.key
                session = start(action.task, key)
                sessions[key] = session
                submitted[key] = now()
                session.add_done_callback(partial(on_done, key))
            else:
                session = sessions.pop(action.key, None)
                if session is not None:
                    del submitted[action.key]
                    session.cancel()

    def _break(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        for session in self._sessions.values():
            session.cancel()
        self._sessions.clear()
        self._submitted.clear()
        self._admission.reopen()  # forget the work; its sessions were cancelled above

    def _fail_waiting(self, exc: BaseException) -> None:
        if self._waiting is not None:
            self._waiting.future.set_exception(exc)
            self._waiting = None

    def _observe_late(self, session: Session) -> None:
        """A result of a rollout we cancelled: kept only for the length-bias figures."""
        try:
            r = session.result(0)
        except Exception:
            return
        if r.calls:
            self._late_cancelled.append(r)


_BETWEEN_CALLS = (
    "raised by the rollout source between trainer calls; the scheduler cancelled its work "
    "in flight. Reopen the task stream (scheduler.tasks(dataset).stream()) to resume."
)


def _stamp(rollout: Rollout, submitted: float, finished: float) -> Rollout:
    # The source handed this rollout over for good; the scheduler writes its timestamps
    # into it rather than copying (at thousands of rollouts a call, a copy is real time).
    object.__setattr__(rollout, "submitted", submitted)
    object.__setattr__(rollout, "finished", finished)
    return rollout
