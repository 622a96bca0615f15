"""One process's place in a multi-process pool: rank, mesh, share, agreement rounds.

A pool is the processes of one ``torchrun`` job laid out on a two-axis device mesh,
``data x tensor`` (``torch.distributed.device_mesh``; rank ``d * tensor + t``):

* along **data** the model and optimizer are sharded by FSDP2 and every process reads
  its own share of each task batch (share ``d``);
* along **tensor** (optional, ``tensor=1`` by default) each layer's projections are
  split across processes; the processes of one share must hold the same rows, so only
  the share's first reader (``t == 0``) samples and the others receive its packed rows.

Invariants (concurrency and failure):

* Agreement never blocks in a collective: it is a store round with a deadline on
  ``time.monotonic()`` (see :mod:`dew.pool._store`). A process whose call failed
  says so in the round and every process raises :class:`PoolError` naming it.
* Every collective the pool's training makes (FSDP2's gathers and reductions, the
  tensor-parallel reductions, the share broadcast, checkpoint writes) runs inside
  :meth:`Pool.collective`: when a peer dies inside one, every survivor leaves the
  broken group and meets the others in a bounded post-mortem round that names the
  missing process, instead of raising a transport error that names nobody. Every
  process group the pool makes carries the pool's ``timeout``, so a survivor stuck
  with another survivor is freed by then.
* A hung process is told apart from a slow one by its heartbeat
  (:mod:`dew.pool._heartbeat`): once a peer has not beaten for ``hang_timeout``
  seconds, a round waiting for it fails at once naming it, and a collective blocked
  on it is freed by shutting down the connections to it, so every other process
  raises within seconds of the bound; a peer that beats is waited for as long as
  the round's or the collective's own timeout allows.
* Every process makes the same sequence of pool calls, which the scheduler and
  ``fit`` guarantee: pushes follow from ``updates`` and ``sync_every``, every call
  agrees exactly once, every step runs the same collectives.
* The pool's one thread is its heartbeat, started by :func:`init_pool` and joined
  by :meth:`Pool.close`; the rounds and collectives run on the trainer's thread.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from dew.data import Dataset
from dew.pool._heartbeat import Heartbeat
from dew.pool._store import Missing, Rounds, StoreLost

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Pool", "PoolError", "init_pool"]

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
    tensor: int  # processes along the tensor axis: the readers of one share
    agree_timeout: float
    rounds: Rounds
    timeout: float = 1800.0  # every process group's collective timeout, seconds
    backend: str = "gloo"
    mesh: DeviceMesh | None = None  # ("data", "tensor"); None only in tests of the rounds
    heartbeat: Heartbeat | None = None  # None: hangs are found by timeouts only

    @property
    def data(self) -> int:
        """Processes along the data axis: the number of shares."""
        return self.world // self.tensor

    @property
    def shares(self) -> int:
        return self.data

    @property
    def share(self) -> int:
        return self.rank // self.tensor

    @property
    def reader(self) -> int:
        """This process's place along the tensor axis (0: its share's first reader)."""
        return self.rank % self.tensor

    @property
    def share_group(self) -> Any:
        """The process group of this share's readers (None with one reader)."""
        if self.tensor == 1 or self.mesh is None:
            return None
        return self.mesh["tensor"].get_group()

    @property
    def first_reader(self) -> bool:
        return self.reader == 0

    @property
    def first_reader_rank(self) -> int:
        return self.share * self.tensor

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
                r: exc.hung.get(r)
                or f"did not reach {name} within {bound:g} s (dead, hung or too slow)"
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
            gone = self.heartbeat.gone() if self.heartbeat is not None else {}
            known = "".join(f"; rank {r} of {self.world} {c}" for r, c in gone.items())
            raise PoolError(
                f"rank {self.rank}: pool round {name} failed: the rendezvous store is "
                f"unreachable (its host process may be dead or hung): {exc}{known}",
                sorted(gone),
                gone,
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
        severed = self.heartbeat.severed() if self.heartbeat is not None else {}
        cause = _describe(exc)
        if severed:
            cause = (
                f"this process shut down its connections to hung rank(s) "
                f"{sorted(severed)} to leave it: {cause}"
            )
        try:
            self.exchange("post-mortem", "alive", timeout=self.timeout + self.agree_timeout)
        except PoolError as named:
            raise PoolError(
                f"{named} (after the collective {what} failed: {cause})",
                named.ranks,
                named.causes,
            ) from exc
        raise PoolError(
            f"rank {self.rank}: the collective {what} failed though every process is alive: "
            + _describe(exc),
            [],
            {},
        ) from exc

    @contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """Run collectives named ``what``; a peer's death there becomes a PoolError
        naming it, on every survivor (see the module's invariants)."""
        try:
            yield
        except PoolError:
            raise
        except Exception as exc:  # a peer died or timed out inside the collective
            # Leave the broken group first (nothing can use it any more); a peer blocked
            # in this collective on us may then fail sooner than the group's timeout.
            # The heartbeat keeps running: the post-mortem round needs its view.
            self._leave_groups()
            self.post_mortem(what, exc)

    def close(self) -> None:
        """Stop the heartbeat (telling the peers this process left) and leave the
        process groups (a local operation on gloo; safe after a failure).

        A group's gloo worker threads end when its last reference goes. The pool drops
        its own here; torch's DTensor caches keep the mesh of a sharded model (and its
        groups) until the process exits, which the pool tests check ends cleanly.
        """
        if self.heartbeat is not None:
            self.heartbeat.close()
            self.heartbeat = None
        self._leave_groups()

    def _leave_groups(self) -> None:
        import torch.distributed as dist

        self.mesh = None
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
    tensor: int = 1,
    data: int | None = None,
    timeout: float = 1800.0,
    agree_timeout: float = 300.0,
    hang_timeout: float | None = 30.0,
) -> Pool:
    """Join the pool of a ``torchrun`` job (``env://``) and lay it out as ``data x tensor``.

    ``tensor`` processes split each layer (tensor parallelism) and read one share;
    ``data`` (default: the world size over ``tensor``) is the number of shares, along
    which FSDP2 shards the model; ``data * tensor`` must be the world size.
    ``timeout`` bounds every collective (seconds, the timeout of every process group
    the pool makes); ``agree_timeout`` bounds each agreement round: how long the
    earliest process waits for the slowest one to finish its rollouts before naming
    it missing. ``hang_timeout`` is how long a process's heartbeat may be silent
    before the others name it hung and fail, whatever they are waiting in; a process
    that is only slow keeps beating and is waited for. ``None`` turns the heartbeat
    off (hangs are then found by the two timeouts alone).
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} must be 'gloo' or 'nccl'")
    bounds = (("timeout", timeout), ("agree_timeout", agree_timeout))
    if hang_timeout is not None:
        bounds += (("hang_timeout", hang_timeout),)
    for name, value in bounds:
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and value > 0):
            raise ValueError(f"{name}={value!r} must be a positive number of seconds")
    for name, value in (("tensor", tensor), ("data", data)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    if dist.is_initialized():
        raise ValueError("torch.distributed is already initialized; init_pool sets it up itself")
    world = _env_int("WORLD_SIZE")
    if world % tensor:
        raise ValueError(f"tensor={tensor} must divide the world size {world}")
    if data is not None and data * tensor != world:
        raise ValueError(
            f"data={data} x tensor={tensor} = {data * tensor} processes, but the job has "
            f"{world} (WORLD_SIZE)"
        )
    data = world // tensor
    # torch.distributed.nn binds the default group as a default argument when it is
    # first imported. Imported after the group exists (transformers imports it while
    # building a model), it keeps the group alive past destroy_process_group; gloo's
    # worker threads then outlive the interpreter, and one that releases a finished
    # collective's tensors during shutdown needs the GIL and aborts the process
    # ("terminate called without an active exception"). Imported first, it binds None.
    import torch.distributed.nn

    span = timedelta(seconds=timeout)
    store, rank, world = next(dist.rendezvous("env://", timeout=span))
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore("pg/", store),
        rank=rank,
        world_size=world,
        timeout=span,
    )
    # The mesh's groups are made here, with the pool's timeout: init_device_mesh would
    # give them torch's default (30 minutes), and a survivor stuck in one with another
    # survivor would outlive the pool's bound on a failure by that much.
    layout = torch.arange(world).reshape(data, tensor)  # [data, tensor] -> rank
    mine: dict[str, Any] = {}
    for axis, lines in (("data", layout.t()), ("tensor", layout)):
        for line in lines.tolist():  # every rank makes every group, in the same order
            group = dist.new_group(line, timeout=span)
            if rank in line:
                mine[axis] = group
    device = "cuda" if backend == "nccl" else "cpu"
    mesh = DeviceMesh.from_group(
        [mine["data"], mine["tensor"]], device, layout, mesh_dim_names=("data", "tensor")
    )
    pool_store = dist.PrefixStore("dew.pool/", store)
    heartbeat = None
    if hang_timeout is not None:
        # Its own client: the training thread's rounds hold theirs while they wait.
        heartbeat = Heartbeat(pool_store.clone(), rank, world, float(hang_timeout))
    rounds = Rounds(pool_store, rank, world, hung=None if heartbeat is None else heartbeat.gone)
    if heartbeat is not None:
        heartbeat.on_gone = rounds.interrupt
    pool = Pool(
        rank=rank,
        world=world,
        tensor=tensor,
        agree_timeout=float(agree_timeout),
        rounds=rounds,
        timeout=float(timeout),
        backend=backend,
        mesh=mesh,
        heartbeat=heartbeat,
    )
    if heartbeat is not None:
        heartbeat.start()
    return pool
