"""The demo's tasks as sources: a registry of task name -> builder.

A builder takes the demo's config, the engine, the tokenizer and what the recipe worked
out (:class:`dew.recipe.Needs`: the sampling, the rollouts in flight) and returns the
task's :class:`~dew.recipe.SourceParts` (the source, the widest chain, how to close it,
and the task's parameters to print). Adding a task is one entry in :data:`TASKS`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from dew.recipe import Needs, SourceParts

# A dew.demo.run.DemoConfig: the builders read its task fields (that module imports
# this one, for the registry, so the type is named here only).
DemoConfig = Any

__all__ = ["TASKS", "TaskBuilder", "TaskParts"]

TaskParts = SourceParts  # the demo's name for what a task builder hands back

# (config, engine, tokenizer, needs) -> the task's source
TaskBuilder = Callable[[DemoConfig, Any, Any, Needs], SourceParts]

# PromptSource submits without a thread per rollout; its pool only runs verifiers. Two
# threads keep up with the demo's verifier, and a large pool costs time, as each burst
# of finished calls wakes many threads (compare with bench/vs_trl.py).
_VERIFIERS = 2


def _single(config: DemoConfig, server: Any, tokenizer: Any, needs: Needs) -> SourceParts:
    from dew.demo import tasks
    from dew.objectives.rl.sources import PromptSource

    low, high = config.digits
    task = tasks.make_task(
        config.tasks,
        seed=config.seed,
        tokenizer=tokenizer,
        min_digits=low,
        max_digits=high,
        stop_weight=config.stop_weight,
    )
    source = PromptSource(
        server,
        task.prompts,
        task.verifier,
        workers=_VERIFIERS,
        sampling=dataclasses.replace(needs.sampling, stop_ids=[task.eos]),
    )
    return SourceParts(source, task.max_prompt + config.max_tokens, source.close)


def _guess(config: DemoConfig, server: Any, tokenizer: Any, needs: Needs) -> SourceParts:
    from dew.demo.guess import make_env
    from dew.objectives.rl.sources import EnvironmentSource

    turns, context = 4, 160
    source = EnvironmentSource(
        server,
        make_env(low=0, high=9, seed=config.seed),
        tokenizer=tokenizer,
        max_turns=turns,
        max_context=context,
        workers=needs.in_flight,
        sampling=needs.sampling,
    )
    return SourceParts(source, context, source.close)


def _agent(config: DemoConfig, server: Any, tokenizer: Any, needs: Needs) -> SourceParts:
    from dew.demo.agent import build_agent_source

    demo = build_agent_source(
        server,
        tokenizer,
        tasks=config.tasks,
        seed=config.seed,
        max_tokens=needs.sampling.max_tokens,
        temperature=needs.sampling.temperature,
        workers=needs.in_flight,
        processes=config.harness_processes,
    )
    return SourceParts(demo.source, demo.max_chain, demo.close)


def _tail(config: DemoConfig, server: Any, tokenizer: Any, needs: Needs) -> SourceParts:
    from dew.demo.tail import make_tail_task
    from dew.objectives.rl.sources import PromptSource

    task = make_tail_task(config.tasks, seed=config.seed, tokenizer=tokenizer)
    # The verifier sleeps its latency in a worker: one per rollout in flight, so no
    # rollout waits for another's verification.
    source = PromptSource(
        server,
        task.prompts,
        task.verifier,
        workers=needs.in_flight,
        sampling=dataclasses.replace(needs.sampling, stop_ids=[task.eos]),
    )
    return SourceParts(
        source, task.max_prompt + config.max_tokens, source.close, task.workload.describe()
    )


def _tail_turns(config: DemoConfig, server: Any, tokenizer: Any, needs: Needs) -> SourceParts:
    from dew.demo.tail import make_tail_task, turns_max_chain
    from dew.objectives.rl.sources import EnvironmentSource

    task = make_tail_task(config.tasks, seed=config.seed, tokenizer=tokenizer)
    width = turns_max_chain(task, tokenizer, config.max_tokens)
    source = EnvironmentSource(
        server,
        task.env,
        tokenizer=tokenizer,
        max_turns=task.workload.max_turns,
        max_context=width,
        workers=needs.in_flight,
        sampling=needs.sampling,
    )
    return SourceParts(source, width, source.close, task.workload.describe())


TASKS: dict[str, TaskBuilder] = {
    "single": _single,
    "guess": _guess,
    "agent": _agent,
    "tail": _tail,
    "tail-turns": _tail_turns,
}
