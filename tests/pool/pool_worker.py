"""One process of a pool test: ``python pool_worker.py CONFIG.json`` under torchrun.

It trains the tiny demo model, sharded on the pool's mesh (FSDP2 along data, tensor
parallelism along tensor), with ``dew.train.fit`` through a real RolloutScheduler and
GRPOObjective on a scripted in-process source, and writes what it saw to
``<out>/rank<r>.json``: pushes (call, version and a digest of the whole weights the
engine got), a digest of each packed batch, the loss per step, whether the proximal
log-probs equal a fresh rescoring, the sizes of the local shards, scheduler log calls
and rollouts started. On any failure it writes the error text there too and exits
with code 3. With ``single`` it runs without a pool, on the whole global batch: the
reference the pool's losses are compared with.

Rollouts depend on the task, sample and attempt only (not on the process), so a pool
and a single process see the same rollouts for the same tasks.

Failure injection (config ``fail``: ``{"rank", "kind", "at_version"}``): once the
served version reaches ``at_version`` the source of that rank raises (``raise``),
SIGKILLs its own process (``kill``), blocks until cancelled (``hang``), SIGSTOPs its
own process (``stop``: it stays in the process table, silent), returns infrastructure
errors only (``infra``: its share trains nothing) or sleeps ``seconds``
in one rollout while staying alive (``slow``); ``kill_in_step``, ``stop_in_step``
and ``slow_in_step`` do the same to the rank right after the pool agreed on call
``at_version``, when the others are entering the step's collectives.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dew.core import Call, Rollout, RolloutKey, Status, Task, ThreadedSource
from dew.data import Dataset
from dew.demo.model import make_model
from dew.objectives.rl.config import SchedulerConfig
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import RolloutScheduler, SchedulerRecord
from dew.pool import (
    Pool,
    full_state_dict,
    init_pool,
    local_numel,
    optimizer_tensors,
    scheduler_hooks,
    shard_model,
)
from dew.train import fit

VOCAB = 90  # token ids drawn below this (the demo vocabulary is ~100)
IN_STEP = {"kill_in_step": signal.SIGKILL, "stop_in_step": signal.SIGSTOP, "slow_in_step": None}


class Engine:
    """Stands in for a serving engine: it remembers the served version and a digest of
    the whole weights it was given (a sharded model's must arrive gathered)."""

    def __init__(self) -> None:
        self.version = 0
        self.loads: list[int] = []
        self.weights: list[str] = []

    def load(self, variables: Any, version: int) -> None:
        state = variables.state_dict() if isinstance(variables, torch.nn.Module) else variables
        for name, t in state.items():
            if type(t) is not torch.Tensor:
                raise TypeError(f"the engine got {name} as a {type(t).__name__}, not whole")
        self.weights.append(weights_digest(state))
        self.version = version
        self.loads.append(version)


def weights_digest(state: Any) -> str:
    return digest({n: t.detach().float().numpy() for n, t in state.items()})


class ScriptedSource(ThreadedSource):
    """Completed one-call rollouts of a few random tokens; can fail on request."""

    def __init__(
        self, engine: Engine, rank: int, fail: dict[str, Any] | None, out_dir: Path
    ) -> None:
        super().__init__(workers=2)
        self.out_dir = out_dir
        self.engine = engine
        self.rank = rank
        self.fail = fail if fail and fail["rank"] == rank else None
        self.started = 0
        self.slowed = False
        self._count = threading.Lock()

    def run(self, task: Task, key: RolloutKey, stop: threading.Event) -> Rollout:
        with self._count:
            self.started += 1
        version = self.engine.version
        if self.fail and version >= self.fail["at_version"]:
            kind = self.fail["kind"]
            with self._count:  # written whole before any thread of this rank acts on it
                marker = self.out_dir / "failed_at"
                if not marker.exists():
                    (self.out_dir / "failed_at.tmp").write_text(repr(time.time()))
                    os.replace(self.out_dir / "failed_at.tmp", marker)
            if kind == "raise":
                raise RuntimeError(f"scripted source failure on rank {self.rank}, task {task.id}")
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "hang":
                stop.wait(120.0)  # until the scheduler's timeout cancels it
            if kind == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if kind == "infra":  # every attempt fails: this share trains nothing
                return Rollout(
                    key=key,
                    task=task,
                    status=Status.INFRA_ERROR,
                    error=f"sandbox gone on rank {self.rank}",
                )
            if kind == "slow":
                with self._count:
                    first, self.slowed = not self.slowed, True
                if first:  # one long rollout: the rank's rollouts take that long
                    time.sleep(self.fail["seconds"])
        rng = np.random.default_rng([int(task.id), key.sample, key.attempt])
        prompt = [5 + int(task.id) % 80, 7, 9]
        n = int(rng.integers(2, 6))
        completion = rng.integers(5, VOCAB, n).tolist()
        log_probs = (-rng.uniform(0.5, 4.0, n)).tolist()
        call = Call(prompt=prompt, completion=completion, log_probs=log_probs, version=version)
        return Rollout(
            key=key, task=task, status=Status.COMPLETED, calls=[call], reward=float(rng.random())
        )


def optimizer_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """A digest of the optimizer's whole state, by parameter name (gathered on a pool)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    state = get_optimizer_state_dict(model, optimizer, options=options)["state"]
    return digest(
        {
            f"{name}/{key}": torch.as_tensor(value).detach().float().numpy()
            for name, entries in state.items()
            for key, value in entries.items()
        }
    )


def digest(batch: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for key in sorted(batch):
        h.update(key.encode())
        h.update(np.ascontiguousarray(batch[key]).tobytes())
    return h.hexdigest()[:16]


class Checked:
    """The scheduler as fit's rollout, checking each packed batch it hands out."""

    def __init__(
        self,
        scheduler: RolloutScheduler,
        engine: Engine,
        objective: GRPOObjective,
        out: dict,
        fail: dict[str, Any] | None,
        out_dir: Path,
    ) -> None:
        self.scheduler = scheduler
        self.engine = engine  # the publisher behind the pool's agreed pushes
        self.fail = fail
        self.out_dir = out_dir
        self.objective = objective
        self.out = out
        self.failed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)

    def __call__(self, model: torch.nn.Module, batch: Any, *, updates: int) -> Any:
        pushes = len(self.engine.loads)
        packed = self.scheduler(model, batch, updates=updates)
        fail = self.fail
        kind = fail["kind"] if fail else None
        if fail and kind in IN_STEP and updates >= fail["at_version"] and not self.failed:
            # After the pool agreed on this call: the others are about to enter the
            # gradient collectives of the step.
            self.failed = True
            (self.out_dir / "failed_at").write_text(repr(time.time()))
            if kind == "slow_in_step":
                time.sleep(fail["seconds"])  # alive: the heartbeat goes on
            else:
                os.kill(os.getpid(), IN_STEP[kind])
        with torch.no_grad():
            fresh = self.objective.packed_log_probs(model, packed).numpy()
        rows, width = packed["tokens"].shape
        self.out["calls"].append(
            {
                "updates": updates,
                "pushed": self.engine.loads[pushes:],
                "digest": digest(packed),
                "tasks": [int(t) for t in batch["task_id"]],
                "trained": list(self.scheduler.last_tasks.get("trained", [])),
                "proximal_equal": bool(np.array_equal(fresh, packed["proximal_log_probs"])),
                "proximal_max_diff": float(np.abs(fresh - packed["proximal_log_probs"]).max()),
                "normalizer": rows * width,
                "trained_tokens": int((packed["loss_mask"] > 0).sum()),
            }
        )
        return packed


