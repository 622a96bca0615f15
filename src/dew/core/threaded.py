"""ThreadedSource: a source whose rollouts are plain blocking Python on a bounded pool.

Invariants:

* every session resolves exactly once: to what ``run`` returned, to the exception
  ``run`` raised (re-raised by ``result()`` with its traceback), or to a ``CANCELLED``
  rollout when ``cancel()`` came before ``run`` returned;
* each done-callback runs exactly once, after the session resolved, on whichever
  thread resolved it (or on the caller's thread when added after that);
* the worker pool is bounded by ``workers`` and owned by the source: ``close()`` sets
  every running session's stop event, drops queued ones, waits until every session it
  started has resolved (including sessions a subclass resolves off the pool, from an
  engine's future, through :meth:`ThreadedSource.begin` and
  :meth:`ThreadedSource.settle`) and joins the workers;
* ``close()`` is bounded: it waits at most ``stuck_after`` seconds for that. A session
  still running then is stuck in code that ignores its stop event, which no thread can
  end; close logs the keys of those it leaves (logger ``dew.core``, a warning) and
  returns. Worker threads are daemons, so a stuck one cannot keep the process from
  exiting.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from functools import partial

from dew.core._checks import as_int
from dew.core.sketch import LogHistogram
from dew.core.types import Rollout, RolloutKey, Session, Status, Task, cancelled_rollout

__all__ = ["ThreadedSession", "ThreadedSource"]

log = logging.getLogger("dew.core")


class ThreadedSession:
    """One rollout of a :class:`ThreadedSource`: its task, key and ``stop`` event."""

    def __init__(self, task: Task, key: RolloutKey) -> None:
        self.task = task
        self.key = key
        self.stop = threading.Event()
        self.stopped_at: float | None = None  # time.monotonic() of the first cancel()
        self.generated: float | None = None  # time.monotonic() the engine finished, if kept
        self._future: Future[Rollout] = Future()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[Session], None]] = []
        self._on_cancel: list[Callable[[], None]] | None = []  # None once cancelled
        self._resolved = False
        self._settled = threading.Event()  # set once the callbacks have run

    def cancel(self) -> None:
        with self._lock:
            if self.stopped_at is None:
                self.stopped_at = time.monotonic()
            hooks, self._on_cancel = self._on_cancel or [], None
        self.stop.set()
        # A session that has not begun running resolves now: nobody else will.
        if self._future.cancel():
            self._finish()
        for fn in hooks:
            fn()

    def on_cancel(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` on the first :meth:`cancel` (on the cancelling thread), or now
        when that came already: for a subclass that holds a session with no thread
        watching its stop event (say, a finished call waiting to be scored)."""
        with self._lock:
            if self._on_cancel is not None:
                self._on_cancel.append(fn)
                return
        fn()

    def done(self) -> bool:
        return self._resolved

    def result(self, timeout: float | None = None) -> Rollout:
        try:
            return self._future.result(timeout)
        except CancelledError:
            return cancelled_rollout(self.task, self.key)

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
            self._settled.set()


