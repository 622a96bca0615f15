"""Multi-process training pool over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

Each process of a ``torchrun`` job runs its own :class:`RolloutScheduler` over its own
share of the task stream and its own source, and packs its own rows. :func:`attach`
connects a scheduler to the pool by handing it one
:class:`~dew.objectives.rl.config.SchedulerHooks` (:func:`scheduler_hooks` builds it;
``RolloutScheduler.from_config(..., hooks=...)`` takes it at construction):

* the weight push goes through :class:`AgreedPublisher`: every process pushes at the
  same calls and they check that they push the same version;
* the ``agree`` hook meets the other processes after admission and before rescoring;
  if any process's admission failed, or one did not arrive in ``agree_timeout``
  seconds, every process raises :class:`PoolError` naming the rank and cause (a
  source's own exception and whatever it was raised from);
* with ``readers_per_share > 1`` (a tensor or sequence axis across processes, whose
  members must hold the same rows) only a share's first reader samples; the others
  start nothing, log nothing, and receive its packed rows (:func:`first_reader_batch`).

Layout: ranks ``s * readers_per_share ... (s + 1) * readers_per_share - 1`` read share
``s``; the first of them is its first reader. :meth:`Pool.dataset` gives a process the
dataset view of its share.

Gradients: :func:`average_gradients` registers hooks that average each parameter's
gradient over the pool as backward produces it, so an unmodified trainer loop
(``dew.train.fit``, which clips the gradient norm before stepping) sees the pool's
gradient; :func:`all_reduce_gradients` does the same once, for hand-written loops.
The objective divides by ``rows * width`` on every process, so the average is the
loss over the whole pool's batch. :func:`assert_synchronized` checks that every
process holds bit-identical parameters.

Invariants (concurrency and failure):

* Agreement never blocks in a collective: it is a store round with a deadline on
  ``time.monotonic()`` (see :mod:`dew._pool_store`). Collectives (the share
  broadcast, gradient averaging, the synchronization check) run only after a
  successful agreement in the same call. A process that dies after agreeing breaks
  the next collective (at once when its sockets close, else at the process group's
  ``timeout``); the survivors then meet in a bounded post-mortem round that names
  the missing process (:meth:`Pool.post_mortem`).
* Every process makes the same sequence of pool calls (push, agree, share), which
  the scheduler guarantees because pushes follow from ``updates`` and ``sync_every``
  and every call agrees exactly once.
* Nothing here starts threads; everything runs on the trainer's thread.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dew._pool_store import Missing, Rounds, StoreLost
from dew.data import Batch, Dataset

if TYPE_CHECKING:
    import torch

    from dew.objectives.rl.config import SchedulerHooks
    from dew.objectives.rl.scheduler import Publisher, RolloutScheduler

__all__ = [
    "AgreedPublisher",
    "Pool",
    "PoolError",
    "agreed_checkpoint",
    "all_reduce_gradients",
    "assert_synchronized",
    "attach",
    "average_gradients",
    "first_reader_batch",
    "init_pool",
    "scheduler_hooks",
]

_CAUSE_LIMIT = 2000  # characters of a failure's message carried to the other processes


class PoolError(RuntimeError):
    """A pool call failed on some process; raised on every process of the pool.

    ``ranks`` are the processes at fault (failed or missing), ``causes`` their
    failure text by rank (``"did not arrive ..."`` for a missing one).
    """

    def __init__(self, message: str, ranks: list[int], causes: dict[int, str]) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.causes = causes


@dataclass
class Pool:
    """One process's view of the pool: its rank, its share and the agreement rounds."""

    rank: int
    world: int
    readers_per_share: int
    agree_timeout: float
    rounds: Rounds
    timeout: float = 1800.0  # the process group's collective timeout, seconds
    backend: str = "gloo"
    share_group: Any = None  # process group of this rank's share (None: one reader)

    @property
    def shares(self) -> int:
        return self.world // self.readers_per_share

    @property
    def share(self) -> int:
        return self.rank // self.readers_per_share

    @property
    def reader(self) -> int:
        return self.rank % self.readers_per_share

    @property
    def first_reader(self) -> bool:
        return self.reader == 0

    @property
    def first_reader_rank(self) -> int:
        return self.share * self.readers_per_share

    @property
    def device(self) -> torch.device:
        import torch

        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def dataset(self, dataset: Dataset) -> Dataset:
        """``dataset`` as this process's share reads it (rows ``share::shares``)."""
        return dataset.share(self.share, self.shares)

    def exchange(self, tag: str, payload: str, *, timeout: float | None = None) -> list[str]:
        """One bounded agreement round: every rank's ``payload`` by rank.

        Raises PoolError naming the ranks that did not arrive within ``timeout``
        seconds (default ``agree_timeout``), or when the store is gone.
        """
        name = self.rounds.next_name(tag)
        bound = self.agree_timeout if timeout is None else timeout
        try:
            return self.rounds.exchange(tag, payload, bound)
        except Missing as exc:
            causes = {
                r: f"did not reach {name} within {bound:g} s (dead, hung or too slow)"
                for r in exc.ranks
            }
            late = " (this process arrived after the pool gave up on it)"
            raise PoolError(
                f"rank {self.rank}: pool round {name} failed: "
                + "; ".join(f"rank {r} of {self.world} {c}" for r, c in causes.items())
                + (late if self.rank in exc.ranks else ""),
                exc.ranks,
                causes,
            ) from None
        except StoreLost as exc:
            raise PoolError(
                f"rank {self.rank}: pool round {name} failed: the rendezvous store is "
                f"unreachable (its host process may be dead): {exc}",
                [],
                {},
            ) from exc

    def agree(self, failure: BaseException | None) -> None:
        """Meet every process; raise PoolError everywhere if any one passed a failure.

        The others see the failure's type and message, and those of every exception it
        was raised from.
        """
        payload = "ok" if failure is None else "fail " + _describe(failure)
        try:
            payloads = self.exchange("agree", payload)
        except PoolError as exc:
            raise exc from failure
        failed = {r: p[5:] for r, p in enumerate(payloads) if p != "ok"}
        if failed:
            raise PoolError(
                f"rank {self.rank}: the pool's call failed on "
                + "; ".join(f"rank {r} of {self.world}: {cause}" for r, cause in failed.items()),
                sorted(failed),
                failed,
            ) from failure

    def post_mortem(self, what: str, exc: BaseException) -> None:
        """After ``exc`` broke collective ``what``: name the processes that are gone.

        Every surviving process fails the same collective, so they all meet here. A
        survivor may still be blocked in the collective waiting on another survivor,
        not on the dead process, until the collective ``timeout``; so the round waits
        ``timeout + agree_timeout`` and names only the processes that never came.
        Always raises.
        """
        try:
            self.exchange("post-mortem", "alive", timeout=self.timeout + self.agree_timeout)
        except PoolError as named:
            raise PoolError(
                f"{named} (after the collective {what} failed: {_describe(exc)})",
                named.ranks,
                named.causes,
            ) from exc
        raise PoolError(
            f"rank {self.rank}: the collective {what} failed though every process is alive: "
            + _describe(exc),
            [],
            {},
        ) from exc

    def close(self) -> None:
        """Leave the process group (a local operation on gloo; safe after a failure).

        The group, and gloo's worker threads with it, are released here, while the
        interpreter is alive, unless other code still holds a reference to it.
        """
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _describe(exc: BaseException) -> str:
    """``Type: message`` of ``exc`` and of each exception it was raised from."""
    parts, seen = [], set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        parts.append(f"{type(current).__name__}: {current}")
        current = current.__cause__ or current.__context__
    text = " <- caused by ".join(parts)
    return text if len(text) <= _CAUSE_LIMIT else text[:_CAUSE_LIMIT] + "..."


