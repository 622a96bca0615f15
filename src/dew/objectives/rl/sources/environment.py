"""EnvironmentSource: multi-turn rollouts against an in-process environment.

The environment protocol (:class:`Environment`) is three methods, called from one
worker thread per rollout:

* ``reset(task)`` returns the opening: a string (one user message) or a list of chat
  messages (``{"role": ..., "content": ...}``);
* ``step(reply)`` gets the model's reply text (the completion without its stop token)
  and returns the next observation in the same forms, or ``None`` when the episode is
  over;
* ``score()`` returns the reward: a float or a mapping of named parts (summed).

An optional ``close()`` is called once the rollout ends, whatever happened.

Turn by turn, the prompt grows token-exactly: the next prompt is the previous prompt,
the completion, and the chat-template tokens of only the new messages (see
:mod:`dew.objectives.rl.sources.chat`), so a rollout's calls merge into one chain.

Outcomes:

* ``step`` returns ``None``: ``COMPLETED``, scored;
* the environment raises :class:`AgentError` (the model's action is invalid):
  ``AGENT_ERROR``, scored, ``error`` holds the message;
* a limit is hit: ``TRUNCATED``, scored, with ``truncation`` ``"turns"`` (``max_turns``
  calls made and the episode goes on), ``"context"`` (the next prompt plus one token
  would not fit ``max_context``, or the reply was cut short by it) or ``"wall_clock"``
  (``wall_clock`` seconds since the rollout began, checked between steps);
* the engine lost a call to a fault (:class:`~dew.core.EngineError`): ``INFRA_ERROR``;
* any other exception from ``reset``, ``step``, ``score`` or ``close`` (or an opening
  prompt that does not fit ``max_context``): ``INFRA_ERROR`` with the error text and no
  reward;
* the session is cancelled: ``CANCELLED``. ``stop`` is checked between steps and handed
  to the engine, which drops the request within one iteration; a step in progress is not
  interrupted, so environments bound their own step time.

A reply cut by ``sampling.max_tokens`` (not by the context) is handed to the environment like any
other: it judges what an unfinished reply is worth.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

from dew.core import (
    Aborted,
    Call,
    Engine,
    EngineError,
    Rollout,
    RolloutKey,
    SamplingParams,
    Status,
    Task,
    ThreadedSource,
    as_int,
    error_text,
    parse_reward,
)
from dew.objectives.rl.sources.chat import ChatTokens, resolve_stop_ids

__all__ = ["AgentError", "Environment", "EnvironmentSource", "Observation"]

Observation = str | Sequence[Mapping[str, Any]]


class AgentError(Exception):
    """Raised by an environment when the model's action is invalid (the agent's fault).

    The rollout ends as ``AGENT_ERROR`` and is still scored.
    """


@runtime_checkable
class Environment(Protocol):
    """An in-process multi-turn environment (see the module docstring)."""

    def reset(self, task: Task) -> Observation: ...

    def step(self, reply: str) -> Observation | None: ...

    def score(self) -> float | Mapping[str, float]: ...


def _messages(obs: Observation, where: str) -> list[Mapping[str, Any]]:
    if isinstance(obs, str):
        return [{"role": "user", "content": obs}]
    if isinstance(obs, Sequence) and obs and all(isinstance(m, Mapping) for m in obs):
        return list(obs)
    raise TypeError(f"{where} returned {obs!r}; expected a string or a list of chat messages")


class _Outcome(Exception):
    """Internal: ends the episode loop with a status."""

    def __init__(
        self, status: Status, truncation: str | None = None, error: str | None = None
    ) -> None:
        super().__init__(status.value)
        self.status, self.truncation, self.error = status, truncation, error


class _Gaps:
    """The seconds a rollout spends outside the engine after each of its calls (the
    environment's step; after the last, the final step and the score)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._ended: float | None = None

    def call_starts(self) -> None:
        if self._ended is not None:
            self.seconds.append(time.monotonic() - self._ended)
            self._ended = None

    def call_ends(self) -> None:
        self._ended = time.monotonic()

    def done(self) -> list[float]:
        self.call_starts()
        return self.seconds


class EnvironmentSource(ThreadedSource):
    """Multi-turn rollouts: a fresh ``make_env()`` environment per rollout."""

    def __init__(
        self,
        engine: Engine,
        make_env: Callable[[], Environment],
        *,
        tokenizer: Any,
        sampling: SamplingParams,
        max_turns: int,
        max_context: int,
        wall_clock: float | None = None,
        workers: int = 8,
    ) -> None:
        if not callable(make_env):
            raise ValueError("make_env must be callable with no arguments")
        max_turns = as_int(max_turns, "max_turns", minimum=1)
        max_context = as_int(max_context, "max_context", minimum=2)
        # max_len is optional in the engine contract: an engine that knows its context says.
        engine_max = getattr(engine, "max_len", None)
        if engine_max is not None and max_context > engine_max:
            raise ValueError(f"max_context={max_context} exceeds the engine's max_len={engine_max}")
        if wall_clock is not None and not wall_clock > 0:
            raise ValueError(f"wall_clock must be > 0 seconds or None, got {wall_clock!r}")
        self.sampling = resolve_stop_ids(sampling, tokenizer)
        super().__init__(workers=workers)
        self.engine = engine
        self.make_env = make_env
        self.tokenizer = tokenizer
        self.chat = ChatTokens(tokenizer)
        self.max_turns = max_turns
        self.max_context = max_context
        self.wall_clock = wall_clock

    def run(self, task: Task, key: RolloutKey, stop: threading.Event) -> Rollout:
        calls: list[Call] = []
        env: Environment | None = None
        gaps = _Gaps()
        try:
            env = self.make_env()
            outcome = self._episode(env, task, key, stop, calls, gaps)
        except _Outcome as out:
            outcome = out
        except Exception as exc:  # the environment broke: recorded, never a reward
            outcome = _Outcome(Status.INFRA_ERROR, error=error_text(exc))
        reward: float | None = None
        parts: dict[str, float] = {}
        if env is not None and outcome.status in (
            Status.COMPLETED,
            Status.AGENT_ERROR,
            Status.TRUNCATED,
        ):
            try:
                reward, parts = parse_reward(env.score())
            except Exception as exc:
                outcome = _Outcome(Status.INFRA_ERROR, error=f"score failed: {error_text(exc)}")
        closer = getattr(env, "close", None)
        if callable(closer):
            try:
                closer()
            except Exception as exc:
                outcome = _Outcome(Status.INFRA_ERROR, error=f"close failed: {error_text(exc)}")
                reward, parts = None, {}
        if outcome.status is Status.INFRA_ERROR:
            reward, parts = None, {}
        elif outcome.status is not Status.CANCELLED:  # the environment's share of its time
            self.outside.extend(gaps.done())
        return Rollout(
            key=key,
            task=task,
            status=outcome.status,
            calls=tuple(calls),
            reward=reward,
            components=parts,
            truncation=outcome.truncation,
            error=outcome.error,
        )

    def _episode(
        self,
        env: Environment,
        task: Task,
        key: RolloutKey,
        stop: threading.Event,
        calls: list[Call],
        gaps: _Gaps,
    ) -> _Outcome:
        deadline = None if self.wall_clock is None else time.monotonic() + self.wall_clock
        prompt = self.chat.first(_messages(env.reset(task), "reset"))
        while True:
            self._between_steps(stop, deadline, calls)
            room = self.max_context - len(prompt)
            if room < 1:
                if not calls:
                    raise ValueError(
                        f"the opening prompt has {len(prompt)} tokens; "
                        f"max_context={self.max_context} leaves no room to reply"
                    )
                raise _Outcome(Status.TRUNCATED, "context")
            full = self.sampling.max_tokens
            params = self.sampling if room >= full else replace(self.sampling, max_tokens=room)
            gaps.call_starts()
            try:
                call = self.engine.generate(prompt, params, stop=stop, affinity=key.group)
            except Aborted:
                raise _Outcome(Status.CANCELLED, error="cancelled") from None
            except EngineError as exc:  # lost to a fault: the sample runs again
                raise _Outcome(Status.INFRA_ERROR, error=f"engine: {error_text(exc)}") from None
            gaps.call_ends()
            calls.append(call)
            if call.finish_reason == "length" and params.max_tokens < full:
                raise _Outcome(Status.TRUNCATED, "context")
            completion = [int(t) for t in call.completion]
            stopped = call.finish_reason == "stop"
            reply = self.tokenizer.decode(
                completion[:-1] if stopped else completion, skip_special_tokens=False
            )
            self._between_steps(stop, deadline, calls)
            try:
                obs = env.step(reply)
            except AgentError as exc:
                raise _Outcome(Status.AGENT_ERROR, error=str(exc) or type(exc).__name__) from None
            if obs is None:
                return _Outcome(Status.COMPLETED)
            if len(calls) >= self.max_turns:
                raise _Outcome(Status.TRUNCATED, "turns")
            text = self.tokenizer.decode(completion, skip_special_tokens=False)
            prompt = (
                [int(t) for t in call.prompt]
                + completion
                + self.chat.after_reply(text, stopped, _messages(obs, "step"))
            )

    @staticmethod
    def _between_steps(stop: threading.Event, deadline: float | None, calls: list[Call]) -> None:
        if stop.is_set():
            raise _Outcome(Status.CANCELLED, error="cancelled")
        if deadline is not None and time.monotonic() >= deadline:
            if not calls:
                raise ValueError("wall_clock ran out before the first model call")
            raise _Outcome(Status.TRUNCATED, "wall_clock")
