"""What both sides of bench/vs_trl.py share: the run spec a worker gets, the result it
hands back, the time-to-reward rule, and the two-turn copy environment.

Time to reward: the clock starts when training starts (dew: ``fit`` is called; TRL:
``on_train_begin``, after the trainer has built its optimizer and data loader) and is
read at the end of every optimizer step. The target is reached at the first step whose
last ``WINDOW`` per-step mean rewards average at least ``THRESHOLD``; fewer than
``WINDOW`` steps never count, so one lucky batch cannot end a run.

The two-turn task is the demo's copy task spread over a conversation: the user sends
three digits and ``=``, the model answers them, the environment (after ``latency``
seconds, standing in for a tool or a remote service) sends three more, the model
answers those. Each turn is scored with the demo's own verifier
(:func:`dew.demo.tasks.score`, digits only), and the reward is the mean over the two
turns, so it lies in [0, 1] like the single-turn task's. It learns for the same reason
the single-turn task does: every answer digit copies the token a fixed distance back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dew.core import Task

THRESHOLD = 0.6
WINDOW = 10
TURNS = 2
DIGITS = 3  # digits per turn (the demo's single-turn task copies 3)
SYSTEMS = ("dew", "trl")
TASK_KINDS = ("single", "multi", "tail", "tail-turns")
TAIL_TASKS = ("tail", "tail-turns")  # the heavy-tailed workload (dew.demo.tail)


@dataclass(frozen=True)
class RunSpec:
    """One training run, as the orchestrator hands it to a worker process."""

    system: str  # "dew" | "trl"
    task: str  # "single" | "multi"
    seed: int
    threads: int
    max_seconds: float
    max_steps: int
    stop_at_reward: bool  # end the run once the time-to-reward target is reached
    ahead: int = 1  # dew only: batches generated ahead of the trainer
    oversample: int = 0  # dew only: extra rollouts per group, the slowest cancelled
    engines: int = 0  # dew only: 0 the in-process engine, N a fleet of N engine processes
    latency: float = 0.02  # multi only: seconds slept in every environment step
    threshold: float = THRESHOLD  # the reward the time-to-reward clock waits for
    small: bool = False  # a smoke run: 2 tasks x 4 samples of at most 16 tokens per step
    # dew only: DemoConfig fields set on top of the task's tuned ones (an ablation's knobs)
    overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.system not in SYSTEMS:
            raise ValueError(f"system={self.system!r} is not one of {SYSTEMS}")
        if self.task not in TASK_KINDS:
            raise ValueError(f"task={self.task!r} is not one of {TASK_KINDS}")
        for name in ("threads", "max_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 1")
        if not self.max_seconds > 0:
            raise ValueError(f"max_seconds={self.max_seconds!r} must be > 0")
        if self.overrides and self.system != "dew":
            raise ValueError(f"overrides={self.overrides!r}: only dew's runs take them")
        if min(self.ahead, self.latency, self.oversample, self.engines) < 0:
            raise ValueError(
                f"ahead={self.ahead}, oversample={self.oversample}, engines={self.engines} "
                f"and latency={self.latency} must be >= 0"
            )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        return cls(**json.loads(text))


@dataclass
class RunResult:
    """What a worker measured; ``step_seconds[i]`` is the clock at the end of step i+1."""

    spec: RunSpec
    rows: int  # completions (rollouts) trained per step
    rewards: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    # seconds of each step the trainer spent waiting for its batch (dew: the scheduler's
    # wait; TRL: generation and scoring, which its trainer runs instead of training)
    idle: list[float] = field(default_factory=list)
    stopped: str = "steps"  # why the run ended: "reward", "seconds" or "steps"
    peak_rss_mb: float = 0.0  # the worker process's peak resident memory
    # cores other work took during the run (bench/_stats.OtherLoad; None: not measured)
    load: float | None = None
    # dew only: the run's mean of some per-step record figures (see _vs_trl_dew.DIAGNOSTICS)
    diagnostics: dict[str, float] = field(default_factory=dict)
    # dew only: the objective it trained with (its repr: the task's defaults resolved, which
    # the spec's overrides alone do not say); "" in runs saved before it was kept
    objective: str = ""

    @property
    def steps(self) -> int:
        return len(self.rewards)

    @property
    def seconds(self) -> float:
        """Wall seconds of training: from the start to the end of the last step."""
        return self.step_seconds[-1] if self.step_seconds else 0.0

    @property
    def completions_per_second(self) -> float:
        return self.steps * self.rows / self.seconds if self.seconds > 0 else 0.0

    @property
    def seconds_per_step(self) -> float:
        return self.seconds / self.steps if self.steps else 0.0

    @property
    def idle_share(self) -> float:
        """Share of the training wall time the trainer waited for batches."""
        return sum(self.idle) / self.seconds if self.seconds > 0 else 0.0

    def reached(self) -> tuple[int, float] | None:
        """(step, seconds) at which the reward target was reached, or None."""
        return time_to_reward(self.rewards, self.step_seconds, threshold=self.spec.threshold)

    def final_reward(self) -> float:
        """Mean reward of the last ``WINDOW`` steps (all of them when fewer)."""
        tail = self.rewards[-WINDOW:]
        return sum(tail) / len(tail) if tail else float("nan")

    def to_json(self) -> str:
        out = dataclasses.asdict(self)
        out["spec"] = dataclasses.asdict(self.spec)
        return json.dumps(out)

    @classmethod
    def from_json(cls, text: str) -> RunResult:
        raw = json.loads(text)
        raw["spec"] = RunSpec(**raw["spec"])
        return cls(**raw)


def demo_config(spec: RunSpec) -> Any:
    """The demo's tuned settings with the spec's seed and policy: the single-turn task's
    (``DemoConfig.for_task("single")``) for the copy tasks, the heavy-tailed tasks' own
    for those, then the spec's ``overrides``; both systems are configured from it."""
    from dew.demo.run import DemoConfig

    task = spec.task if spec.task in TAIL_TASKS else "single"
    small: dict[str, Any] = {}
    if spec.small:
        tuned = DemoConfig.for_task(task)
        small = {"batch_size": 2, "group_size": 4, "max_tokens": min(tuned.max_tokens, 16)}
    knobs = {
        "seed": spec.seed,
        "ahead": spec.ahead,
        "max_lag": max(1, spec.ahead),
        "oversample": spec.oversample,
        "engines": spec.engines,
        **small,
        **spec.overrides,  # an ablation's knobs win over the policy's
    }
    return DemoConfig.for_task(task, **knobs)