def _lose_a_shard(
    folder: Path, model: torch.nn.Module, optimizer: Any, pool: Pool, out: dict[str, Any]
) -> None:
    """Save sharded checkpoints 1 and 2, take rank 1's model shard out of 2, then ask
    every process which checkpoint is the newest valid one, and why 2 is not."""
    from dew.pool import _checkpoint as sharded

    for updates in (1, 2):
        sharded.save(
            folder,
            model=model,
            optimizer=optimizer,
            pool=pool,
            updates=updates,
            position=updates,
            records=[],
        )
    if pool.rank == 0:
        (folder / "step-00000002" / "__1_0.distcp").unlink()
    pool.exchange("shard-lost", "")
    found = sharded.latest(folder, pool)
    out["latest"] = None if found is None else found.name
    try:
        sharded.verify(folder / "step-00000002", pool)
    except sharded.CheckpointError as exc:
        out["refused"] = str(exc)


def main(config: dict[str, Any]) -> int:
    out_dir = Path(config["out"])
    out: dict[str, Any] = {
        "calls": [],
        "losses": [],
        "params": [],
        "logged": 0,
        "pid": os.getpid(),
    }
    single = bool(config.get("single"))
    rank = 0 if single else int(os.environ["RANK"])
    (out_dir / f"pid{rank}").write_text(str(os.getpid()))
    pool: Pool | None = None
    code = 0
    try:
        torch.manual_seed(0)
        model = make_model("qwen2", "tiny", seed=0)
        total_params = sum(p.numel() for p in model.parameters())
        tasks_per_share = config.get("tasks_per_share", 2)
        rows = config.get("rows", 4)
        if single:  # the reference: one process, the pool's whole batch
            shares = config["shares"]
            rows *= shares
        else:
            pool = init_pool(
                "gloo",
                tensor=config.get("tensor", 1),
                timeout=config.get("pg_timeout", 30.0),
                agree_timeout=config.get("agree_timeout", 10.0),
                hang_timeout=config.get("hang_timeout", 30.0),
            )
            shares = pool.shares
            out.update(rank=pool.rank, world=pool.world, share=pool.share, reader=pool.reader)
            shard_model(model, pool)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if config.get("lose_a_shard"):
            assert pool is not None
            _lose_a_shard(Path(config["run_dir"]) / "checkpoints", model, optimizer, pool, out)
            return code
        objective = GRPOObjective()
        engine = Engine()
        source = ScriptedSource(engine, rank, config.get("fail"), out_dir)
        dataset = Dataset(
            {"task_id": np.arange(64)},
            batch_size=config.get("global_tasks", tasks_per_share * shares),
            seed=1,
        )

        def log(record: SchedulerRecord) -> None:
            out["logged"] += 1

        knobs = SchedulerConfig(
            groups=2,
            ahead=1,
            max_lag=1,
            max_attempts=config.get("max_attempts", 3),
            timeout=config.get("rollout_timeout"),
        )
        scheduler = RolloutScheduler.from_config(
            objective,
            source,
            engine,
            knobs,
            width=32,
            rows=rows,
            log=log,
            hooks=None if pool is None else scheduler_hooks(pool),
        )

        def check(record: dict[str, Any]) -> None:
            out["losses"].append(record["loss"])
            out["grad_norms"] = [*out.get("grad_norms", []), record.get("grad_norm")]
            # The whole weights after the step (a collective on a pool: every process).
            out["params"].append(weights_digest(full_state_dict(model)))
            out["sizes"] = {
                "params_total": total_params,
                "params_local": local_numel(model.parameters()),
                "optimizer_local": local_numel(optimizer_tensors(optimizer)),
            }

        run_dir = Path(config["run_dir"]) if config.get("run_dir") else None
        try:
            result = fit(
                model,
                optimizer,
                dataset if pool is None else pool.dataset(dataset),
                Checked(scheduler, engine, objective, out, source.fail, out_dir),
                objective,
                steps=config.get("steps", 3),
                run_dir=run_dir,
                checkpoint_every=config.get("checkpoint_every"),
                resume=bool(config.get("resume")),
                log=[check],
                tensorboard=False,
                pool=pool,
                max_empty_steps=config.get("max_empty_steps", 5),
            )
            out["resumed_from"] = str(result.resumed_from) if result.resumed_from else None
        finally:
            scheduler.close()
            source.close()
        # The whole model and optimizer state at the end (collectives on a pool).
        out["final_weights"] = weights_digest(full_state_dict(model))
        out["final_optimizer"] = optimizer_digest(model, optimizer)
        out["pushes"] = list(engine.loads)
        out["engine_loads"] = engine.loads
        out["engine_weights"] = engine.weights
        out["started"] = source.started
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
        print(f"rank {rank}: {out['error']}", file=sys.stderr, flush=True)
        code = 3
    finally:
        if pool is not None:
            pool.close()
        out["exit_time"] = time.time()
        name = "single" if single else f"rank{rank}"
        (out_dir / f"{name}.json.tmp").write_text(json.dumps(out))
        os.replace(out_dir / f"{name}.json.tmp", out_dir / f"{name}.json")
    return code


if __name__ == "__main__":
    sys.exit(main(json.loads(Path(sys.argv[1]).read_text())))
