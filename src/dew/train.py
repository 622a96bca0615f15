"""The trainer loop: ``fit()`` reads task batches, gets rollouts, takes one update each.

``fit`` is one function on purpose; it reads top to bottom:

1. restore the latest checkpoint when resuming (model, optimizer, updates, data
   position, RNG states, record history) and cut ``records.jsonl`` back to it;
2. open the task stream at the saved position, through ``rollout.tasks(dataset)``
   when the rollout has one (the scheduler registers each batch as it is read, and
   reopening cancels what an earlier stream left in flight, so it resubmits), behind
   a look-ahead reader at least the rollout's ``ahead`` deep;
3. per step: ``rollout(model, batch, updates=n)`` gives a packed batch,
   ``objective.loss(model, packed)`` a loss, one backward and one optimizer update;
4. a record per step (the scheduler's record of the call, the loss metrics and the
   task ids by outcome) goes to ``records.jsonl``, TensorBoard when installed, and
   every ``log`` callback;
5. a checkpoint every ``checkpoint_every`` updates and at the end.

With ``freeze_gc=True`` the heap alive after the first ten steps is frozen for the
cyclic collector, and unfrozen when ``fit`` returns or raises (why, and what it
measured: :mod:`dew._collector` and bench/RESULTS.md). It is off by default: it
changes when garbage is collected for the whole process.

A *trainer rollout* (:class:`TrainerRollout`; the reference page calls it the trainer's
Rollout, a different thing from the :class:`dew.core.Rollout` record) is anything
callable as ``rollout(model, batch, *, updates) -> packed``:
a :class:`~dew.objectives.rl.scheduler.RolloutScheduler`, or a plain function.
Optional attributes make it richer: ``tasks(dataset)``, ``ahead``, ``history``
(a sequence of :class:`~dew.objectives.rl.scheduler.SchedulerRecord`, one per call),
``restore_history(records)`` (a resume hands it the checkpoint's), ``last_tasks``
(task ids of the last call by outcome) and ``last_errors`` (its latest failed attempts,
``"key: cause: error"``, kept in the step's record as ``errors``).

Exactly once: a checkpoint holds the data position of the next batch and the record
history; a resume rewrites ``records.jsonl`` to that history and reads the stream
from that position again, so every task batch is trained by exactly one record of
the final file however often the process dies.

Not thread-based: the loop runs on the caller's thread; the scheduler owns its own.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from dew import _checkpoint, _runlock
from dew._checkpoint import CheckpointError, step_of
from dew._collector import FreezeAfter
from dew._sinks import JsonlSink, Sink, tensorboard_sink
from dew.data import Batch, Dataset, Prefetch

__all__ = [
    "CheckpointError",
    "FitResult",
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


class TrainerRollout(Protocol):
    """Turns a task batch into a packed training batch for the current weights."""

    def __call__(self, variables: Any, batch: Batch, *, updates: int) -> Batch: ...


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


def _resume_path(
    run_dir: Path | None,
    resume: bool | str | os.PathLike[str],
    latest: Callable[[Path], Path | None],
    sharded: bool = False,
) -> Path | None:
    """Which checkpoint to restore: None for a fresh start. ``latest(checkpoints folder)``
    finds the newest valid one."""
    if resume is False:
        return None
    if resume is True:
        if run_dir is None:
            raise ValueError("resume=True needs run_dir (where the checkpoints are)")
        found = latest(run_dir / "checkpoints")
        if found is None and _checkpoint.checkpoints(run_dir / "checkpoints"):
            raise CheckpointError(_nothing_valid(run_dir / "checkpoints", sharded))
        return found  # None: nothing saved yet, start fresh
    path = Path(resume)
    if not path.exists():
        raise CheckpointError(f"resume={str(path)!r}: no such run or checkpoint folder")
    if (path / "checkpoints").is_dir():  # a run folder
        found = latest(path / "checkpoints")
        if found is None:
            raise CheckpointError(_nothing_valid(path / "checkpoints", sharded))
        return found
    if not (path / _checkpoint.MANIFEST).exists() and step_of(path) is None:
        raise CheckpointError(
            f"resume={str(path)!r}: holds no checkpoints/ folder and is not a checkpoint; "
            "nothing to resume (start a new run without resume to begin again)"
        )
    return path  # a checkpoint folder: verified (strictly) by load


def _nothing_valid(folder: Path, sharded: bool) -> str:
    """Why a resume from ``folder`` is refused: each checkpoint and what is wrong with it
    (a pool's sharded ones: their names; every process logged why)."""
    found = _checkpoint.checkpoints(folder)
    if not found:
        return f"{folder}: no checkpoint to resume (the folder is empty)"
    reasons = []
    for path in found:
        if sharded:
            reasons.append(f"{path.name} (the log says why)")
            continue
        try:
            _checkpoint.verify(path)
        except CheckpointError as exc:
            reasons.append(str(exc))
    return (
        f"{folder}: no valid checkpoint to resume; refused: " + "; ".join(reasons) + " "
        "(nothing was changed; start a new run to begin again)"
    )


def _restore_history(rollout: Any, records: Sequence[Record]) -> None:
    """Hand a rollout that keeps a history the checkpoint's scheduler records."""
    restore = getattr(rollout, "restore_history", None)
    if restore is None:
        return
    from dew.objectives.rl.scheduler import SchedulerRecord

    restore([SchedulerRecord(**r["scheduler"]) for r in records if "scheduler" in r])


def _history(rollout: Any) -> Sequence[Any]:
    """The rollout's records so far (read afresh: it may hand out a snapshot)."""
    history = getattr(rollout, "history", None)
    return history if isinstance(history, Sequence) else ()


def _set_aside_newer(folder: Path, updates: int) -> None:
    """Rename the checkpoints of ``folder`` newer than ``updates`` so pruning never keeps them."""
    for path in _checkpoint.checkpoints(folder):
        step = _checkpoint.step_of(path)
        if step is not None and step > updates:
            path.rename(path.with_name(f"refused-{path.name}-{int(time.time())}"))


def _backward(
    objective: Any, model: Any, packed: Batch, parts: int
) -> tuple[float, dict[str, float]]:
    """Forward and backward over ``packed`` in ``parts`` row slices (see ``fit``)."""
    if parts == 1:
        loss, metrics = objective.loss(model, packed)
        loss.backward()
        return float(loss.detach()), dict(metrics)
    rows, width = (int(n) for n in packed["loss_mask"].shape)
    total = 0.0
    weighted: dict[str, float] = {}
    tokens = float(packed["loss_mask"].sum())
    for start, stop in _slices(rows, parts):
        part = {k: v[start:stop] if _per_row(v, rows) else v for k, v in packed.items()}
        loss, metrics = objective.loss(model, part, normalizer=float(rows * width))
        loss.backward()
        total += float(loss.detach())
        share = float(part["loss_mask"].sum()) / tokens if tokens else 1.0 / parts
        for name, value in metrics.items():
            if name.endswith("_max"):
                weighted[name] = max(weighted.get(name, value), value)
            elif name.endswith("_tokens"):  # counts add up
                weighted[name] = weighted.get(name, 0.0) + float(value)
            else:
                weighted[name] = weighted.get(name, 0.0) + share * float(value)
    return total, weighted


def _clip_grad_norm(model: Any, max_norm: float) -> float:
    """Scale the gradients so their global 2-norm is at most ``max_norm``; returns the norm.

    As ``torch.nn.utils.clip_grad_norm_``, but for gradients on several device meshes
    too (a model split along a tensor axis holds DTensors on the 2-D mesh beside
    replicated ones on the data axis, which torch's version refuses to mix): the norm
    is taken per mesh, in parameter order (the same collectives on every process), and
    the parts are combined.
    """
    import torch
    from torch.distributed.tensor import DTensor

    groups: dict[int, list[torch.Tensor]] = {}  # id(mesh) (0: plain tensors) -> grads
    for p in model.parameters():
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(id(mesh) if mesh is not None else 0, []).append(p.grad)
    if not groups:
        return 0.0
    squares = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float().cpu() ** 2)
    total = torch.stack(squares).sum().sqrt()  # []
    coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    for grads in groups.values():
        torch._foreach_mul_(grads, coef)
    return float(total)


