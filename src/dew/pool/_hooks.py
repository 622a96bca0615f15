"""The hooks that join a scheduler to a pool: agreement, shared rows, agreed pushes.

* The weight push goes through :class:`AgreedPublisher`: every process pushes at the
  same calls, they check that they push the same version, and a sharded model's whole
  tensors are gathered (a collective every process makes at that push) before the
  inner publisher gets them.
* The ``agree`` hook meets every process after admission and before rescoring (see
  :meth:`dew.pool.Pool.agree`).
* Along the tensor axis only a share's first reader samples; the others start
  nothing, log nothing, and receive its packed rows (:func:`first_reader_batch`).

Nothing here starts threads; everything runs on the trainer's thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from dew.data import Batch
from dew.pool._pool import Pool, PoolError
from dew.pool._shard import full_state_dict, is_sharded

if TYPE_CHECKING:
    from dew.objectives.rl.config import SchedulerHooks
    from dew.objectives.rl.scheduler import Publisher, RolloutScheduler

__all__ = ["AgreedPublisher", "attach", "first_reader_batch", "scheduler_hooks"]


class AgreedPublisher:
    """A publisher whose pushes the whole pool makes together, with the same version.

    Each ``load`` is an agreement round: every process must push the same version
    at the same call, else every process raises PoolError naming the disagreement.
    A model sharded on the pool's mesh reaches ``inner`` as its whole tensors.
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
        if _is_module(variables) and is_sharded(variables):
            with self.pool.collective("weight push"):
                variables = full_state_dict(variables)
        self.inner.load(variables, version)


def scheduler_hooks(pool: Pool) -> SchedulerHooks:
    """The hooks that join a scheduler to ``pool``: agreement, shared rows, agreed pushes.

    Hand them over with ``RolloutScheduler.from_config(..., hooks=scheduler_hooks(pool))``
    or :func:`attach`. A share's later reader (``pool.tensor > 1``) samples
    nothing and trains on its first reader's rows.
    """
    from dew.objectives.rl.config import SchedulerHooks

    def share(batch: Batch | None) -> Batch:
        return first_reader_batch(batch, pool)

    def agreed(inner: Publisher) -> Publisher:
        return AgreedPublisher(inner, pool)

    return SchedulerHooks(
        agree=pool.agree,
        share=share if pool.tensor > 1 else None,
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
    with pool.collective("first_reader_batch"):
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


def _is_module(value: Any) -> bool:
    import torch

    return isinstance(value, torch.nn.Module)
