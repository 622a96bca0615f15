"""RolloutScheduler: rollouts in flight ahead of the trainer, admitted as whole groups.

The policy lives in :mod:`dew.objectives.rl._admission` (a state machine with no
threads and no clock). This module is the thin driver around it: one owned thread
feeds it events and carries out its decisions against the source.

Concurrency invariants:

* Only the driver thread touches the state machine and the session table. Session
  done-callbacks (any thread), the trainer's stream reads and calls, and ``close()``
  only append to the inbox and wait for a reply.
* Weight pushes and rescoring run on the trainer's thread, inside its call: they use
  the trainer's model and, on a pool, meet the other processes there.
* Timeouts are enforced by the driver thread whenever a deadline passes, so a rollout
  is cancelled on time while the trainer trains, not only while it waits.
* A source whose ``start`` or ``result`` raises stops the scheduler: everything in
  flight is cancelled and the exception (its type, message and traceback) is raised
  from the trainer's call. Reopening the stream (a resume) clears that state.
* ``close()`` cancels everything in flight, fails a waiting call, and joins the
  driver thread. Closing the source is left to whoever created it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from dew.data import Batch, Dataset
from dew.objectives.rl._admission import Admission, Cancel, Consumed, Start
from dew.objectives.rl.pack import ESTIMATORS, pack
from dew.objectives.rl.sessions import (
    Rollout,
    RolloutKey,
    Session,
    SessionSource,
    Task,
    session_metrics,
    truncation_policy,
)

if TYPE_CHECKING:
    from dew.objectives.rl.grpo import GRPOObjective

__all__ = ["Publisher", "RolloutScheduler", "SchedulerRecord", "task_ids"]

Variables = Any  # the trainer's policy: a torch.nn.Module


@runtime_checkable
class Publisher(Protocol):
    """Serves the trainer's weights to the engines under a version number."""

    def load(self, variables: Variables, version: int) -> None: ...


@dataclass(frozen=True)
class SchedulerRecord:
    """The account of a single trainer call.

    ``version``/``lag``: the oldest call among the packed rollouts, and how many
    updates behind it was. ``groups``: complete groups packed into the batch.
    ``resubmitted``: resubmissions by cause (``infra_error``, ``cancelled``,
    ``stale``, ``timeout``, ``unscored``). ``cancelled``: running rollouts cancelled
    as surplus, stale, abandoned or dropped. ``abandoned``: groups given up after
    ``max_attempts``. ``cut``: complete groups that did not fit the rows. ``waited``:
    seconds the trainer blocked on rollouts. ``metrics``: session metrics over the
    packed rollouts plus length-bias figures.
    """

    updates: int
    version: int
    lag: int
    groups: int
    resubmitted: Mapping[str, int]
    cancelled: int
    abandoned: int
    cut: int
    waited: float
    metrics: Mapping[str, float] = field(default_factory=dict)


def task_ids(batch: Batch) -> list[Task]:
    """Turn a batch's integer ``task_id`` column into tasks whose ids are those numbers as text."""
    if "task_id" not in batch:
        raise ValueError(f"batch has no 'task_id' column (columns: {sorted(batch)})")
    ids = np.asarray(batch["task_id"])
    if ids.dtype.kind not in "iu":
        raise ValueError(f"batch['task_id'] must hold integers, got dtype {ids.dtype}")
    return [Task(id=str(int(i))) for i in ids.reshape(-1)]


@dataclass
class _Reply:
    """A trainer call waiting on the driver."""

    batch: Any
    updates: int
    future: Future[tuple[Consumed, dict[str, Any]]]
    started: bool = False


