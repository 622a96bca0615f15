"""The trainer loop: ``fit()`` reads task batches, gets rollouts, takes one update each.

``fit`` is the recipe of a run and reads top to bottom:

1. restore the latest checkpoint when resuming (model, optimizer, updates, data
   position, RNG states, record history) and cut ``records.jsonl`` back to it;
2. open the task stream at the saved position through ``rollout.tasks(dataset)`` (a
   scheduler registers each batch as it is read, and reopening cancels what an earlier
   stream left in flight, so it resubmits), behind a look-ahead reader at least the
   rollout's ``ahead`` deep;
3. per step: ``rollout(model, batch, updates=n)`` gives a packed batch,
   ``objective.loss(model, packed)`` a loss, one backward and one optimizer update;
4. a record per step (the rollout's account of the call, the loss metrics and the
   task ids by outcome) goes to ``records.jsonl``, TensorBoard when installed, and
   every ``log`` callback;
5. a checkpoint every ``checkpoint_every`` updates and at the end.

What ``fit`` reads of the rollout side is one protocol, :class:`TrainerRollout` (the
reference page calls it the trainer's Rollout, a different thing from the
:class:`dew.core.Rollout` record). A
:class:`~dew.objectives.rl.scheduler.RolloutScheduler` is one; a plain function
``rollout(model, batch, *, updates) -> packed`` is taken as a :class:`PlainRollout`
(nothing ahead, no history), which a class can also subclass for those defaults.

Who trains is chosen once, when ``fit`` starts: one process (its checkpoints are
:class:`dew._checkpoint.LocalCheckpoints`), or every process of a pool (sharded
checkpoints, each step's collectives guarded, and the stall check agreed).

Exactly once: a checkpoint holds the data position of the next batch and the record
history; a resume rewrites ``records.jsonl`` to that history and reads the stream
from that position again, so every task batch is trained by exactly one record of
the final file however often the process dies.

Not thread-based: the loop runs on the caller's thread; the scheduler owns its own.

The options of fit
------------------

``steps`` counts from the start of the run. ``run_dir`` (optional) receives
``records.jsonl``, ``checkpoints/`` and, when the ``tensorboard`` package is importable
and ``tensorboard`` is true, event files. ``resume`` is ``False``, ``True`` (the newest
valid checkpoint of ``run_dir``, or a fresh start if there is none) or a path (a run
folder or a checkpoint folder; refused with :class:`CheckpointError` if invalid).
``checkpoint_every`` updates a checkpoint is saved (None: only at the end); ``keep``
of them stay. ``prefetch`` is the look-ahead depth of the stream reader (default: the
rollout's ``ahead``, at least 1). ``log`` callbacks receive each step's record.
``config`` is stored as JSON in every checkpoint. ``max_grad_norm`` clips the
gradients' global norm (None: no clip).

``micro_batches``: split each packed batch by rows into this many parts, each run
forward and backward on its own, gradients summed before the one optimizer step (so a
step's rows need not fit in memory at once). The update equals the whole batch's to
float rounding: each part's loss is normalized by the whole batch's size
(``objective.loss(model, part, normalizer=rows * width)``). Metrics are the parts'
averages weighted by their trained tokens (``*_max``: the largest; ``*_tokens`` counts:
the sum).

``freeze_gc`` (off by default) freezes the heap alive after the first ten steps, so the
cyclic collector's full passes stop walking the model, optimizer and libraries and
stalling every thread while they do; it is undone when ``fit`` returns or raises. The
price: cycles among those objects that become garbage later wait until then. Its
measured effect is in bench/RESULTS.md ("garbage collector").

``max_empty_steps``: a step that trains no token (every group abandoned, cut, or
masked) is logged as a warning the first time, naming why; after this many such steps
in a row ``fit`` raises :class:`TrainingStalled` with the cause and the latest failed
attempts the rollout reported (``last_errors``). None: never stop. On a pool the
processes agree on it after every step: when one process reaches the bound, every
process raises, naming it.

``pool`` (a :class:`dew.pool.Pool`, with the model laid out by
:func:`dew.pool.shard_model`): every process of a ``torchrun`` job calls ``fit`` with the
same arguments and its own share of the data. Checkpoints are then the pool's sharded
ones (:class:`dew.pool.ShardedCheckpoints`: one folder in ``run_dir`` that every process
writes, valid only whole), resumed by every process together; rank 0 writes
``run_dir/records.jsonl`` and TensorBoard, rank ``r`` its records in
``run_dir/rank<r>/``. A process that dies inside a step makes every other one raise
:class:`dew.pool.PoolError` naming it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from dew import _checkpoint, _runlock
from dew._checkpoint import CheckpointError, Checkpoints, LocalCheckpoints
from dew._collector import FreezeAfter
from dew._sinks import JsonlSink, Sink, tensorboard_sink
from dew._step import backward, clip_grad_norm
from dew.data import Batch, Dataset, Prefetch

__all__ = [
    "CheckpointError",
    "FitResult",
    "PlainRollout",
    "TrainerRollout",
    "TrainingStalled",
    "fit",
    "latest_checkpoint",
    "read_records",
]

logger = logging.getLogger("dew.train")

# Training steps after which fit(freeze_gc=True) freezes the heap (dew._collector.FreezeAfter).
_FREEZE_AFTER = 10

Record = dict[str, Any]


class TrainingStalled(RuntimeError):
    """Too many steps in a row trained no token (see ``fit``'s ``max_empty_steps``)."""


@runtime_checkable
class TrainerRollout(Protocol):
    """Turns a task batch into a packed training batch for the current weights, and
    accounts for it.

    ``ahead``: task batches it works on before they are handed over (``fit``'s reader
    reads at least that far). ``tasks(dataset)``: the dataset whose stream ``fit``
    reads. ``history``: one record per call, oldest first (the newest is kept in the
    step's record as ``scheduler``). ``restore(records)``: a resume hands over the
    checkpoint's step records. ``last_tasks``: the last call's task ids by outcome
    (``trained``, ``abandoned``, ...). ``last_errors``: its latest failed attempts,
    ``"key: cause: error"``, kept in the step's record as ``errors``.

    One member is optional and not checked: ``last_profile``, a JSON-able mapping of the
    last call's profile (the scheduler's: :mod:`dew.objectives.rl.profile`), kept in the
    step's record as ``profile`` for ``dew plan --from-run``.
    """

    @property
    def ahead(self) -> int: ...

    @property
    def history(self) -> Sequence[Any]: ...

    @property
    def last_tasks(self) -> Mapping[str, Sequence[str]]: ...

    @property
    def last_errors(self) -> Sequence[str]: ...

    def tasks(self, dataset: Dataset) -> Dataset: ...

    def restore(self, records: Sequence[Record]) -> None: ...

    def __call__(self, variables: Any, batch: Batch, *, updates: int) -> Batch: ...


class PlainRollout:
    """A :class:`TrainerRollout` with nothing ahead and no history: a plain function
    ``call(model, batch, *, updates) -> packed`` wrapped, or a subclass's ``__call__``.
    Its step records name the batch's ``task_id`` rows as trained."""

    ahead = 0
    history: Sequence[Any] = ()
    last_errors: Sequence[str] = ()

    def __init__(self, call: Callable[..., Batch] | None = None) -> None:
        self._call = call

    @property
    def last_tasks(self) -> Mapping[str, Sequence[str]]:
        return {}

    def tasks(self, dataset: Dataset) -> Dataset:
        return dataset

    def restore(self, records: Sequence[Record]) -> None:
        return None

    def __call__(self, variables: Any, batch: Batch, *, updates: int) -> Batch:
        if self._call is None:
            raise NotImplementedError("PlainRollout: pass a function, or subclass it")
        return self._call(variables, batch, updates=updates)


@dataclass
class FitResult:
    """What a ``fit`` call ended with."""

    updates: int
    position: int
    records: list[Record] = field(default_factory=list)
    checkpoint: Path | None = None
    resumed_from: Path | None = None


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The newest checkpoint of ``run_dir`` that verifies (corrupt ones are skipped)."""
    return _checkpoint.latest(Path(run_dir) / "checkpoints")


def fit(
    model: Any,
    optimizer: Any,
    dataset: Dataset,
    rollout: TrainerRollout | Callable[..., Batch],
    objective: Any,
    *,
    steps: int,
    run_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int | None = 100,
    keep: int = 2,
    prefetch: int | None = None,
    resume: bool | str | os.PathLike[str] = False,
    log: Sequence[Callable[[Record], None]] = (),
    max_grad_norm: float | None = 1.0,
    tensorboard: bool = True,
    config: Mapping[str, Any] | None = None,
    freeze_gc: bool = False,
    micro_batches: int = 1,
    pool: Any = None,
    max_empty_steps: int | None = 5,
) -> FitResult:
    """Train until ``steps`` optimizer updates have been taken in total (a resumed call
    goes on to the same target); returns where it ended. Each option is described in
    this module's docstring, under "The options of fit"."""
    rollout = _as_rollout(rollout)
    prefetch = _checked(steps, checkpoint_every, prefetch, rollout.ahead, freeze_gc)
    _check_step_options(micro_batches, max_empty_steps, max_grad_norm)
    team = _processes(pool)
    run = None if run_dir is None else Path(run_dir)
    folder = None if run is None else run / "checkpoints"
    # One writer per run folder: a second process on it is refused, not run beside it.
    with _runlock.hold(run) if run is not None and team.rank == 0 else nullcontext():
        if resume is False and folder is not None and _checkpoint.checkpoints(folder):
            raise ValueError(
                f"run_dir={str(run)!r} already holds checkpoints: pass resume=True to continue "
                "it, or use a new run_dir"
            )
        # 1. Restore.
        result = _restore(run, resume, team, model, optimizer, rollout)
        updates, position, records = result.updates, result.position, result.records
        sinks = _open_sinks(run, team.rank, records, tensorboard and team.rank == 0, updates)

        def checkpoint() -> None:
            if folder is None:
                return
            result.checkpoint = team.checkpoints.save(
                folder,
                model=model,
                optimizer=optimizer,
                updates=updates,
                position=position,
                records=records,
                extra={"config": _jsonable(dict(config or {}))},
                keep=keep,
            )

        # Once the first steps have grown the long-lived heap, it may leave the collector's
        # generations: a full pass over it stalls every thread (see dew._collector).
        warm = FreezeAfter(_FREEZE_AFTER) if freeze_gc else None
        stalls = _Stalls(max_empty_steps)
        try:
            # 2. Open the stream where the checkpoint left it.
            reader: Iterator[Batch] = Prefetch(rollout.tasks(dataset).stream(position), prefetch)
            while updates < steps:
                # 3. One batch, one rollout call, one update.
                t0 = time.monotonic()
                batch = next(reader)
                seen = len(rollout.history)
                with team.collective("rollout call"):  # a pool's push and rescoring are collectives
                    packed = rollout(model, batch, updates=updates)
                t1 = time.monotonic()
                optimizer.zero_grad(set_to_none=True)
                with team.collective("training step"):  # a sharded model's gathers and reductions
                    loss, metrics = backward(objective, model, packed, micro_batches)
                    norm = None if max_grad_norm is None else clip_grad_norm(model, max_grad_norm)
                    optimizer.step()
                times = (t0, t1, time.monotonic())

                # 4. Record it.
                record = _record(updates, position, times, loss, metrics, norm, packed, batch)
                _account(record, rollout, seen, batch)
                updates, position = updates + 1, position + 1
                records.append(record)
                for sink in (*sinks, *log):
                    sink(record)
                result.updates, result.position = updates, position
                if warm is not None:
                    warm.step()
                stalled = team.agree(stalls.see(record, rollout.last_errors))
                if stalled is not None:
                    raise TrainingStalled(stalled)

                # 5. Checkpoint.
                if checkpoint_every is not None and updates % checkpoint_every == 0:
                    checkpoint()
            # The final state is always saved (unless it already is).
            last = result.checkpoint or result.resumed_from
            if folder is not None and (
                last is None
                or last.resolve() != (folder / _checkpoint.step_name(updates)).resolve()
            ):
                checkpoint()
            elif result.checkpoint is None:
                result.checkpoint = last
        finally:
            if warm is not None:
                warm.release()
            for sink in sinks:
                sink.close()
        return result


def _as_rollout(rollout: Any) -> TrainerRollout:
    """``rollout`` as the protocol: a plain function is wrapped; an object that has some
    of the protocol's members but not all is refused, naming what it lacks."""
    if isinstance(rollout, TrainerRollout):
        return rollout
    members = ("ahead", "history", "last_tasks", "last_errors", "tasks", "restore")
    has = [name for name in members if hasattr(rollout, name)]
    if has:
        lacks = [name for name in members if name not in has]
        raise TypeError(
            f"rollout: {type(rollout).__name__} has {', '.join(has)} but not "
            f"{', '.join(lacks)}: subclass dew.train.PlainRollout for their defaults"
        )
    return PlainRollout(rollout)


def _checked(
    steps: Any, checkpoint_every: Any, prefetch: int | None, ahead: int, freeze_gc: Any
) -> int:
    """The reader's depth, once the loop's own options are checked."""
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps={steps!r} must be an int >= 0")
    if checkpoint_every is not None and (
        not isinstance(checkpoint_every, int) or checkpoint_every < 1
    ):
        raise ValueError(f"checkpoint_every={checkpoint_every!r} must be None or an int >= 1")
    if prefetch is None:
        prefetch = max(1, int(ahead))
    if prefetch < ahead:
        raise ValueError(
            f"prefetch={prefetch} must be >= the rollout's ahead={ahead}: the "
            "scheduler can only work on batches the reader has already read"
        )
    if not isinstance(freeze_gc, bool):
        raise ValueError(f"freeze_gc={freeze_gc!r} must be True or False")
    return prefetch


def _check_step_options(micro_batches: Any, max_empty_steps: Any, max_grad_norm: Any) -> None:
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches!r} must be an int >= 1")
    if max_empty_steps is not None and (
        isinstance(max_empty_steps, bool)
        or not isinstance(max_empty_steps, int)
        or max_empty_steps < 1
    ):
        raise ValueError(f"max_empty_steps={max_empty_steps!r} must be None or an int >= 1")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm={max_grad_norm!r} must be None or > 0")