@contextmanager
def _collective(pool: Pool, what: str) -> Iterator[None]:
    """Turn a failed collective into a PoolError naming the processes that are gone."""
    try:
        yield
    except PoolError:
        raise
    except Exception as exc:  # a peer died or timed out inside the collective
        # Leave the broken group first (nothing can use it any more); a peer blocked in
        # this collective on us may then fail sooner than the group's timeout.
        pool.close()
        pool.post_mortem(what, exc)


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ValueError(
            f"environment variable {name} is not set: start the processes with torchrun "
            "(or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)"
        )
    return int(value)


def init_pool(
    backend: str = "gloo",
    *,
    timeout: float = 1800.0,
    agree_timeout: float = 300.0,
    readers_per_share: int = 1,
) -> Pool:
    """Join the pool of a ``torchrun`` job (``env://``) and build its share layout.

    ``timeout`` bounds every collective (seconds, the process group's timeout);
    ``agree_timeout`` bounds each agreement round: how long the earliest process
    waits for the slowest one to finish its rollouts before naming it missing.
    ``readers_per_share`` processes read each share; the world size must be a
    multiple of it.
    """
    import torch.distributed as dist

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} must be 'gloo' or 'nccl'")
    for name, value in (("timeout", timeout), ("agree_timeout", agree_timeout)):
        if not (isinstance(value, (int, float)) and value > 0):
            raise ValueError(f"{name}={value!r} must be a positive number of seconds")
    if not (isinstance(readers_per_share, int) and readers_per_share >= 1):
        raise ValueError(f"readers_per_share={readers_per_share!r} must be an int >= 1")
    if dist.is_initialized():
        raise ValueError("torch.distributed is already initialized; init_pool sets it up itself")
    world = _env_int("WORLD_SIZE")
    if world % readers_per_share:
        raise ValueError(
            f"readers_per_share={readers_per_share} must divide the world size {world}"
        )
    # torch.distributed.nn binds the default group as a default argument when it is
    # first imported. Imported after the group exists (transformers imports it while
    # building a model), it keeps the group alive past destroy_process_group; gloo's
    # worker threads then outlive the interpreter, and one that releases a finished
    # collective's tensors during shutdown needs the GIL and aborts the process
    # ("terminate called without an active exception"). Imported first, it binds None.
    import torch.distributed.nn  # noqa: F401

    span = timedelta(seconds=timeout)
    store, rank, world = next(dist.rendezvous("env://", timeout=span))
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore("pg/", store),
        rank=rank,
        world_size=world,
        timeout=span,
    )
    share_group = None
    if readers_per_share > 1:
        # Every rank must create every group, in the same order.
        for first in range(0, world, readers_per_share):
            group = dist.new_group(list(range(first, first + readers_per_share)), timeout=span)
            if first <= rank < first + readers_per_share:
                share_group = group
    rounds = Rounds(dist.PrefixStore("dew.pool/", store), rank, world)
    return Pool(
        rank=rank,
        world=world,
        readers_per_share=readers_per_share,
        agree_timeout=float(agree_timeout),
        rounds=rounds,
        timeout=float(timeout),
        backend=backend,
        share_group=share_group,
    )


