"""The dew side of bench/vs_trl.py: the demo job's wiring, timed step by step.

It builds what :func:`dew.demo.run.run_demo` builds for the demo's tuned single-turn
settings (``DemoConfig.for_task("single")``): the tiny model, AdamW, the GRPO
objective, the in-process RolloutServer, the task's source from the demo's registry,
the RolloutScheduler and ``fit``. Left out, because they are not training: the run
folder, checkpoints, TensorBoard, the progress bar and the plot. For the two-turn task
the source is an :class:`~dew.objectives.rl.sources.EnvironmentSource` over
:class:`_vs_trl_common.TwoTurnCopyEnv`; ``spec.ahead`` picks async (1) or sync (0).

Threads: the server's engine thread, the scheduler's driver thread and the source's
workers are owned by the ExitStack here and closed in reverse order of construction
when the run ends, whether it ran out of steps, reached its reward (the step callback
raises ``_Enough`` out of ``fit``) or failed.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from _vs_trl_common import (
    TURNS,
    RunResult,
    RunSpec,
    StepClock,
    TwoTurnCopyEnv,
    demo_config,
    make_two_turn,
    two_turn_max_chain,
)


class _Enough(Exception):
    """Raised from the step callback to end ``fit`` early."""


def _multi_source(config: Any, spec: RunSpec, server: Any, tokenizer: Any) -> tuple[Any, int]:
    from dew.objectives.rl.sources import EnvironmentSource

    task = make_two_turn(config.tasks, seed=config.seed, tokenizer=tokenizer)
    width = two_turn_max_chain(tokenizer, config.max_tokens)
    source = EnvironmentSource(
        server,
        lambda: TwoTurnCopyEnv(task, latency=spec.latency),
        tokenizer=tokenizer,
        max_turns=TURNS,
        max_context=width,
        max_tokens=config.max_tokens,
        temperature=config.temperature,
        workers=config.batch_size * config.group_size * (config.ahead + 1),
    )
    return source, width


def run_dew(spec: RunSpec) -> RunResult:
    import numpy as np
    import torch

    from dew.data import Dataset
    from dew.demo.model import make_model, make_tokenizer
    from dew.demo.run import TASKS
    from dew.objectives.rl.grpo import GRPOObjective
    from dew.objectives.rl.scheduler import RolloutScheduler
    from dew.serving import RolloutServer
    from dew.train import fit

    config = demo_config(spec)
    rows = config.batch_size * config.group_size
    result = RunResult(spec=spec, rows=rows)
    clock = StepClock(spec, result)

    def on_record(record: dict[str, Any]) -> None:
        sched = record["scheduler"]
        trained = int(sched["groups"]) * config.group_size
        if trained != rows:  # the figures assume full batches; a cut one would skew them
            raise RuntimeError(f"step {record['step']} trained {trained} rollouts, not {rows}")
        if clock.step(sched["metrics"]["reward/mean"]):
            raise _Enough

    torch.manual_seed(config.seed)
    tokenizer = make_tokenizer()
    model = make_model(config.arch, config.size, seed=config.seed, max_positions=256)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    objective = GRPOObjective(temperature=config.temperature, clip_high=config.clip_high)
    dataset = Dataset({"task_id": np.arange(config.tasks)}, batch_size=config.batch_size, seed=1)
    with ExitStack() as stack:
        server = RolloutServer(model, max_batch=rows * (config.ahead + 1), seed=config.seed)
        stack.callback(server.close)
        if spec.task == "single":
            parts = TASKS["single"](config, server, tokenizer)
            source, width = parts.source, parts.max_chain
            stack.callback(parts.close)
        else:
            source, width = _multi_source(config, spec, server, tokenizer)
            stack.callback(source.close)
        scheduler = RolloutScheduler(
            objective,
            source,
            server,
            width=width,
            rows=rows,
            groups=config.group_size,
            ahead=config.ahead,
            max_lag=config.max_lag,
            truncation=config.truncation,
            estimator=config.estimator,
        )
        stack.callback(scheduler.close)
        clock.start()
        try:
            fit(
                model,
                optimizer,
                dataset,
                scheduler,
                objective,
                steps=spec.max_steps,
                checkpoint_every=None,
                log=[on_record],
                tensorboard=False,
            )
        except _Enough:
            pass
    return result
