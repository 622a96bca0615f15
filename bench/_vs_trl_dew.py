"""The dew side of bench/vs_trl.py: the demo job, timed step by step.

It builds the demo's job with :func:`dew.demo.run.build_job` (through the recipe,
:mod:`dew.recipe`), exactly as :func:`dew.demo.run.run_demo` does for the demo's tuned
single-turn settings (``DemoConfig.for_task("single")``): the tiny model, AdamW, the
GRPO objective, the in-process RolloutServer, the task's source and the
RolloutScheduler, then ``fit``.
The heavy-tailed tasks (``tail``, ``tail-turns``) are the demo's own, with their tuned
settings (``DemoConfig.for_task``).
Left out, because they are not training: the run folder, checkpoints, TensorBoard, the
progress bar and the plot. For the two-turn task the source is an
:class:`~dew.objectives.rl.sources.EnvironmentSource` over
:class:`_vs_trl_common.TwoTurnCopyEnv`; ``spec.ahead`` picks async (1) or sync (0).
Torch's thread count is the worker's (``spec.threads``), not the demo's.

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

# Per-step record figures whose run means a result keeps (RunResult.diagnostics): how
# stale the trained rollouts were, what the cut left out, how far behavior and proximal
# policies were apart. A figure a step's record lacks is left out of that step's mean.
DIAGNOSTICS = {
    "lag": ("scheduler", "lag"),
    "token_lag": ("scheduler", "metrics", "token_lag_mean"),
    "admitted_len": ("scheduler", "metrics", "bias/admitted_len"),
    "cut_partial_len": ("scheduler", "metrics", "bias/cancelled_partial_len"),
    "mismatch_kl": ("metrics", "mismatch_kl"),
    "importance_capped": ("metrics", "importance_capped_fraction"),
    "behavior_clipped": ("metrics", "behavior_clip_fraction"),
}


def _dig(record: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = record
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return float(value)


class _Enough(Exception):
    """Raised from the step callback to end ``fit`` early."""


def _two_turn(spec: RunSpec) -> Any:
    """The builder of the two-turn task's parts, in the demo registry's shape."""

    def build(config: Any, server: Any, tokenizer: Any, needs: Any) -> Any:
        from dew.objectives.rl.sources import EnvironmentSource
        from dew.recipe import SourceParts

        task = make_two_turn(config.tasks, seed=config.seed, tokenizer=tokenizer)
        width = two_turn_max_chain(tokenizer, config.max_tokens)
        source = EnvironmentSource(
            server,
            lambda: TwoTurnCopyEnv(task, latency=spec.latency),
            tokenizer=tokenizer,
            max_turns=TURNS,
            max_context=width,
            workers=needs.in_flight,
            sampling=needs.sampling,
        )
        return SourceParts(source, width, source.close)

    return build


def run_dew(spec: RunSpec) -> RunResult:
    from dew.demo.run import build_job

    config = demo_config(spec)
    rows = config.batch_size * config.group_size
    result = RunResult(spec=spec, rows=rows)
    clock = StepClock(spec, result)
    sums: dict[str, list[float]] = {name: [] for name in DIAGNOSTICS}

    def on_record(record: dict[str, Any]) -> None:
        for name, path in DIAGNOSTICS.items():
            value = _dig(record, path)
            if value is not None:
                sums[name].append(value)
                result.diagnostics[name] = sum(sums[name]) / len(sums[name])
        sched = record["scheduler"]
        trained = int(sched["groups"]) * config.group_size
        if trained != rows:  # the figures assume full batches; a cut one would skew them
            raise RuntimeError(f"step {record['step']} trained {trained} rollouts, not {rows}")
        if clock.step(sched["metrics"]["reward/mean"], sched["waited"]):
            raise _Enough

    with ExitStack() as stack:
        # the two-turn copy task is built here; the others are the demo registry's
        task = _two_turn(spec) if spec.task == "multi" else None
        job = build_job(config, stack, task=task)
        result.objective = repr(job.objective)
        clock.start()
        try:
            job.fit(
                steps=spec.max_steps,
                checkpoint_every=None,
                log=[on_record],
                tensorboard=False,
                freeze_gc=True,  # as the demo runs
            )
        except _Enough:
            pass
    return result