# --------------------------------------------------------------------------- scheduler hooks


class AgreedPublisher:
    """A publisher whose pushes the whole pool makes together, with the same version.

    Each ``load`` is an agreement round: every process must push the same version
    at the same call, else every process raises PoolError naming the disagreement.
    """

    def __init__(self, inner: Publisher, pool: Pool) -> None:
        self.inner = inner
        self.pool = pool
        self._rounds = 0  # pushes agreed so far, to name the one that disagrees

    def load(self, variables: Any, version: int) -> None:
        versions = [int(v) for v in self.pool.exchange("push", str(int(version)))]
        if len(set(versions)) != 1:
            causes = {r: f"pushes version {v}" for r, v in enumerate(versions)}
            odd = [r for r, v in enumerate(versions) if v != versions[0]]
            raise PoolError(
                f"rank {self.pool.rank}: the pool disagrees on push #{self._rounds}: "
                + ", ".join(f"rank {r} pushes version {v}" for r, v in enumerate(versions)),
                odd,
                causes,
            )
        self._rounds += 1
        self.inner.load(variables, version)


def scheduler_hooks(pool: Pool) -> SchedulerHooks:
    """The hooks that join a scheduler to ``pool``: agreement, shared rows, agreed pushes.

    Hand them over with ``RolloutScheduler.from_config(..., hooks=scheduler_hooks(pool))``
    or :func:`attach`. A share's later reader (``readers_per_share > 1``) samples
    nothing and trains on its first reader's rows.
    """
    from dew.objectives.rl.config import SchedulerHooks

    def share(batch: Batch | None) -> Batch:
        return first_reader_batch(batch, pool)

    def agreed(inner: Publisher) -> Publisher:
        return AgreedPublisher(inner, pool)

    return SchedulerHooks(
        agree=pool.agree,
        share=share if pool.readers_per_share > 1 else None,
        samples=pool.first_reader,
        publisher=agreed,
    )


def attach(scheduler: RolloutScheduler, pool: Pool) -> None:
    """Connect a scheduler built without hooks to the pool (:func:`scheduler_hooks`).

    Call it before opening the scheduler's task stream: the scheduler refuses hooks
    after that (``RolloutScheduler.connect``).
    """
    scheduler.connect(scheduler_hooks(pool))


def first_reader_batch(batch: Batch | None, pool: Pool) -> Batch:
    """The share's first reader's packed rows, on every reader of the share.

    The first reader passes its batch and gets it back; later readers pass None and
    receive a copy of it (a broadcast within the share's process group).
    """
    import torch
    import torch.distributed as dist

    if pool.first_reader != (batch is not None):
        want = "its packed batch" if pool.first_reader else "None"
        raise ValueError(
            f"batch: rank {pool.rank} is reader {pool.reader} of share {pool.share} and must "
            f"pass {want}"
        )
    if pool.share_group is None:
        assert batch is not None
        return batch
    src = pool.first_reader_rank
    meta: list[Any] = [None]
    if batch is not None:
        meta = [[(k, np.asarray(v).dtype.str, np.asarray(v).shape) for k, v in batch.items()]]
    out: Batch = {}
    with _collective(pool, "first_reader_batch"):
        dist.broadcast_object_list(meta, src=src, group=pool.share_group)
        for key, dtype, shape in meta[0]:
            if batch is not None:
                array = np.ascontiguousarray(batch[key])
                tensor = torch.from_numpy(array).to(pool.device)
            else:
                tensor = torch.from_numpy(np.empty(shape, dtype=np.dtype(dtype))).to(pool.device)
            dist.broadcast(tensor, src=src, group=pool.share_group)
            out[key] = tensor.cpu().numpy()
    return batch if batch is not None else out


