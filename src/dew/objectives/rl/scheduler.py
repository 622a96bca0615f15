"""RolloutScheduler: rollouts in flight ahead of the trainer, admitted as whole groups.

The policy lives in :mod:`dew.objectives.rl.admission` (a state machine with no
threads and no clock), built from the scheduler's
:class:`~dew.objectives.rl.config.SchedulerConfig`. One owned thread
(:class:`dew.objectives.rl._driver.Driver`) feeds it events and carries out its
decisions against the source; this module is the trainer's side around it: weight
pushes, packing, rescoring and records.

Concurrency invariants:

* Only the driver thread touches the state machine and the session table. Session
  done-callbacks (any thread), the trainer's stream reads and calls, and ``close()``
  only append to the driver's inbox and wait for a reply.
* Weight pushes and rescoring run on the trainer's thread, inside its call: they use
  the trainer's model and, on a pool, meet the other processes there.
* Timeouts are enforced by the driver thread whenever a deadline passes, so a rollout
  is cancelled on time while the trainer trains, not only while it waits.
* A source whose ``start`` or ``result`` raises stops the scheduler: everything in
  flight is cancelled and the exception itself (its type, message and traceback) is
  raised from the trainer's call: the waiting one, or, when the source broke between
  calls, the next one, with a note saying so. Later calls raise a ``RuntimeError``
  chained to it until the stream is reopened (a resume), which clears that state.
  :attr:`RolloutScheduler.failure` reads it meanwhile.
* Pool hooks (:class:`~dew.objectives.rl.config.SchedulerHooks`) are fixed before the
  task stream first opens: given to :meth:`RolloutScheduler.from_config` or
  :meth:`RolloutScheduler.connect`, never set on a running scheduler.
* ``close()`` cancels everything in flight, fails a waiting call, and joins the
  driver thread. Closing the source is left to whoever created it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, overload

import numpy as np

from dew.core import Publisher, Rollout, SessionSource, Task
from dew.data import Batch, Dataset
from dew.objectives.rl._driver import Driver
from dew.objectives.rl.admission import Admission, Consumed
from dew.objectives.rl.config import (
    EstimatorChoice,
    SchedulerConfig,
    SchedulerHooks,
    TruncationChoice,
    check_shape,
)
from dew.objectives.rl.metrics import session_metrics
from dew.objectives.rl.pack import pack
from dew.objectives.rl.profile import StepProfiler

if TYPE_CHECKING:
    from dew.objectives.rl.grpo import GRPOObjective

__all__ = ["Publisher", "RolloutScheduler", "SchedulerRecord", "task_ids"]

Variables = Any  # the trainer's policy: a torch.nn.Module


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


_DEFAULT = SchedulerConfig()  # where the constructor's defaults come from
_NO_HOOKS = SchedulerHooks()
_RecordT = TypeVar("_RecordT")


def _with_advantages(
    groups: Sequence[Sequence[Rollout]], packed: Sequence[int], out: Batch
) -> list[tuple[Rollout, float]]:
    """The rollouts of the ``packed`` groups with the advantage pack gave each (0 for a
    member that trains nothing), read from the batch where their completions sit."""
    first = np.cumsum([0, *(len(g) for g in groups)])  # flat index of each group's first
    at = np.asarray(out["rollout_index"]).reshape(-1)  # [rows * width]
    where = np.asarray(out["completion_mask"]).reshape(-1).astype(bool) & (at >= 0)
    index, slot = np.unique(at[where], return_index=True)
    values = np.asarray(out["advantages"]).reshape(-1)[where][slot]
    advantage = dict(zip(index.tolist(), values.tolist(), strict=True))
    return [
        (rollout, float(advantage.get(int(first[g]) + i, 0.0)))
        for g in packed
        for i, rollout in enumerate(groups[g])
    ]


class SourceStuck(RuntimeError):
    """Every worker of the source is held by a rollout that ignored its cancel."""


def _check_stuck(source: Any, metrics: dict[str, float]) -> None:
    """Count the source's stuck rollouts into ``metrics`` (sources that can tell, such
    as a ThreadedSource, have ``stuck()``); raise once no worker is left to run one."""
    stuck = getattr(source, "stuck", None)
    if not callable(stuck):
        return
    keys = stuck()
    metrics["source/stuck"] = float(len(keys))
    workers = getattr(source, "workers", None)
    if keys and isinstance(workers, int) and len(keys) >= workers:
        shown = ", ".join(str(k) for k in keys[:5]) + (" ..." if len(keys) > 5 else "")
        raise SourceStuck(
            f"{type(source).__name__}: all {workers} worker threads are held by rollouts "
            f"that kept running after they were cancelled ({shown}); nothing can run any "
            "more. Their run() must return once its stop event is set"
        )


class _ReadOnly(Sequence[_RecordT]):
    """A live, read-only view of a list (no copy per read)."""

    __slots__ = ("_items",)

    def __init__(self, items: list[_RecordT]) -> None:
        self._items = items

    @overload
    def __getitem__(self, i: int) -> _RecordT: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[_RecordT]: ...
    def __getitem__(self, i: int | slice) -> _RecordT | Sequence[_RecordT]:
        return self._items[i]

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"history({self._items!r})"


class RolloutScheduler:
    """The trainer's rollout: keeps ``source`` busy ``ahead`` batches in advance and returns
    packed batches built only from whole groups that are fresh enough.

    ``scheduler(model, batch, updates=n)`` returns
    the packed batch for batch ``n`` of ``scheduler.tasks(dataset).stream(...)``.
    The scheduler reference page has every rule; the module docstring of
    :mod:`dew.objectives.rl.admission` for the bookkeeping.

    The keyword knobs build one :class:`~dew.objectives.rl.config.SchedulerConfig`
    (read back as :attr:`config`), which validates them; :meth:`from_config` takes a
    config built beforehand, and pool hooks with it.
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
        groups: int = _DEFAULT.groups,
        oversample: int = _DEFAULT.oversample,
        admit: int | None = _DEFAULT.admit,
        max_lag: int = _DEFAULT.max_lag,
        ahead: int = _DEFAULT.ahead,
        sync_every: int = _DEFAULT.sync_every,
        max_attempts: int = _DEFAULT.max_attempts,
        timeout: float | None = _DEFAULT.timeout,
        estimator: EstimatorChoice = _DEFAULT.estimator,
        truncation: TruncationChoice = _DEFAULT.truncation,
        support_capacity: int | None = _DEFAULT.support_capacity,
        log: Callable[[SchedulerRecord], None] | None = None,
    ) -> None:
        config = SchedulerConfig(
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
        width, rows = check_shape(width=width, rows=rows)
        self._config = config
        self._objective = objective
        self._source = source
        self._publisher = weights  # as given; the hooks may wrap it (see connect)
        self._width, self._rows = width, rows
        self._tasks_of = tasks
        self._log = log
        self._history: list[SchedulerRecord] = []
        self._history_view = _ReadOnly(self._history)
        # Task ids of the last call by outcome: trained, abandoned, cut, dropped.
        self.last_tasks: dict[str, list[str]] = {}
        # The latest failed attempts seen by the last call ("key: cause: error"), newest last.
        self.last_errors: list[str] = []
        # The last call's trained rollouts, each with its advantage (what a sample log shows).
        self.last_samples: list[tuple[Rollout, float]] = []
        # The last call's profile (a step record's ``profile``: lengths, time outside
        # the engine, engine iterations; see dew.objectives.rl.profile), None before.
        self.last_profile: dict[str, Any] | None = None
        self._profiler = StepProfiler(config, source)
        self._opened = False  # set when the task stream first opens: hooks are fixed then
        self._install(_NO_HOOKS)
        self._served: int | None = None  # trainer-thread view of the pushed version
        self._closed = False
        self._driver = Driver(Admission(config), source)

    @classmethod
    def from_config(
        cls,
        objective: GRPOObjective,
        source: SessionSource,
        weights: Publisher,
        config: SchedulerConfig,
        *,
        hooks: SchedulerHooks | None = None,
        **rest: Any,
    ) -> RolloutScheduler:
        """A scheduler with the knobs of ``config`` and, on a pool, its ``hooks``.

        ``rest`` are the constructor's other keyword arguments (``width`` and ``rows``,
        required; ``tasks``, ``log``); a knob given there as well is refused.
        ``hooks`` is how a pool joins the scheduler from the start (see
        :class:`~dew.objectives.rl.config.SchedulerHooks`): the constructor keeps the
        reference page's signature, so it takes none, and :meth:`connect` hands them
        to a scheduler built that way.
        """
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"config: expected a SchedulerConfig, got {type(config).__name__}")
        knobs = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        twice = sorted(set(knobs) & set(rest))
        if twice:
            raise TypeError(f"from_config: {', '.join(twice)} come from config, not as arguments")
        self = cls(objective, source, weights, **knobs, **rest)
        if hooks is not None:
            self.connect(hooks)
        return self

    def _install(self, hooks: SchedulerHooks) -> None:
        self._hooks = hooks
        wrap = hooks.publisher
        self._weights = self._publisher if wrap is None else wrap(self._publisher)

    def connect(self, hooks: SchedulerHooks) -> None:
        """Join a pool: take ``hooks`` in place of any given before.

        Only before the task stream first opens: a share's later reader must never
        have registered a batch, and every process must push through the same
        publisher from the first call. Refused with ``RuntimeError`` after that. A
        publisher hook wraps the publisher this scheduler was built with, so
        connecting twice does not wrap it twice.
        """
        self._check_open()
        if self._opened:
            raise RuntimeError(
                "connect: the task stream has already opened; hand the scheduler its hooks "
                "before scheduler.tasks(dataset).stream() is first read"
            )
        if not isinstance(hooks, SchedulerHooks):
            raise TypeError(f"hooks: expected SchedulerHooks, got {type(hooks).__name__}")
        self._install(hooks)

    @property
    def config(self) -> SchedulerConfig:
        """The scheduling knobs this scheduler runs with (frozen)."""
        return self._config

    @property
    def ahead(self) -> int:
        """Task batches submitted before they are handed over (``config.ahead``).

        ``dew.train.fit`` reads it to size its look-ahead reader.
        """
        return self._config.ahead

    @property
    def hooks(self) -> SchedulerHooks:
        """The pool hooks in use (all empty on a single process)."""
        return self._hooks

    @property
    def weights(self) -> Publisher:
        """The publisher pushes go through (wrapped by the pool's hook, if any)."""
        return self._weights

    @property
    def history(self) -> Sequence[SchedulerRecord]:
        """Every call's record, oldest first: a read-only live view."""
        return self._history_view

    def restore_history(self, records: Iterable[SchedulerRecord]) -> None:
        """Replace the history by ``records`` (a resume restores a checkpoint's)."""
        restored = list(records)
        for r in restored:
            if not isinstance(r, SchedulerRecord):
                raise TypeError(f"records: expected SchedulerRecord, got {type(r).__name__}")
        self._history[:] = restored

    def restore(self, records: Sequence[Mapping[str, Any]]) -> None:
        """A resume's hand-over (``dew.train.fit``): the history becomes the scheduler
        records kept in the checkpoint's step records (their ``"scheduler"`` entries)."""
        self.restore_history(SchedulerRecord(**r["scheduler"]) for r in records if "scheduler" in r)

    @property
    def failure(self) -> BaseException | None:
        """What the source raised, once it broke; None while it works.

        Set from the driver thread when a source's ``start`` or ``result`` raises;
        cleared when the task stream is reopened.
        """
        return self._driver.failure

    # ------------------------------------------------------------------ trainer side

    def tasks(self, dataset: Dataset) -> Dataset:
        """Wrap ``dataset`` so that reading a batch from its stream also hands it to us.

        Each ``stream()`` call starts afresh: rollouts still running for an earlier
        stream are cancelled, which is what makes a resume from a checkpoint clean.
        """
        return dataset.observed(self._on_read, self._on_open)

    def _on_open(self) -> None:
        self._check_open()
        self._opened = True
        self._served = None  # the engines may serve anything: push on the next call
        self._driver.request("reopen")

    def _on_read(self, batch: Batch) -> None:
        self._check_open()
        if not self._hooks.samples:
            return  # a share's later reader trains on the first reader's rows
        tasks = list(self._tasks_of(batch))
        self._driver.post("register", tasks, batch)

    def __call__(self, variables: Variables, batch: Batch, *, updates: int) -> Batch:
        """Push weights if due, then wait for ``batch``'s groups and pack them."""
        self._check_open()
        if self._served is None or updates - self._served >= self._config.sync_every:
            # Announced first: an engine (one of a fleet) may finish a call under the new
            # weights before load returns, and that call is not from the future.
            self._driver.post("pushing", updates)
            self._weights.load(variables, updates)
            self._served = updates
            self._driver.post("pushed", updates)
        hooks = self._hooks
        if not hooks.samples:
            return self._follow(variables)
        self._profiler.wait_begins()
        t0 = time.monotonic()
        future = self._driver.call(batch, updates)
        failure: BaseException | None = None
        try:
            consumed, counts = future.result()
        except Exception as exc:
            failure = exc
        self._profiler.wait_ends()
        if hooks.agree is not None:
            hooks.agree(failure)  # on a pool: raises on every process if any one failed
        if failure is not None:
            raise failure
        waited = time.monotonic() - t0
        return self._finish_call(variables, updates, consumed, counts, waited)

    def _follow(self, variables: Variables) -> Batch:
        """A later reader of a share: agree, then train on the first reader's rows."""
        hooks = self._hooks
        if hooks.agree is not None:
            hooks.agree(None)
        assert hooks.share is not None, "SchedulerHooks refuses samples=False without share"
        out = hooks.share(None)
        self._rescore(variables, out)
        return out

    def _rescore(self, variables: Variables, out: Batch) -> None:
        fill = getattr(self._objective, "fill_proximal", None)
        if fill is not None:  # a GRPOObjective: rescores, or leaves it to the loss's forward
            fill(variables, out)
            return
        import torch

        with torch.no_grad():  # any other objective with a packed scorer
            proximal = self._objective.packed_log_probs(variables, out)
        out["proximal_log_probs"] = proximal.detach().float().cpu().numpy()

    def _finish_call(
        self,
        variables: Variables,
        updates: int,
        consumed: Consumed,
        counts: dict[str, Any],
        waited: float,
    ) -> Batch:
        config = self._config
        out, stats = pack(
            consumed.groups,
            rows=self._rows,
            width=self._width,
            estimator=config.estimator,
            truncation=config.truncation,
            support_capacity=config.support_capacity,
        )
        share = self._hooks.share
        if share is not None:
            out = share(out)  # the share's first reader hands its rows to the others
        self._rescore(variables, out)

        packed = [r for i in stats.packed for r in consumed.groups[i]]
        cut = [r for i in stats.cut for r in consumed.groups[i]]
        oldest = min((r.oldest_version for r in packed if r.calls), default=updates)
        metrics = session_metrics(packed, out, updates=updates)
        dropped: list[tuple[str, Rollout]] = counts["dropped_rollouts"]
        dropped += [("cut", r) for r in cut]
        metrics.update(_length_bias(packed, dropped, counts["late_cancelled"], metrics))
        metrics["pack/padding_share"] = stats.padding_share
        metrics["tasks/abandoned"] = float(len(consumed.abandoned))
        _check_stuck(self._source, metrics)
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
        stale = [r for why, r in dropped if why == "stale"]
        self.last_profile = self._profiler.step(consumed.groups, stale, counts["late_cancelled"])
        self.last_errors = list(consumed.errors)
        self.last_samples = _with_advantages(consumed.groups, stats.packed, out)
        self.last_tasks = {
            "trained": [consumed.groups[i][0].task.id for i in stats.packed],
            "cut": [consumed.groups[i][0].task.id for i in stats.cut],
            "abandoned": [t.id for t in consumed.abandoned],
            "dropped": [t.id for t in consumed.dropped],
        }
        self._history.append(record)
        if self._log is not None:
            self._log(record)
        return out

    def close(self) -> None:
        """Cancel every rollout in flight and stop the driver thread."""
        if self._closed:
            return
        self._closed = True
        self._driver.stop()

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
        return self._driver.in_flight