@dataclass(frozen=True)
class _Processes:
    """Who runs this ``fit``: one process, or every process of a pool."""

    rank: int
    checkpoints: Checkpoints
    collective: Callable[[str], AbstractContextManager[Any]]
    agree: Callable[[str | None], str | None]  # this process's stall -> the whole run's


def _processes(pool: Any) -> _Processes:
    """Chosen once per ``fit`` call, so the loop never asks which it is."""
    if pool is None:
        return _Processes(0, LocalCheckpoints(), lambda what: nullcontext(), lambda why: why)
    from dew.pool import ShardedCheckpoints

    return _Processes(
        pool.rank, ShardedCheckpoints(pool), pool.collective, partial(_agreed_stall, pool)
    )


def _agreed_stall(pool: Any, why: str | None) -> str | None:
    """Agreed, so that every process stops at the same step with the same error, not one
    alone while the others wait for it in the next round."""
    said = pool.exchange("stalled", why or "")
    return "; ".join(f"rank {r} of {pool.world}: {w}" for r, w in enumerate(said) if w) or None


def _restore(
    run: Path | None,
    resume: bool | str | os.PathLike[str],
    team: _Processes,
    model: Any,
    optimizer: Any,
    rollout: TrainerRollout,
) -> FitResult:
    """Where the run starts: the checkpoint ``resume`` names, loaded, or step 0."""
    source = _checkpoint.resume_path(run, resume, team.checkpoints)
    if source is None:
        return FitResult(updates=0, position=0)
    ckpt = team.checkpoints.load(source, model=model, optimizer=optimizer)
    folder = None if run is None else run / "checkpoints"
    if folder is not None and team.rank == 0 and source.parent.resolve() == folder.resolve():
        _checkpoint.set_aside_newer(folder, ckpt.updates)
    rollout.restore(ckpt.records)
    logger.info(
        "resumed from %s at update %d, data position %d", source, ckpt.updates, ckpt.position
    )
    return FitResult(ckpt.updates, ckpt.position, ckpt.records, resumed_from=source)