class ThreadedSource:
    """Base for sources whose rollout is plain blocking Python.

    A subclass implements :meth:`run`; each session runs it on a bounded pool of
    ``workers`` threads. ``run`` receives a ``stop`` event that ``cancel()`` sets: it
    should check it between steps and hand it to the engine so generation aborts.
    A thread stuck inside a step cannot be reclaimed, so environments must bound
    their own step time. A session still running ``stuck_after`` seconds after its
    cancel is listed by :meth:`stuck`; the scheduler reports them in its metrics and
    stops once every worker is stuck.

    A subclass that resolves sessions itself (say, from an engine's future, so that
    no thread waits on a generation) opens them with :meth:`begin` and resolves them
    with :meth:`settle` or :meth:`settle_on_pool`.

    ``outside`` is a :class:`~dew.core.LogHistogram` of the seconds rollouts spend
    outside the engine after each of their model calls (a tool or an environment step;
    after the last call, the verifier), for the run's profile; a subclass adds one value
    per call of a scored rollout.
    """

    def __init__(self, *, workers: int = 8, stuck_after: float = 10.0) -> None:
        workers = as_int(workers, "workers")
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if isinstance(stuck_after, bool) or not (
            isinstance(stuck_after, (int, float)) and stuck_after > 0
        ):
            raise ValueError(f"stuck_after must be > 0 seconds, got {stuck_after!r}")
        self.workers = workers
        self.stuck_after = float(stuck_after)
        self.outside = LogHistogram()
        self._pool = _Workers(workers, type(self).__name__)
        self._lock = threading.Lock()
        self._live: set[ThreadedSession] = set()
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

    def begin(self, task: Task, key: RolloutKey) -> ThreadedSession:
        """A new session that the subclass resolves itself, with :meth:`settle`.

        It is marked running, so ``cancel()`` only sets its stop event; whoever holds
        it must settle it. ``RuntimeError`` once the source is closed.
        """
        session = self._open(task, key)
        session._future.set_running_or_notify_cancel()
        return session

    def _open(self, task: Task, key: RolloutKey) -> ThreadedSession:
        """A new live session (forgotten once resolved); RuntimeError when closed."""
        session = ThreadedSession(task, key)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{type(self).__name__} is closed")
            self._live.add(session)
        session.add_done_callback(self._forget)
        return session

    def _work(self, session: ThreadedSession) -> None:
        if not session._future.set_running_or_notify_cancel():
            return  # cancel() already resolved it
        self.settle(session, lambda: self.run(session.task, session.key, session.stop))

    def settle(self, session: ThreadedSession, produce: Callable[[], Rollout]) -> None:
        """Resolve a running session with what ``produce`` returns or raises.

        A stop seen before or after ``produce`` turns the outcome into ``CANCELLED``.
        """
        try:
            if session.stop.is_set():
                out = cancelled_rollout(session.task, session.key)
            else:
                out = produce()
                if session.stop.is_set() and out.status is not Status.CANCELLED:
                    out = cancelled_rollout(session.task, session.key, out.calls)
        except BaseException as exc:  # handed to result(); never swallowed
            session._future.set_exception(exc)
            session._finish()
            if not isinstance(exc, Exception):
                raise
            return
        session._future.set_result(out)
        session._finish()

    def settle_on_pool(self, session: ThreadedSession, produce: Callable[[], Rollout]) -> None:
        """:meth:`settle` on a pool thread (for slow work such as a verifier); a source
        closed meanwhile resolves the session as cancelled instead."""
        try:
            self._pool.submit(self.settle, session, produce)
        except RuntimeError:  # close() shut the pool after stopping this session
            self.settle(session, lambda: cancelled_rollout(session.task, session.key))

    def stuck(self) -> list[RolloutKey]:
        """Rollouts still running ``stuck_after`` seconds after they were cancelled.

        Each holds a worker thread that nothing can reclaim (a ``run`` that ignores its
        stop event); once there are ``workers`` of them the source can make no progress.
        """
        now = time.monotonic()
        with self._lock:
            live = list(self._live)
        return sorted(
            (
                s.key
                for s in live
                if s.stopped_at is not None
                and now - s.stopped_at >= self.stuck_after
                and s._future.running()
            ),
            key=str,
        )

    def _forget(self, session: Session) -> None:
        with self._lock:
            self._live.discard(session)  # type: ignore[arg-type]

    def close(self) -> None:
        """Stop every session, drop queued ones and join the worker threads, waiting
        at most ``stuck_after`` seconds (see the module docstring)."""
        with self._lock:
            self._closed = True
            live = list(self._live)
        deadline = time.monotonic() + self.stuck_after
        for s in live:
            s.cancel()
        for s in live:  # running ones see their stop event; queued ones resolved in cancel()
            s._settled.wait(max(0.0, deadline - time.monotonic()))
        left = sorted((s.key for s in live if not s._settled.is_set()), key=str)
        self._pool.shutdown(deadline)
        if left:
            shown = ", ".join(str(k) for k in left[:5]) + (" ..." if len(left) > 5 else "")
            log.warning(
                "%s closed with %d rollouts still running %gs after their cancel (%s): "
                "their threads are left behind; their run() must return once its stop "
                "event is set",
                type(self).__name__,
                len(left),
                self.stuck_after,
                shown,
            )

    def __enter__(self) -> ThreadedSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Workers:
    """A bounded pool of daemon threads, started as work comes: a thread stuck in a
    session cannot keep the process from exiting, as an executor's would."""

    def __init__(self, size: int, name: str) -> None:
        self._size = size
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[Callable[[], object]] = deque()
        self._threads: set[threading.Thread] = set()
        self._idle = 0
        self._made = 0
        self._shut = False

    def submit(self, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` on a worker; RuntimeError after :meth:`shutdown`."""
        thread = None
        with self._cond:
            if self._shut:
                raise RuntimeError("cannot schedule new work after shutdown")
            self._queue.append(partial(fn, *args))
            if self._idle:
                self._cond.notify()
            elif len(self._threads) < self._size:
                self._made += 1
                thread = threading.Thread(
                    target=self._run, name=f"{self._name}_{self._made}", daemon=True
                )
                self._threads.add(thread)
        if thread is not None:  # outside the lock, which its first step takes
            thread.start()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._shut:
                        self._idle += 1
                        self._cond.wait()
                        self._idle -= 1
                    if not self._queue:
                        return
                    job = self._queue.popleft()
                job()
        finally:
            with self._cond:
                self._threads.discard(threading.current_thread())

    def shutdown(self, deadline: float) -> None:
        """Drop queued work and join the threads until ``deadline`` (monotonic)."""
        with self._cond:
            self._shut = True
            self._queue.clear()
            self._cond.notify_all()
            threads = list(self._threads)
        for thread in threads:
            # One not started yet (submit starts it just after its lock) finds no work.
            if thread.ident is not None and thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
