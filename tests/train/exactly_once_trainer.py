"""A trainer process for the exactly-once test: the real scheduler over a quick source.

Run as ``python exactly_once_trainer.py RUN_DIR STEPS``. It resumes from RUN_DIR's
newest valid checkpoint (or starts fresh) and prints ``step N`` after every update,
so the test can kill it at chosen points.
"""

from __future__ import annotations

import random
import sys
import threading
from typing import Any

import numpy as np
import torch

from dew.core import Call, Rollout, RolloutKey, Status, Task, ThreadedSource
from dew.data import Dataset
from dew.demo.model import make_model
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import RolloutScheduler
from dew.train import fit

ROWS, BATCH, GROUPS = 96, 3, 2


class Engine:
    """Publisher: remembers the served version, which every call reports."""

    def __init__(self) -> None:
        self.version = 0

    def load(self, variables: Any, version: int) -> None:
        self.version = version


class QuickSource(ThreadedSource):
    """Random-length completions after a short, cancellable pause; a few infra failures."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(workers=4)
        self.engine = engine

    def run(self, task: Task, key: RolloutKey, stop: threading.Event) -> Rollout:
        rng = random.Random(f"{task.id}/{key}")
        version = self.engine.version
        stop.wait(rng.uniform(0.0, 0.02))  # engine latency; cancel cuts it short
        if rng.random() < 0.15:
            return Rollout(key=key, task=task, status=Status.INFRA_ERROR, error="engine died")
        prompt = [6 + int(task.id) % 20, 7, 8]
        completion = [rng.randrange(6, 60) for _ in range(rng.randint(1, 12))]
        reward = sum(t % 2 == 0 for t in completion) / len(completion)  # the verifier
        call = Call(prompt, completion, [-1.0] * len(completion), version)
        return Rollout(key=key, task=task, status=Status.COMPLETED, calls=[call], reward=reward)


def make_dataset() -> Dataset:
    return Dataset({"task_id": np.arange(ROWS)}, batch_size=BATCH, seed=1)


def main() -> None:
    run_dir, steps = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = make_model(size="tiny", max_positions=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = make_dataset()
    engine = Engine()
    objective = GRPOObjective()
    with QuickSource(engine) as source:
        scheduler = RolloutScheduler(
            objective,
            source,
            engine,
            width=32,
            rows=2,
            groups=GROUPS,
            oversample=1,
            max_attempts=2,
            ahead=1,
            max_lag=1,
        )
        with scheduler:
            fit(
                model,
                optimizer,
                data,
                scheduler,
                objective,
                steps=steps,
                run_dir=run_dir,
                checkpoint_every=2,
                resume=True,
                tensorboard=False,
                log=[lambda r: print(f"step {r['step']}", flush=True)],
            )


if __name__ == "__main__":
    main()