def _length_bias(
    admitted: Sequence[Rollout],
    dropped: Sequence[tuple[str, Rollout]],
    late_cancelled: Sequence[Rollout],
    metrics: Mapping[str, float],
) -> dict[str, float]:
    """Mean completion length and reward of what trained against what was left out.

    Cut and stale rollouts finished, so their figures are exact. Rollouts cancelled
    as surplus or timed out report only what they produced before the cancel (a
    lower bound), and only when the source returns partial calls. ``metrics`` are
    :func:`session_metrics` of ``admitted``: the admitted figures are its mean
    completion length and reward (the same means over the same rollouts), read rather
    than computed again over every rollout of the call.
    """
    out: dict[str, float] = {}

    def put(name: str, rs: Sequence[Rollout]) -> None:
        if not rs:
            return
        out[f"bias/{name}_len"] = float(np.mean([r.completion_tokens for r in rs]))
        rewards = [r.reward for r in rs if r.reward is not None]
        if rewards:
            out[f"bias/{name}_reward"] = float(np.mean(rewards))

    if admitted:
        out["bias/admitted_len"] = metrics["completion_tokens_mean"]
        if "reward/mean" in metrics:
            out["bias/admitted_reward"] = metrics["reward/mean"]
    for why in ("cut", "stale"):
        put(why, [r for w, r in dropped if w == why])
    put("cancelled_partial", late_cancelled)
    return out
