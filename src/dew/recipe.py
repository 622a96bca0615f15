"""One recipe for a training job: the stack is assembled here and nowhere else.

``dew train``, ``dew demo`` and the benchmarks describe their job as a :class:`Recipe`
(the model, how to build the engine and the source, the sampling, the scheduling knobs,
the objective, the training and parallel settings) and :func:`assemble` builds it, in
this order:

1. (:func:`join_pool`, which the entrypoint calls first, to know its rank before it
   writes anything) join the ``torchrun`` job's pool when this process is one of
   several, laid out as ``parallel`` says;
2. seed torch (``seed``) and build the model; without a pool, move it to ``device``;
3. the objective, its temperature the one the samples are scored under
   (:func:`dew.core.scored_temperature` of ``sampling.temperature``);
4. the task stream: ``tasks`` task rows per step for the whole job, each data share
   reading its own ``tasks / shares`` of every batch;
5. the engine, from the whole model, with this process's seed (``seed + rank``) and
   room for every rollout this process can have in flight
   (``tasks / shares * scheduler.in_flight_per_task``, which counts ``oversample``);
6. the model sharded on the pool's mesh (after the engine copied it whole), then
   ``wrap`` (LoRA), then AdamW over the trainable parameters;
7. the source, and the scheduler, joined to the pool through its hooks at
   construction (:func:`dew.pool.scheduler_hooks`).

Every part with threads or processes is closed by the caller's ``ExitStack`` in the
reverse order of its making; the recipe owns none itself. Torch's thread count stays
the caller's to set.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from dew.core import SamplingParams, scored_temperature
from dew.data import Dataset
from dew.objectives.rl.config import SchedulerConfig
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import RolloutScheduler
from dew.train import FitResult, fit

__all__ = ["Job", "Needs", "Recipe", "RecipeError", "SourceParts", "assemble", "join_pool"]


class RecipeError(ValueError):
    """A recipe this process cannot build; ``field`` names the recipe's field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Needs:
    """What the recipe worked out for the engine and source builders."""

    model: Any  # the starting policy, whole (the engine copies it)
    seed: int  # this process's engine seed: the recipe's seed + rank
    in_flight: int  # rollouts this process can have running at once
    sampling: SamplingParams
    rank: int


@dataclass
class SourceParts:
    """What a source builder hands back: the source and how wide its chains get."""

    source: Any
    width: int  # longest prompt + completion tokens of one chain (the packed width)
    close: Callable[[], None] = lambda: None
    describe: str = ""  # the task's parameters, printed beside its results


# (needs, stack) -> an Engine and Publisher, whose close the builder puts on the stack
EngineBuilder = Callable[[Needs, ExitStack], Any]
# (engine, needs) -> the source on that engine
SourceBuilder = Callable[[Any, Needs], SourceParts]


@dataclass(frozen=True)
class Recipe:
    """The typed description of a training job (see the module docstring)."""

    model: Callable[[], Any]  # builds (or hands over) the policy, after torch is seeded
    engine: EngineBuilder
    source: SourceBuilder
    sampling: SamplingParams
    scheduler: SchedulerConfig
    rows: int  # task rows of the dataset; task i is row i
    tasks: int  # tasks per step, for the whole job
    lr: float
    # GRPOObjective's settings but the temperature (which the sampling sets)
    objective: Mapping[str, Any] = field(default_factory=dict)
    # (starting policy) -> the frozen reference of a KL term, or None
    reference: Callable[[Any], Any] | None = None
    weight_decay: float = 0.0
    seed: int = 0
    data_seed: int | None = None  # the task order's seed (None: ``seed``)
    device: str | None = None  # single process: where the model trains (None: as built)
    # under torchrun: dew.pool.init_pool's layout and timeouts (tensor, data, ...)
    parallel: Mapping[str, Any] = field(default_factory=dict)
    # (model, engine) -> (the model to train, the publisher its weights go through)
    wrap: Callable[[Any, Any], tuple[Any, Any]] | None = None


