"""The multi-turn demo environment: guess a hidden number from higher/lower hints.

The episode opens with ``"guess <low>-<high>"``. Each reply must be a whole number in
that range (surrounding spaces are ignored); anything else is the agent's fault and
raises :class:`~dew.objectives.rl.sources.AgentError`. A wrong guess gets ``"higher"``
or ``"lower"``; the right one ends the episode.

Score, as two parts: ``solved`` is 1.0 once the number is found, and ``quick`` adds
``1 / guesses`` on top, so finding it sooner is worth more (at most 2.0 in all). An
episode cut short by a limit or ended by an invalid reply scores what it reached.

The hidden number comes from ``task.data["target"]`` when present, else from the task
id and the environment's seed, so the trainer's id-only tasks are reproducible.

``latency`` seconds are slept in every ``step``, standing in for a tool call or a
remote environment; that is what makes overlapping many rollouts pay off.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping

from dew.core import Task
from dew.objectives.rl.sources.environment import AgentError

__all__ = ["GuessEnv", "make_env", "target_of"]


def target_of(task: Task, *, low: int, high: int, seed: int) -> int:
    """The hidden number of ``task`` (see the module docstring)."""
    if "target" in task.data:
        target = int(task.data["target"])
        if not low <= target <= high:
            raise ValueError(f"task {task.id!r}: target {target} is outside {low}-{high}")
        return target
    return random.Random(f"{seed}:{task.id}").randint(low, high)


class GuessEnv:
    """One episode of the guessing game (an :class:`~dew.objectives.rl.sources.Environment`)."""

    def __init__(
        self,
        *,
        low: int = 0,
        high: int = 9,
        seed: int = 0,
        latency: float = 0.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if low > high:
            raise ValueError(f"low={low} must be <= high={high}")
        if latency < 0:
            raise ValueError(f"latency must be >= 0 seconds, got {latency}")
        self.low, self.high, self.seed = low, high, seed
        self.latency = latency
        self._sleep = sleep
        self.target: int | None = None
        self.guesses = 0
        self.solved = False

    def reset(self, task: Task) -> str:
        self.target = target_of(task, low=self.low, high=self.high, seed=self.seed)
        self.guesses = 0
        self.solved = False
        return f"guess {self.low}-{self.high}"

    def step(self, reply: str) -> str | None:
        if self.target is None:
            raise RuntimeError("step() before reset()")
        if self.latency:
            self._sleep(self.latency)
        text = reply.strip()
        if not (text.isascii() and text.isdigit()):
            raise AgentError(f"reply {reply!r} is not a whole number")
        guess = int(text)
        if not self.low <= guess <= self.high:
            raise AgentError(f"guess {guess} is outside {self.low}-{self.high}")
        self.guesses += 1
        if guess == self.target:
            self.solved = True
            return None
        return "higher" if guess < self.target else "lower"

    def score(self) -> Mapping[str, float]:
        if not self.solved:
            return {"solved": 0.0, "quick": 0.0}
        return {"solved": 1.0, "quick": 1.0 / self.guesses}


def make_env(
    *, low: int = 0, high: int = 9, seed: int = 0, latency: float = 0.0
) -> Callable[[], GuessEnv]:
    """A ``make_env`` for :class:`~dew.objectives.rl.sources.EnvironmentSource`."""
    GuessEnv(low=low, high=high, seed=seed, latency=latency)  # validate the settings now
    return lambda: GuessEnv(low=low, high=high, seed=seed, latency=latency)