class RolloutScheduler:
    """The trainer's rollout: keeps ``source`` busy ``ahead`` batches in advance and returns
    packed batches built only from whole groups that are fresh enough.

    ``scheduler(model, batch, updates=n)`` returns
    the packed batch for batch ``n`` of ``scheduler.tasks(dataset).stream(...)``.
    The scheduler reference page has every rule; the module docstring of
    :mod:`dew.objectives.rl._admission` for the bookkeeping.
    """

    def __init__(
        self,
        objective: GRPOObjective,
        source: SessionSource,
        weights: Publisher,
        *,
        width: int,
        rows: int,
        tasks: Callable[[Batch], Sequence[Task]] = task_ids,
        groups: int = 4,
        oversample: int = 0,
        admit: int | None = None,
        max_lag: int = 1,
        ahead: int = 1,
        sync_every: int = 1,
        max_attempts: int = 3,
        timeout: float | None = None,
        estimator: str = "group",
        truncation: str = "mask",
        support_capacity: int | None = None,
        log: Callable[[SchedulerRecord], None] | None = None,
    ) -> None:
        _validate(
            width=width,
            rows=rows,
            groups=groups,
            oversample=oversample,
            admit=admit,
            max_lag=max_lag,
            ahead=ahead,
            sync_every=sync_every,
            max_attempts=max_attempts,
            timeout=timeout,
            estimator=estimator,
            truncation=truncation,
            support_capacity=support_capacity,
        )
        self.objective = objective
        self.source = source
        self.weights = weights
        self.width, self.rows = width, rows
        self.tasks_of = tasks
        self.groups, self.oversample, self.admit = groups, oversample, admit
        self.max_lag, self.ahead, self.sync_every = max_lag, ahead, sync_every
        self.max_attempts, self.timeout = max_attempts, timeout
        self.estimator, self.truncation = estimator, truncation
        self.support_capacity = support_capacity
        self.log = log
        self.history: list[SchedulerRecord] = []
        # Task ids of the last call by outcome: trained, abandoned, cut, dropped.
        self.last_tasks: dict[str, list[str]] = {}
        # Pool hooks, set by dew.pool; a single process leaves them as they are.
        # agree(failure) meets the other processes before rescoring and raises on every
        # process when any one failed; share(batch) hands a share's first reader's rows
        # to its later readers (they pass None); samples=False marks a later reader,
        # which starts nothing and logs nothing.
        self.agree: Callable[[BaseException | None], None] | None = None
        self.share: Callable[[Batch | None], Batch] | None = None
        self.samples = True

        self._admission = Admission(
            groups=groups,
            oversample=oversample,
            admit=admit,
            max_lag=max_lag,
            ahead=ahead,
            max_attempts=max_attempts,
            timeout=timeout,
            truncation=truncation,
        )
        self._served: int | None = None  # trainer-thread view of the pushed version
        self._closed = False
        self._cond = threading.Condition()
        self._inbox: deque[tuple[Any, ...]] = deque()
        self._stopping = False
        # Driver-thread state.
        self._sessions: dict[RolloutKey, tuple[Session, float]] = {}
        self._failure: BaseException | None = None
        self._waiting: _Reply | None = None
        self._late_cancelled: list[Rollout] = []
        self._thread = threading.Thread(target=self._drive, name="dew-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ trainer side

    def tasks(self, dataset: Dataset) -> Dataset:
        """Wrap ``dataset`` so that reading a batch from its stream also hands it to us.

        Each ``stream()`` call starts afresh: rollouts still running for an earlier
        stream are cancelled, which is what makes a resume from a checkpoint clean.
        """
        return dataset.observed(self._on_read, self._on_open)

    def _on_open(self) -> None:
        self._check_open()
        self._served = None  # the engines may serve anything: push on the next call
        self._request("reopen")

    def _on_read(self, batch: Batch) -> None:
        self._check_open()
        if not self.samples:
            return  # a share's later reader trains on the first reader's rows
        tasks = list(self.tasks_of(batch))
        self._post("register", tasks, batch)

    def __call__(self, variables: Variables, batch: Batch, *, updates: int) -> Batch:
        """Push weights if due, then wait for ``batch``'s groups and pack them."""
        self._check_open()
        if self._served is None or updates - self._served >= self.sync_every:
            self.weights.load(variables, updates)
            self._served = updates
            self._post("pushed", updates)
        if not self.samples:
            return self._follow(variables)
        t0 = time.monotonic()
        reply = _Reply(batch, updates, Future())
        self._post("call", reply)
        failure: BaseException | None = None
        try:
            consumed, counts = reply.future.result()
        except Exception as exc:
            failure = exc
        if self.agree is not None:
            self.agree(failure)  # on a pool: raises on every process if any one failed
        if failure is not None:
            raise failure
        waited = time.monotonic() - t0
        return self._finish_call(variables, updates, consumed, counts, waited)

    def _follow(self, variables: Variables) -> Batch:
        """A later reader of a share: agree, then train on the first reader's rows."""
        if self.agree is not None:
            self.agree(None)
        if self.share is None:
            raise RuntimeError("samples=False needs a share hook (see dew.pool)")
        out = self.share(None)
        self._rescore(variables, out)
        return out

    def _rescore(self, variables: Variables, out: Batch) -> None:
        import torch

        with torch.no_grad():
            proximal = self.objective.packed_log_probs(variables, out)
        out["proximal_log_probs"] = proximal.detach().float().cpu().numpy()

    def _finish_call(
        self,
        variables: Variables,
        updates: int,
        consumed: Consumed,
        counts: dict[str, Any],
        waited: float,
    ) -> Batch:
        out, stats = pack(
            consumed.groups,
            rows=self.rows,
            width=self.width,
            estimator=self.estimator,
            truncation=self.truncation,
            support_capacity=self.support_capacity,
        )
        if self.share is not None:
            out = self.share(out)  # the share's first reader hands its rows to the others
        self._rescore(variables, out)

        packed = [r for i in stats.packed for r in consumed.groups[i]]
        cut = [r for i in stats.cut for r in consumed.groups[i]]
        oldest = min((r.oldest_version for r in packed if r.calls), default=updates)
        metrics = session_metrics(packed, out, updates=updates)
        dropped: list[tuple[str, Rollout]] = counts["dropped_rollouts"]
        dropped += [("cut", r) for r in cut]
        metrics.update(_length_bias(packed, dropped, counts["late_cancelled"]))
        metrics["pack/padding_share"] = stats.padding_share
        metrics["tasks/abandoned"] = float(len(consumed.abandoned))
        metrics["tasks/dropped"] = float(len(consumed.dropped))
        record = SchedulerRecord(
            updates=updates,
            version=int(oldest),
            lag=int(updates - oldest),
            groups=len(stats.packed),
            resubmitted=dict(counts["resubmitted"]),
            cancelled=counts["cancelled"],
            abandoned=counts["abandoned"],
            cut=len(stats.cut),
            waited=waited,
            metrics=metrics,
        )
        self.last_tasks = {
            "trained": [consumed.groups[i][0].task.id for i in stats.packed],
            "cut": [consumed.groups[i][0].task.id for i in stats.cut],
            "abandoned": [t.id for t in consumed.abandoned],
            "dropped": [t.id for t in consumed.dropped],
        }
        self.history.append(record)
        if self.log is not None:
            self.log(record)
        return out

    def close(self) -> None:
        """Cancel every rollout in flight and stop the driver thread."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._request("close")
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()

    def __enter__(self) -> RolloutScheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the scheduler is closed")

    @property
    def in_flight(self) -> int:
        """Rollouts currently running (for monitoring; read without locking)."""
        return self._admission.in_flight

    # ------------------------------------------------------------------ inbox

    def _post(self, *event: Any) -> None:
        with self._cond:
            self._inbox.append(event)
            self._cond.notify()

    def _request(self, kind: str) -> None:
        """Post an event and wait until the driver handled it."""
        done: Future[None] = Future()
        self._post(kind, done)
        done.result()

    def _on_done(self, key: RolloutKey, session: Session) -> None:
        self._post("finished", key, session, time.monotonic())

    # ------------------------------------------------------------------ driver thread

    def _drive(self) -> None:
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
                while not self._inbox and not self._stopping:
                    deadline = adm.next_deadline()
                    wait = None if deadline is None else deadline - time.monotonic()
                    if wait is not None and wait <= 0:
                        break
                    self._cond.wait(wait)
                if self._stopping and not self._inbox:
                    return
                events = list(self._inbox)
                self._inbox.clear()
            for event in events:
                self._handle(event)
            now = time.monotonic()
            if self._failure is None and not adm.closed:
                self._guard(lambda now=now: adm.expire(now))
            self._try_consume()

    def _handle(self, event: tuple[Any, ...]) -> None:
        adm = self._admission
        kind = event[0]
        if kind == "finished":
            _, key, session, at = event
            entry = self._sessions.pop(key, None)
            if entry is None:  # cancelled by us: the result is fenced off
                self._observe_late(session)
                return
            if self._failure is not None:
                return
            submitted = entry[1]
            self._guard(lambda: adm.finished(key, _stamp(session.result(), submitted, at), at))
        elif kind == "register":
            _, tasks, batch = event
            adm.register(tasks, batch)
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
            adm.reset_counts()
            done.set_result(None)
        elif kind == "close":
            done = event[1]
            self._fail_waiting(RuntimeError("the scheduler was closed while a call waited"))
            self._execute(adm.close())
            done.set_result(None)

    def _start_call(self, reply: _Reply) -> None:
        adm = self._admission
        if self._failure is not None:
            err = RuntimeError(
                "the scheduler stopped after its source failed; reopen the stream to resume"
            )
            err.__cause__ = self._failure
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
        self._guard(lambda: adm.call(reply.updates, time.monotonic()))

    def _try_consume(self) -> None:
        reply = self._waiting
        if reply is None:
            return
        if self._failure is not None:
            self._waiting = None
            reply.future.set_exception(self._failure)
            return
        adm = self._admission
        result: list[Consumed | None] = [None]

        def consume() -> list[Start | Cancel]:
            result[0], actions = adm.consume(reply.updates, time.monotonic())
            return actions

        self._guard(consume)
        if self._failure is not None:
            self._try_consume()
            return
        if result[0] is not None:
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
            reply.future.set_result((result[0], counts))

    def _guard(self, step: Callable[[], Sequence[Start | Cancel]]) -> None:
        """Run a state-machine step and its actions; a raising source stops everything."""
        try:
            self._execute(step())
        except Exception as exc:
            self._break(exc)

    def _execute(self, actions: Sequence[Start | Cancel]) -> None:
        for action in actions:
            if isinstance(action, Start):
                session = self.source.start(action.task, action.key)
                self._sessions[action.key] = (session, time.monotonic())
                session.add_done_callback(lambda s, k=action.key: self._on_done(k, s))
            else:
                entry = self._sessions.pop(action.key, None)
                if entry is not None:
                    entry[0].cancel()

    def _break(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        for session, _ in self._sessions.values():
            session.cancel()
        self._sessions.clear()
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


def _stamp(rollout: Rollout, submitted: float, finished: float) -> Rollout:
    # The source handed this rollout over for good; the scheduler writes its timestamps
    # into it rather than copying (at thousands of rollouts a call, a copy is real time).
    object.__setattr__(rollout, "submitted", submitted)
    object.__setattr__(rollout, "finished", finished)
    return rollout


def _length_bias(
    admitted: Sequence[Rollout],
    dropped: Sequence[tuple[str, Rollout]],
    late_cancelled: Sequence[Rollout],
) -> dict[str, float]:
    """Mean completion length and reward of what trained against what was left out.

    Cut and stale rollouts finished, so their figures are exact. Rollouts cancelled
    as surplus or timed out report only what they produced before the cancel (a
    lower bound), and only when the source returns partial calls.
    """
    out: dict[str, float] = {}

    def put(name: str, rs: Sequence[Rollout]) -> None:
        if not rs:
            return
        out[f"bias/{name}_len"] = float(np.mean([r.completion_tokens for r in rs]))
        rewards = [r.reward for r in rs if r.reward is not None]
        if rewards:
            out[f"bias/{name}_reward"] = float(np.mean(rewards))

    put("admitted", admitted)
    for why in ("cut", "stale"):
        put(why, [r for w, r in dropped if w == why])
    put("cancelled_partial", late_cancelled)
    return out


def _validate(**p: Any) -> None:
    def need(ok: bool, name: str, rule: str) -> None:
        if not ok:
            raise ValueError(f"{name}={p[name]!r}: {rule}")

    for name in ("width", "rows", "groups", "max_attempts", "sync_every"):
        need(isinstance(p[name], int) and p[name] >= 1, name, "must be an int >= 1")
    for name in ("oversample", "ahead", "max_lag"):
        need(isinstance(p[name], int) and p[name] >= 0, name, "must be an int >= 0")
    need(
        p["admit"] is None or (isinstance(p["admit"], int) and p["admit"] >= 1),
        "admit",
        "must be None or an int >= 1",
    )
    need(p["timeout"] is None or p["timeout"] > 0, "timeout", "must be None or > 0 seconds")
    need(
        p["support_capacity"] is None or p["support_capacity"] >= 1,
        "support_capacity",
        "must be None or >= 1",
    )
    need(p["estimator"] in ESTIMATORS, "estimator", f"must be one of {sorted(ESTIMATORS)}")
    truncation_policy(p["truncation"])  # raises naming truncation
    floor = p["ahead"] + p["sync_every"] - 1
    if p["max_lag"] < floor:
        raise ValueError(
            f"max_lag={p['max_lag']} < ahead + sync_every - 1 = {floor}: a first submission can "
            f"already be {floor} updates stale when consumed"
        )
