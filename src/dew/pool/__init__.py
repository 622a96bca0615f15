"""Multi-process training over ``torch.distributed``: the pool of a ``torchrun`` job.

Each process runs its own :class:`~dew.objectives.rl.scheduler.RolloutScheduler` over
its own share of the task stream and its own source, and packs its own rows; the
model lives on a ``data x tensor`` device mesh:

* :func:`init_pool` joins the job and lays out the mesh (``tensor=1`` by default);
* :func:`shard_model` shards the model with FSDP2 along data and splits its layers
  along tensor; ``fit(..., pool=pool)`` then trains it (FSDP2 reduces the gradients),
  checkpoints it as ``torch.distributed.checkpoint`` shards (:class:`ShardedCheckpoints`)
  and resumes it;
* :func:`attach` (or ``hooks=scheduler_hooks(pool)``) joins a scheduler to the pool:
  agreed weight pushes (whole tensors gathered for the engine), one agreement per
  call, and a share's rows read once along the tensor axis
  (:func:`first_reader_batch`);
* :func:`save_pretrained` gathers the whole model on one process for an export.

A failure anywhere (a source that raises, a process that dies or hangs) makes every
process raise :class:`PoolError` naming the process at fault, within bounded time. A
process that stops running is told from a slow one by its heartbeat, a side thread
each process runs (``init_pool(hang_timeout=30)``).
"""

from dew.pool._checkpoint import ShardedCheckpoints
from dew.pool._checkpoint import latest as latest_checkpoint
from dew.pool._hooks import AgreedPublisher, attach, first_reader_batch, scheduler_hooks
from dew.pool._pool import Pool, PoolError, init_pool
from dew.pool._shard import (
    full_state_dict,
    is_sharded,
    local_numel,
    optimizer_tensors,
    save_pretrained,
    shard_model,
)

__all__ = [
    "AgreedPublisher",
    "Pool",
    "PoolError",
    "ShardedCheckpoints",
    "attach",
    "first_reader_batch",
    "full_state_dict",
    "init_pool",
    "is_sharded",
    "latest_checkpoint",
    "local_numel",
    "optimizer_tensors",
    "save_pretrained",
    "scheduler_hooks",
    "shard_model",
]