def _open_sinks(
    run: Path | None, rank: int, records: list[Record], tensorboard: bool, updates: int
) -> list[Sink]:
    """Where each record goes: this process's ``records.jsonl`` (rank ``r`` > 0: in
    ``rank<r>/``), and rank 0's TensorBoard events when asked for and installed."""
    if run is None:
        return []
    own = run if rank == 0 else run / f"rank{rank}"
    own.mkdir(parents=True, exist_ok=True)
    sinks: list[Sink] = [JsonlSink(own / "records.jsonl", records)]
    if tensorboard and (tb := tensorboard_sink(run / "tensorboard", resumed_at=updates)):
        sinks.append(tb)
    return sinks


def _record(
    updates: int,
    position: int,
    times: tuple[float, float, float],
    loss: float,
    metrics: Mapping[str, Any],
    grad_norm: float | None,
    packed: Batch,
    batch: Batch,
) -> Record:
    """The step's own record: its position, times, loss and metrics."""
    t0, t1, t2 = times
    record: Record = {
        "step": updates + 1,
        "position": position,
        "time": time.time(),
        "seconds": t2 - t0,
        "rollout_seconds": t1 - t0,
        "train_seconds": t2 - t1,
        "loss": loss,
        "metrics": {k: float(v) for k, v in metrics.items()},
    }
    if grad_norm is not None:
        record["grad_norm"] = grad_norm if math.isfinite(grad_norm) else str(grad_norm)
    if "loss_mask" in packed:
        record["trained_tokens"] = int(packed["loss_mask"].sum())
    return record