# --------------------------------------------------------------------------- gradients, checks


def _params(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    return ((n, p) for n, p in model.named_parameters() if p.requires_grad)


def all_reduce_gradients(model: torch.nn.Module, pool: Pool) -> None:
    """Replace every parameter's gradient by its mean over the pool (one flat reduce).

    A missing gradient counts as zeros, so every process reduces the same shapes.
    """
    import torch
    import torch.distributed as dist

    params = [p for _, p in _params(model)]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    for group in by_dtype.values():
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in group]
        flat = torch.cat([g.reshape(-1) for g in grads]).to(pool.device)  # [total]
        with _collective(pool, "all_reduce_gradients"):
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= pool.world
        offset = 0
        for p in group:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).to(p.device)
            offset += n


class _Handles:
    """Removable gradient hooks (``remove()`` detaches them all)."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def average_gradients(model: torch.nn.Module, pool: Pool) -> _Handles:
    """Average each gradient over the pool as soon as backward has accumulated it.

    The hooks fire in the autograd engine's order, which is the same on every
    process for the same model and batch shape, so the collectives line up. Every
    trainable parameter must get a gradient on every backward (true for a causal LM
    over packed rows). Returns handles; ``remove()`` them to stop averaging.
    """
    import torch.distributed as dist

    def hook(p: torch.Tensor) -> None:
        assert p.grad is not None
        with _collective(pool, "average_gradients"):
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= pool.world

    return _Handles([p.register_post_accumulate_grad_hook(hook) for _, p in _params(model)])


def _digest(t: torch.Tensor) -> int:
    import torch

    raw = t.detach().cpu().contiguous().reshape(-1).view(dtype=torch.uint8)
    return int.from_bytes(hashlib.blake2b(raw.numpy().tobytes(), digest_size=8).digest(), "little")


def assert_synchronized(model: torch.nn.Module, pool: Pool) -> None:
    """Raise PoolError unless every process holds bit-identical parameters.

    A collective: every process must call it at the same point.
    """
    import torch
    import torch.distributed as dist

    names = [n for n, _ in model.named_parameters()]
    mine = torch.tensor(
        [_digest(p) - 2**63 for _, p in model.named_parameters()], dtype=torch.int64
    )  # [params], shifted into int64 range
    gathered = [torch.empty_like(mine) for _ in range(pool.world)]
    with _collective(pool, "assert_synchronized"):
        dist.all_gather(gathered, mine.to(pool.device))
    reference = gathered[0].cpu()
    odd = {}
    for r, g in enumerate(gathered):
        diff = (g.cpu() != reference).nonzero().reshape(-1)
        if len(diff):
            odd[r] = f"parameter {names[int(diff[0])]!r} differs from rank 0's"
    if odd:
        raise PoolError(
            f"rank {pool.rank}: model parameters are not synchronized: "
            + "; ".join(f"rank {r}: {c}" for r, c in odd.items()),
            sorted(odd),
            odd,
        )


# --------------------------------------------------------------------------- resume


def agreed_checkpoint(run_dir: str | os.PathLike[str], pool: Pool) -> Path | None:
    """The newest checkpoint of ``run_dir/checkpoints`` that every process also holds.

    Each process keeps its own run folder (its data position and RNG are its own).
    A process killed mid-step can leave the others one checkpoint ahead of it; the
    pool resumes from the newest update all of them saved (fit sets aside the newer
    ones). Returns None when no process has a checkpoint (a fresh start); raises
    PoolError when some have one but no update is common to all. An agreement round:
    every process must call it.
    """
    from dew import _checkpoint

    mine: dict[int, Path] = {}
    for path in _checkpoint.checkpoints(Path(run_dir) / "checkpoints"):
        try:
            _checkpoint.verify(path)
        except _checkpoint.CheckpointError:
            continue  # fit refuses it too; an older one may still be common
        updates = _checkpoint.step_of(path)
        assert updates is not None, "checkpoints() lists step folders only"
        mine[updates] = path
    everyone = [set(json.loads(p)) for p in pool.exchange("resume", json.dumps(sorted(mine)))]
    common = set.intersection(*everyone)
    if common:
        return mine[max(common)]
    if any(everyone):
        held = {r: sorted(u) for r, u in enumerate(everyone)}
        raise PoolError(
            f"rank {pool.rank}: no checkpoint is common to every process (updates held: {held})",
            [r for r, u in enumerate(everyone) if not u],
            {r: f"holds updates {u}" for r, u in held.items()},
        )
    return None
