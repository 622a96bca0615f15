"""The agent demo: train an unmodified OpenAI-client agent through the recording gateway.

The agent is :mod:`dew.demo.agent_script` (two model turns around a tool call; see
there). This module holds what training it needs: the task list, the verifier, and
:func:`build_agent_source`, which starts a :class:`RecordingGateway` in front of the
engine and returns a :class:`HarnessSource` that runs the agent once per rollout.

By default the agent runs in-process on the source's worker threads (its ``solve``
function with an ``openai`` client the source hands it); ``processes=N`` runs that same
function in N long-lived harness processes; ``subprocess=True`` runs
the very same program as ``python -m dew.demo.agent_script``, which is how a harness
of any language is trained. A subprocess costs about a second of interpreter and
``openai`` start-up per rollout, too slow for a CPU demo of many rollouts a step.

The verifier scores the calls the gateway recorded (decoded), not what the agent
says it did, so an agent that crashed half-way is still scored on what it produced.
Reward components per turn: ``format`` 0.2 when the reply starts with a digit,
``copy`` 0.3 when that digit is the one asked for (the task's, then the tool's).

Wiring it into the trainer (``dew demo --task agent``)::

    demo = build_agent_source(server, tokenizer, tasks=config.tasks, seed=config.seed,
                              max_tokens=config.max_tokens, temperature=config.temperature,
                              workers=needs.in_flight)
    SourceParts(demo.source, demo.max_chain, demo.close)

The scheduler's records then carry the gateway's merge ratio (1.0: every episode
packs into one chain) among their session metrics.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dew.core import Call, SamplingParams, Task
from dew.demo.agent_script import next_digit, solve
from dew.gateway import HarnessEndpoint, HarnessOutcome, HarnessSource, RecordingGateway

__all__ = [
    "AgentDemo",
    "build_agent_source",
    "make_tasks",
    "make_verifier",
    "max_chain",
    "replies",
    "score",
]

FORMAT = 0.2
COPY = 0.3
TURNS = 2


def make_tasks(n: int, *, seed: int = 0) -> dict[str, Task]:
    """``n`` tasks with ids ``"0" .. str(n - 1)`` (the trainer's ``task_id`` rows), a digit each."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    digits = np.random.default_rng(seed).integers(0, 10, size=n)
    return {str(i): Task(str(i), {"digit": int(d)}) for i, d in enumerate(digits)}


def replies(tokenizer: Any, calls: tuple[Call, ...]) -> list[str]:
    """The text of each recorded call as the agent received it (stop token removed)."""
    eos = tokenizer.eos_token_id
    out = []
    for call in calls:
        ids = [int(t) for t in call.completion]
        if call.finish_reason == "stop" and ids and ids[-1] == eos:
            ids = ids[:-1]
        out.append(tokenizer.decode(ids, skip_special_tokens=False))
    return out


def score(digit: int, texts: list[str]) -> dict[str, float]:
    """Reward components of an episode's replies for the task's ``digit``."""
    texts = (texts + [""] * TURNS)[:TURNS]
    targets = [digit, next_digit(texts[0], digit)]
    form = sum(FORMAT for t in texts if t[:1].isdigit() and t[:1].isascii())
    copy = sum(COPY for t, d in zip(texts, targets, strict=True) if t[:1] == str(d))
    return {"format": form, "copy": copy}


def make_verifier(tokenizer: Any) -> Callable[[Task, HarnessOutcome], dict[str, float]]:
    def verify(task: Task, outcome: HarnessOutcome) -> dict[str, float]:
        return score(int(task.data["digit"]), replies(tokenizer, outcome.calls))

    return verify


def max_chain(tokenizer: Any, max_tokens: int) -> int:
    """Longest chain an episode can record: the last prompt at its longest plus a reply."""
    worst = [
        {"role": "user", "content": "digit 9"},
        {"role": "assistant", "content": "9" * max_tokens},
        {"role": "tool", "content": "digit 9"},
    ]
    ids = tokenizer.apply_chat_template(worst, add_generation_prompt=True, tokenize=True)
    return len(ids["input_ids"]) + max_tokens


@dataclass
class AgentDemo:
    """The running pieces of the agent demo; :meth:`close` stops both (source first)."""

    source: HarnessSource
    gateway: RecordingGateway
    tasks: Mapping[str, Task]
    max_chain: int

    def close(self) -> None:
        try:
            self.source.close()
        finally:
            self.gateway.close()


@dataclass(frozen=True)
class _Agent:
    """The agent's ``solve`` as a callable harness (a class, so it pickles for
    ``processes``)."""

    max_tokens: int

    def __call__(self, task: Task, endpoint: HarnessEndpoint) -> dict[str, Any]:
        with endpoint.client(max_retries=0) as client:
            return solve(
                client, endpoint.model, int(task.data["digit"]), max_tokens=self.max_tokens
            )


def build_agent_source(
    server: Any,
    tokenizer: Any,
    *,
    tasks: int | Mapping[str, Task] = 4096,
    seed: int = 0,
    max_tokens: int = 4,
    temperature: float = 1.0,
    workers: int = 16,
    subprocess: bool = False,
    processes: int = 0,
    timeout: float | None = None,
) -> AgentDemo:
    """Start a gateway in front of ``server`` and a source that runs the demo agent.

    ``tasks``: how many to make (ids ``"0"..``) or the tasks themselves. Every call is
    sampled at ``temperature`` (the gateway's, whatever the agent asks) and capped at
    ``max_tokens``; a session may make ``2 * TURNS`` calls. ``workers`` rollouts run
    at once. ``processes``: run the agent in that many harness processes (see
    :class:`HarnessSource`) instead of on the source's threads. The caller owns the
    result: close it.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if subprocess and processes:
        raise ValueError(f"processes={processes}: a subprocess agent runs in its own process")
    table = make_tasks(tasks, seed=seed) if isinstance(tasks, int) else dict(tasks)
    gateway = RecordingGateway(
        server,
        tokenizer,
        max_turns=2 * TURNS,
        max_tokens_per_session=2 * TURNS * max_tokens,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature),
        workers=max(4, 2 * workers),
    ).start()
    try:
        harness: Any = (
            [sys.executable, "-m", "dew.demo.agent_script"] if subprocess else _Agent(max_tokens)
        )
        source = HarnessSource(
            gateway,
            harness,
            make_verifier(tokenizer),
            tasks=table,
            workers=workers,
            timeout=timeout,
            env={"DEW_MAX_TOKENS": str(max_tokens)},
            processes=processes,
        )
    except BaseException:
        gateway.close()
        raise
    return AgentDemo(source, gateway, table, max_chain(tokenizer, max_tokens))