@dataclass(frozen=True)
class Job:
    """The assembled stack: what ``fit`` trains, and the parts behind it."""

    model: Any
    optimizer: Any
    objective: GRPOObjective
    dataset: Dataset  # this process's share of the task stream
    engine: Any
    scheduler: RolloutScheduler
    pool: Any  # the torchrun job's pool, or None on a single process
    needs: Needs
    describe: str = ""

    @property
    def rank(self) -> int:
        return 0 if self.pool is None else self.pool.rank

    def fit(self, **options: Any) -> FitResult:
        """:func:`dew.train.fit` of this job; ``options`` are fit's keywords."""
        return fit(
            self.model,
            self.optimizer,
            self.dataset,
            self.scheduler,
            self.objective,
            pool=self.pool,
            **options,
        )


def join_pool(parallel: Mapping[str, Any], stack: ExitStack) -> Any:
    """The ``torchrun`` job's pool when this process is one of several (``WORLD_SIZE``
    above 1), laid out by ``parallel`` (:func:`dew.pool.init_pool`'s keywords) and closed
    by ``stack``; None on a single process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        tensor, data = parallel.get("tensor", 1), parallel.get("data")
        if tensor > 1 or (data or 1) > 1:
            raise RecipeError(
                "parallel",
                f"data={data}, tensor={tensor} needs that many processes: start it with "
                "torchrun --nproc-per-node N",
            )
        return None
    from dew.pool import init_pool

    try:
        pool = init_pool("gloo", **parallel)
    except ValueError as exc:
        raise RecipeError("parallel", str(exc)) from None
    stack.callback(pool.close)
    return pool


def assemble(recipe: Recipe, stack: ExitStack, pool: Any = None) -> Job:
    """Build ``recipe``'s job (the module docstring has the order) on ``pool`` (what
    :func:`join_pool` gave: None on a single process); ``stack`` closes the engine,
    source and scheduler. RecipeError names a field this job cannot use."""
    import numpy as np
    import torch

    rank, shares = (0, 1) if pool is None else (pool.rank, pool.shares)
    if recipe.tasks % shares:
        raise RecipeError(
            "tasks",
            f"{recipe.tasks} tasks per step do not split evenly over the {shares} "
            "processes of the data axis",
        )
    torch.manual_seed(recipe.seed)
    model = recipe.model()
    if pool is None and recipe.device is not None:  # a pool places each process's shard
        model.to(recipe.device)
    reference = None if recipe.reference is None else recipe.reference(model)
    objective = GRPOObjective(
        temperature=scored_temperature(recipe.sampling.temperature),
        reference=reference,
        **recipe.objective,
    )
    seed = recipe.seed if recipe.data_seed is None else recipe.data_seed
    dataset = Dataset({"task_id": np.arange(recipe.rows)}, batch_size=recipe.tasks, seed=seed)
    if pool is not None:
        dataset = pool.dataset(dataset)
    own = recipe.tasks // shares  # this process's tasks per step
    needs = Needs(
        model=model,
        seed=recipe.seed + rank,
        in_flight=own * recipe.scheduler.in_flight_per_task,
        sampling=recipe.sampling,
        rank=rank,
    )
    engine = recipe.engine(needs, stack)
    if pool is not None:  # after the engine copied the whole model, before the optimizer
        from dew.pool import shard_model

        shard_model(model, pool)
    publisher = engine
    if recipe.wrap is not None:
        model, publisher = recipe.wrap(model, engine)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=recipe.lr,
        weight_decay=recipe.weight_decay,
    )
    parts = recipe.source(engine, needs)
    stack.callback(parts.close)
    hooks = None
    if pool is not None:
        from dew.pool import scheduler_hooks

        hooks = scheduler_hooks(pool)
    scheduler = RolloutScheduler.from_config(
        objective,
        parts.source,
        publisher,
        recipe.scheduler,
        width=parts.width,
        rows=own * recipe.scheduler.groups,
        hooks=hooks,
    )
    stack.callback(scheduler.close)
    return Job(model, optimizer, objective, dataset, engine, scheduler, pool, needs, parts.describe)