def time_to_reward(
    rewards: Sequence[float],
    seconds: Sequence[float],
    *,
    threshold: float = THRESHOLD,
    window: int = WINDOW,
) -> tuple[int, float] | None:
    """(1-based step, seconds) of the first full ``window`` of per-step rewards whose mean
    is at least ``threshold``; None when no window gets there."""
    if len(rewards) != len(seconds):
        raise ValueError(f"rewards ({len(rewards)}) and seconds ({len(seconds)}) differ in length")
    for end in range(window, len(rewards) + 1):
        if math.fsum(rewards[end - window : end]) / window >= threshold:  # exact sums
            return end, seconds[end - 1]
    return None


class StepClock:
    """Collects per-step rewards against a monotonic clock and says when to stop."""

    def __init__(self, spec: RunSpec, result: RunResult) -> None:
        self.spec, self.result = spec, result
        self._t0: float | None = None

    def start(self) -> None:
        self._t0 = time.monotonic()

    def step(self, reward: float, idle: float) -> bool:
        """Record one finished step (``idle``: seconds of it the trainer waited); True
        when the run should end now."""
        if self._t0 is None:
            raise RuntimeError("StepClock.step() before start()")
        elapsed = time.monotonic() - self._t0
        self.result.rewards.append(float(reward))
        self.result.step_seconds.append(elapsed)
        self.result.idle.append(float(idle))
        if self.spec.stop_at_reward and self.result.reached() is not None:
            self.result.stopped = "reward"
            return True
        if elapsed >= self.spec.max_seconds:
            self.result.stopped = "seconds"
            return True
        return self.result.steps >= self.spec.max_steps


# ------------------------------------------------------------------ the two-turn copy task


@dataclass(frozen=True)
class TwoTurnTask:
    """``parts[i]`` are the digit strings of task ``str(i)``, one per turn."""

    parts: list[tuple[str, ...]]
    answers: list[tuple[list[int], ...]]
    eos: int
    encode: Callable[[str], list[int]]


def make_two_turn(n: int, *, seed: int, tokenizer: Any) -> TwoTurnTask:
    """``n`` two-turn copy tasks over ``tokenizer`` (the demo's char tokenizer)."""
    from dew.demo.tasks import make_prompts

    texts = make_prompts(n * TURNS, seed=seed, min_digits=DIGITS, max_digits=DIGITS)

    def encode(text: str) -> list[int]:
        return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]

    parts = [tuple(texts[i * TURNS : (i + 1) * TURNS]) for i in range(n)]
    answers = [tuple(encode(p) for p in task) for task in parts]
    return TwoTurnTask(parts=parts, answers=answers, eos=int(tokenizer.eos_token_id), encode=encode)


class TwoTurnCopyEnv:
    """One episode (an :class:`~dew.objectives.rl.sources.Environment`); see module docstring."""

    def __init__(
        self, task: TwoTurnTask, *, latency: float, sleep: Callable[[float], None] = time.sleep
    ) -> None:
        from dew.demo.tasks import score  # the single-turn task's verifier, digits only

        if latency < 0:
            raise ValueError(f"latency must be >= 0 seconds, got {latency}")
        self.task, self.latency, self._sleep = task, latency, sleep
        self._score = score
        self.index: int | None = None
        self.credit: list[float] = []

    def reset(self, task: Task) -> str:
        index = int(task.id)
        if not 0 <= index < len(self.task.parts):
            raise ValueError(f"task {task.id!r}: no such two-turn task")
        self.index, self.credit = index, []
        return self.task.parts[index][0] + "="

    def step(self, reply: str) -> str | None:
        if self.index is None:
            raise RuntimeError("step() before reset()")
        if self.latency:
            self._sleep(self.latency)
        turn = len(self.credit)
        answer = self.task.answers[self.index][turn]
        got = self._score(answer, self.task.encode(reply), self.task.eos, stop_weight=0.0)
        self.credit.append(got["digits"])
        if turn + 1 < TURNS:
            return self.task.parts[self.index][turn + 1] + "="
        return None

    def score(self) -> Mapping[str, float]:
        return {
            f"turn{i + 1}": self.credit[i] / TURNS if i < len(self.credit) else 0.0
            for i in range(TURNS)
        }


def two_turn_max_chain(tokenizer: Any, max_tokens: int) -> int:
    """Longest prompt + completion tokens of one two-turn episode."""
    from dew.objectives.rl.sources import ChatTokens

    chat = ChatTokens(tokenizer)
    message = [{"role": "user", "content": "0" * DIGITS + "="}]
    first = len(chat.first(message))
    between = len(chat.after_reply("0" * max_tokens, False, message))  # unstopped: longest
    return first + TURNS * max_tokens + (TURNS - 1) * between