def _slices(rows: int, parts: int) -> list[tuple[int, int]]:
    edges = [round(i * rows / parts) for i in range(parts + 1)]
    return [(a, b) for a, b in itertools.pairwise(edges) if b > a]


def _per_row(value: Any, rows: int) -> bool:
    shape = getattr(value, "shape", ())
    return len(shape) >= 1 and int(shape[0]) == rows


def fit(
    model: Any,
    optimizer: Any,
    dataset: Dataset,
    rollout: TrainerRollout,
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
    """Train until ``steps`` optimizer updates have been taken in total.

    ``steps`` counts from the start of the run, so a resumed call goes on to the same
    target. ``run_dir`` (optional) receives ``records.jsonl``, ``checkpoints/`` and,
    when the ``tensorboard`` package is importable and ``tensorboard`` is true, event
    files. ``resume`` is ``False``, ``True`` (the newest valid checkpoint of
    ``run_dir``, or a fresh start if there is none) or a path (a run folder or a
    checkpoint folder; refused with :class:`CheckpointError` if invalid).
    ``prefetch`` is the look-ahead depth of the stream reader (default: the rollout's
    ``ahead``, at least 1). ``log`` callbacks receive each step's record.
    ``config`` is stored as JSON in every checkpoint.

    ``micro_batches``: split each packed batch by rows into this many parts, each run
    forward and backward on its own, gradients summed before the one optimizer step (so
    a step's rows need not fit in memory at once). The update equals the whole batch's
    to float rounding: each part's loss is normalized by the whole batch's size
    (``objective.loss(model, part, normalizer=rows * width)``). Metrics are the parts'
    averages weighted by their trained tokens (``*_max``: the largest; ``*_tokens``
    counts: the sum).

    ``freeze_gc`` (off by default) freezes the heap alive after the first ten steps,
    so the cyclic collector's full passes stop walking the model, optimizer and
    libraries and stalling every thread while they do; it is undone when ``fit``
    returns or raises. The price: cycles among those objects that become garbage
    later wait until then. Its measured effect is in bench/RESULTS.md ("garbage
    collector"); :mod:`dew._collector` has the mechanism.

    ``max_empty_steps``: a step that trains no token (every group abandoned, cut, or
    masked) is logged as a warning the first time, naming why; after this many such
    steps in a row ``fit`` raises :class:`TrainingStalled` with the cause and the
    latest failed attempts the rollout reported (``last_errors``). None: never stop.
    On a pool the processes agree on it after every step: when one process reaches
    the bound, every process raises, naming it.

    ``pool`` (a :class:`dew.pool.Pool`, with the model laid out by
    :func:`dew.pool.shard_model`): every process of a ``torchrun`` job calls ``fit``
    with the same arguments and its own share of the data. Checkpoints are then the
    pool's sharded ones (``torch.distributed.checkpoint``, one folder in ``run_dir``
    that every process writes, valid only whole), resumed by every process together;
    rank 0 writes ``run_dir/records.jsonl`` and TensorBoard, rank ``r`` its records
    in ``run_dir/rank<r>/``. A process that dies inside a step makes every other one
    raise :class:`dew.pool.PoolError` naming it.
    """

    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps={steps!r} must be an int >= 0")
    if checkpoint_every is not None and (
        not isinstance(checkpoint_every, int) or checkpoint_every < 1
    ):
        raise ValueError(f"checkpoint_every={checkpoint_every!r} must be None or an int >= 1")
    if prefetch is None:
        prefetch = max(1, int(getattr(rollout, "ahead", 0)))
    if prefetch < getattr(rollout, "ahead", 0):
        raise ValueError(
            f"prefetch={prefetch} must be >= the rollout's ahead={rollout.ahead}: the "
            "scheduler can only work on batches the reader has already read"
        )
    if not isinstance(freeze_gc, bool):
        raise ValueError(f"freeze_gc={freeze_gc!r} must be True or False")
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
    run = None if run_dir is None else Path(run_dir)
    folder = None if run is None else run / "checkpoints"
    rank = 0 if pool is None else pool.rank
    own = run if run is None or rank == 0 else run / f"rank{rank}"  # this process's records
    guard: Callable[[str], Any] = (lambda what: nullcontext()) if pool is None else pool.collective

    # One writer per run folder: a second process on it is refused, not run beside it.
    held = _runlock.hold(run) if run is not None and rank == 0 else nullcontext()
    with held:
        if resume is False and folder is not None and _checkpoint.checkpoints(folder):
            raise ValueError(
                f"run_dir={str(run)!r} already holds checkpoints: pass resume=True to continue "
                "it, or use a new run_dir"
            )

        # 1. Restore.
        updates, position, records = 0, 0, []
        if pool is None:
            source = _resume_path(run, resume, _checkpoint.latest)
        else:
            from dew.pool import _checkpoint as pool_checkpoints

            source = _resume_path(
                run, resume, lambda f: pool_checkpoints.latest(f, pool), sharded=True
            )
        if source is not None:
            if pool is None:
                ckpt = _checkpoint.load(source, model=model, optimizer=optimizer)
            else:
                ckpt = pool_checkpoints.load(source, model=model, optimizer=optimizer, pool=pool)
            same = folder is not None and source.parent.resolve() == folder.resolve()
            if same and rank == 0:
                assert folder is not None
                _set_aside_newer(folder, ckpt.updates)
            updates, position, records = ckpt.updates, ckpt.position, ckpt.records
            _restore_history(rollout, records)
            logger.info("resumed from %s at update %d, data position %d", source, updates, position)
        sinks: list[Sink] = []
        if run is not None and own is not None:
            own.mkdir(parents=True, exist_ok=True)
            sinks.append(JsonlSink(own / "records.jsonl", records))
            folder_tb = run / "tensorboard"
            if (
                tensorboard
                and rank == 0
                and (tb := tensorboard_sink(folder_tb, resumed_at=updates))
            ):
                sinks.append(tb)
        result = FitResult(updates=updates, position=position, records=records, resumed_from=source)

        def checkpoint() -> None:
            if folder is None:
                return
            save = _checkpoint.save if pool is None else partial(pool_checkpoints.save, pool=pool)
            result.checkpoint = save(
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
        empty: list[int] = []  # the steps in a row that trained no token
        errors: list[str] = []  # the latest failed attempts over those steps
        warned = False
        try:
            # 2. Open the stream where the checkpoint left it.
            tasks = rollout.tasks(dataset) if hasattr(rollout, "tasks") else dataset
            reader: Iterator[Batch] = Prefetch(tasks.stream(position), prefetch)
            while updates < steps:
                # 3. One batch, one rollout call, one update.
                t0 = time.monotonic()
                batch = next(reader)
                seen = len(_history(rollout))
                with guard("rollout call"):  # a pool's push and rescoring are collectives
                    packed = rollout(model, batch, updates=updates)
                t1 = time.monotonic()
                optimizer.zero_grad(set_to_none=True)
                with guard("training step"):  # a sharded model's gathers and reductions
                    loss, metrics = _backward(objective, model, packed, micro_batches)
                    grad_norm = None
                    if max_grad_norm is not None:
                        grad_norm = _clip_grad_norm(model, max_grad_norm)
                    optimizer.step()
                t2 = time.monotonic()

                # 4. Record it.
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
                history = _history(rollout)
                if len(history) > seen:
                    record["scheduler"] = _jsonable(history[-1])
                last_tasks = getattr(rollout, "last_tasks", None)
                if last_tasks:
                    record["tasks"] = {k: list(v) for k, v in last_tasks.items()}
                elif "task_id" in batch:
                    record["tasks"] = {"trained": [str(int(i)) for i in batch["task_id"]]}
                failed = list(getattr(rollout, "last_errors", ()))
                if failed:  # each failed attempt's cause and message, not only a count
                    record["errors"] = failed
                updates += 1
                position += 1
                records.append(record)
                for sink in sinks:
                    sink(record)
                for callback in log:
                    callback(record)
                result.updates, result.position = updates, position
                if warm is not None:
                    warm.step()
                if record.get("trained_tokens", 1) == 0:
                    empty.append(updates)
                    errors = (errors + list(getattr(rollout, "last_errors", ())))[-5:]
                    if not warned:
                        warned = True
                        logger.warning(
                            "step %d trained no token: %s", updates, _empty_cause(record)
                        )
                else:
                    empty, errors = [], []
                stalled = None
                if max_empty_steps is not None and len(empty) >= max_empty_steps:
                    stalled = (
                        f"{len(empty)} steps in a row ({empty[0]}..{empty[-1]}) trained no "
                        f"token: {_empty_cause(record)}; latest failed attempts: "
                        + ("; ".join(errors) if errors else "none reported")
                        + " (fit(max_empty_steps=None) trains on regardless)"
                    )
                if pool is not None:
                    # Agreed, so that every process stops at the same step with the same
                    # error, not one alone while the others wait for it in the next round.
                    said = pool.exchange("stalled", stalled or "")
                    stalled = (
                        "; ".join(
                            f"rank {r} of {pool.world}: {why}" for r, why in enumerate(said) if why
                        )
                        or None
                    )
                if stalled is not None:
                    raise TrainingStalled(stalled)

                # 5. Checkpoint.
                if checkpoint_every is not None and updates % checkpoint_every == 0:
                    checkpoint()
            # The final state is always saved (unless it already is).
            last = result.checkpoint or source
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