def _account(record: Record, rollout: TrainerRollout, seen: int, batch: Batch) -> None:
    """Add the rollout's account of the call: its newest history record, the task ids by
    outcome (the batch's rows as trained when it keeps none) and its failed attempts."""
    history = rollout.history
    if len(history) > seen:
        record["scheduler"] = _jsonable(history[-1])
        profile = getattr(rollout, "last_profile", None)  # optional: the planner's inputs
        if profile:
            record["profile"] = profile
    if rollout.last_tasks:
        record["tasks"] = {k: list(v) for k, v in rollout.last_tasks.items()}
    elif "task_id" in batch:
        record["tasks"] = {"trained": [str(int(i)) for i in batch["task_id"]]}
    if rollout.last_errors:  # each failed attempt's cause and message, not only a count
        record["errors"] = list(rollout.last_errors)


class _Stalls:
    """The steps in a row that trained no token: warned once, and past ``bound`` the
    message ``fit`` raises. Plain state, fed one record at a time."""

    def __init__(self, bound: int | None) -> None:
        self.bound = bound
        self.empty: list[int] = []  # their step numbers
        self.errors: list[str] = []  # the latest failed attempts over those steps
        self.warned = False

    def see(self, record: Record, errors: Sequence[str]) -> str | None:
        if record.get("trained_tokens", 1) != 0:
            self.empty, self.errors = [], []
            return None
        self.empty.append(record["step"])
        self.errors = (self.errors + list(errors))[-5:]
        if not self.warned:
            self.warned = True
            logger.warning("step %d trained no token: %s", record["step"], _empty_cause(record))
        if self.bound is None or len(self.empty) < self.bound:
            return None
        return (
            f"{len(self.empty)} steps in a row ({self.empty[0]}..{self.empty[-1]}) trained no "
            f"token: {_empty_cause(record)}; latest failed attempts: "
            + ("; ".join(self.errors) if self.errors else "none reported")
            + " (fit(max_empty_steps=None) trains on regardless)"
        )


def _empty_cause(record: Record) -> str:
    """Why a step trained no token, from its scheduler record, with the knob to turn."""
    scheduler = record.get("scheduler") or {}
    metrics = scheduler.get("metrics") or {}
    tasks = record.get("tasks") or {}
    if scheduler and scheduler.get("groups", 0) == 0:
        if tasks.get("abandoned"):  # this batch's groups, whenever they were given up
            return (
                f"every group was abandoned ({len(tasks['abandoned'])} after max_attempts "
                "failed attempts each): the source keeps failing"
            )
        if tasks.get("cut"):
            return "every complete group was cut: rows x width is too small for them"
        return "no group was admitted"
    if metrics.get("masked_share", 0.0) >= 1.0:
        return (
            "every rollout hit the length limit and truncation='mask' trains none of them: "
            "raise the sampling's max_tokens or use truncation='score'"
        )
    return "its packed batch holds no trained token"


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return value.item()
    return value


def read_records(run_dir: str | os.PathLike[str]) -> list[Record]:
    """The records of ``run_dir/records.jsonl`` (a torn last line is ignored)."""
    out = []
    path = Path(run_dir) / "records.jsonl"
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            break
    return out
