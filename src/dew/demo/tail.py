"""The heavy-tailed workload: long-tailed answer lengths and slow verifiers and tools.

The demo's copy task (see :mod:`dew.demo.tasks`) reshaped the way real RL workloads
are shaped. Real completion lengths are heavy-tailed (a lognormal with p99 several
times the median, a few percent hitting the cap) and rewards come from sandboxes and
tools that take tens to hundreds of milliseconds. A synchronous trainer waits on the
longest completion and the slowest verifier of every batch; that wait is what an
asynchronous scheduler exists to hide, so this is the workload to measure it on.

* **Single-turn** (``dew demo --task tail``): each task's digit string has a length drawn
  once per task from a lognormal (``length_median``, ``length_sigma``), capped at
  ``length_cap``. The answer copies it and stops; the verifier gives position-wise
  credit (:func:`copy_credit`: a right token earns a position, a wrong digit
  ``format_credit`` of one, and tokens past the answer's end dilute the credit, so
  running on costs reward as it costs time) and sleeps a latency drawn per call (lognormal,
  ``latency_median``, ``latency_sigma``) in the source's worker, never in the engine.
* **Multi-turn** (``dew demo --task tail-turns``): an episode has 2-4 turns (drawn per
  task); each turn the environment sends a digit segment (length lognormal with
  ``turn_median``, capped at ``turn_cap``), the model copies it, and the environment
  answers after a tool call of drawn latency (after the last turn that wait is the
  final verification). The reward is the mean of the turns' credits.

Every parameter lives in :class:`Workload`, and :meth:`Workload.describe` is printed
beside every result that comes from it (the demo's summary, the benchmarks).
Lengths are a function of the task id and the seed, so the trainer's id-only tasks and
a benchmark's other system see the same tasks; latencies are drawn per call from the
workload's own seeded stream.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from dew.core import Call, Task, as_int

__all__ = ["TailEnv", "TailTask", "Workload", "copy_credit", "make_tail_task", "turns_max_chain"]


@dataclass(frozen=True)
class Workload:
    """The heavy-tailed workload's parameters (seconds for latencies, tokens for lengths)."""

    length_median: float = 24.0
    length_sigma: float = 0.9
    length_cap: int = 192
    latency_median: float = 0.05
    latency_sigma: float = 0.6
    min_turns: int = 2
    max_turns: int = 4
    turn_median: float = 8.0
    turn_cap: int = 48
    # A digit where another digit belongs earns this share of a position: the format
    # part of the reward, which an untrained model can find before it copies anything.
    format_credit: float = 0.25

    def __post_init__(self) -> None:
        for name in ("length_median", "turn_median"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 1 token")
        for name in ("length_sigma", "latency_sigma", "latency_median"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}={value!r} must be a finite number >= 0")
        if not 0 <= self.format_credit <= 1:
            raise ValueError(f"format_credit={self.format_credit!r} must be in [0, 1]")
        for name in ("length_cap", "turn_cap", "min_turns"):
            object.__setattr__(self, name, as_int(getattr(self, name), name, minimum=1))
        if not isinstance(self.max_turns, int) or self.max_turns < self.min_turns:
            raise ValueError(
                f"max_turns={self.max_turns!r} must be an int >= min_turns={self.min_turns}"
            )

    def length(self, rng: random.Random) -> int:
        """One single-turn answer length: lognormal, at least 1, at most the cap."""
        return _lognormal_int(rng, self.length_median, self.length_sigma, self.length_cap)

    def turn_length(self, rng: random.Random) -> int:
        """One multi-turn segment length: lognormal, at least 1, at most the turn cap."""
        return _lognormal_int(rng, self.turn_median, self.length_sigma, self.turn_cap)

    def latency(self, rng: random.Random) -> float:
        """One verifier or tool latency in seconds (0 when the median is 0)."""
        if self.latency_median == 0:
            return 0.0
        return rng.lognormvariate(math.log(self.latency_median), self.latency_sigma)

    def describe(self) -> str:
        """One line with every parameter, to print beside a result."""
        return (
            f"workload: answer length lognormal(median {self.length_median:g}, sigma "
            f"{self.length_sigma:g}) capped at {self.length_cap} tokens; verifier and tool "
            f"latency lognormal(median {self.latency_median * 1000:g} ms, sigma "
            f"{self.latency_sigma:g}) per call; multi-turn: {self.min_turns}-"
            f"{self.max_turns} turns of lognormal(median {self.turn_median:g}) digits "
            f"capped at {self.turn_cap}; a digit in the wrong place earns "
            f"{self.format_credit:g} of a position"
        )


def _lognormal_int(rng: random.Random, median: float, sigma: float, cap: int) -> int:
    return max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma))))


def copy_credit(
    target: Sequence[int],
    got: Sequence[int],
    *,
    digits: AbstractSet[int] = frozenset(),
    partial: float = 0.0,
) -> float:
    """Position-wise credit of ``got`` against ``target``, over the longer of the two.

    A position where ``got`` has ``target``'s token earns 1; one where both hold tokens
    of ``digits`` but different ones earns ``partial``. A perfect copy scores 1, and
    tokens past the target's end dilute the credit as missing ones do, so an answer
    that runs on past its length is worth less.
    """
    earned = 0.0
    for a, b in zip(target, got, strict=False):
        if a == b:
            earned += 1.0
        elif a in digits and b in digits:
            earned += partial
    return earned / max(len(target), len(got), 1)


def _digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(n))


class _Latency:
    """Latencies drawn per call from one seeded stream, shared by worker threads."""

    def __init__(self, workload: Workload, seed: int, sleep: Callable[[float], None]) -> None:
        self.workload = workload
        self._rng = random.Random(f"latency:{seed}")
        self._lock = threading.Lock()
        self._sleep = sleep

    def wait(self) -> float:
        """Sleep one drawn latency; return it."""
        with self._lock:
            seconds = self.workload.latency(self._rng)
        if seconds:
            self._sleep(seconds)
        return seconds


@dataclass
class TailTask:
    """``n`` tasks of the workload over a tokenizer; task ``str(i)`` is row ``i``.

    ``texts[i]`` is the single-turn digit string of task ``i`` (its prompt is
    ``texts[i] + "="``, token ids in ``prompts[i]``); ``turns[i]`` its multi-turn segments
    (token ids in ``turn_answers[i]``).
    """

    workload: Workload
    texts: list[str]
    prompts: list[list[int]]
    answers: list[list[int]]
    turns: list[tuple[str, ...]]
    turn_answers: list[tuple[list[int], ...]]
    eos: int
    encode: Callable[[str], list[int]]
    digits: frozenset[int]  # the digits' token ids
    sleep: Callable[[float], None] = time.sleep
    seed: int = 0
    _latency: _Latency = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._latency = _Latency(self.workload, self.seed, self.sleep)

    @property
    def max_prompt(self) -> int:
        return max(map(len, self.prompts))

    def verifier(self, task: Task, completion: str | list[int], call: Call) -> dict[str, float]:
        """PromptSource verifier: the copy credit of ``call.completion`` (raw ids, the
        stop token included) against the answer and its stop, after a drawn latency
        slept in the calling (worker) thread."""
        index = self._index(task)
        self._latency.wait()
        got = [int(t) for t in call.completion]
        return {"copy": self.credit([*self.answers[index], self.eos], got)}

    def credit(self, target: Sequence[int], got: Sequence[int]) -> float:
        """:func:`copy_credit` with this workload's format credit for digits."""
        return copy_credit(target, got, digits=self.digits, partial=self.workload.format_credit)

    def env(self) -> TailEnv:
        """A fresh multi-turn episode (the ``make_env`` of an EnvironmentSource)."""
        return TailEnv(self)

    def _index(self, task: Task) -> int:
        try:
            index = int(task.id)
        except ValueError:
            index = -1
        if not 0 <= index < len(self.texts):
            raise ValueError(f"task {task.id!r}: no such task (ids are 0..{len(self.texts) - 1})")
        return index


class TailEnv:
    """One multi-turn episode (an :class:`~dew.objectives.rl.sources.Environment`)."""

    def __init__(self, task: TailTask) -> None:
        self.task = task
        self.index = -1
        self.segments: tuple[str, ...] = ()
        self.credit: list[float] = []

    def reset(self, task: Task) -> str:
        self.index = self.task._index(task)
        self.segments = self.task.turns[self.index]
        self.credit = []
        return self.segments[0] + "="

    def step(self, reply: str) -> str | None:
        if not self.segments:
            raise RuntimeError("step() before reset()")
        turn = len(self.credit)
        # The reply comes without its stop token, so the turn's credit is the digits'
        # alone; a reply that ran on to the token cap is diluted by its extra tokens.
        self.task._latency.wait()  # the tool call (or, after the last turn, the verifier)
        answer = self.task.turn_answers[self.index][turn]
        self.credit.append(self.task.credit(answer, self.task.encode(reply)))
        if turn + 1 < len(self.segments):
            return self.segments[turn + 1] + "="
        return None

    def score(self) -> Mapping[str, float]:
        turns = len(self.segments)
        return {"copy": sum(self.credit) / turns if turns else 0.0}


def make_tail_task(
    n: int,
    *,
    seed: int = 0,
    tokenizer: Any = None,
    workload: Workload | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> TailTask:
    """``n`` tasks of ``workload`` (default: :class:`Workload`'s defaults) over
    ``tokenizer`` (default: the demo's character tokenizer). ``sleep`` is what the
    verifier and the tools wait with (tests pass a recorder)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    workload = workload or Workload()
    if tokenizer is None:
        from dew.demo.model import make_tokenizer

        tokenizer = make_tokenizer()

    from dew.objectives.rl.sources.chat import text_encoder

    encode = text_encoder(tokenizer)

    texts, turns = [], []
    for i in range(n):
        rng = random.Random(f"tail:{seed}:{i}")  # per task: the same task for any n
        texts.append(_digits(rng, workload.length(rng)))
        count = rng.randint(workload.min_turns, workload.max_turns)
        turns.append(tuple(_digits(rng, workload.turn_length(rng)) for _ in range(count)))
    return TailTask(
        workload=workload,
        texts=texts,
        prompts=[encode(t + "=") for t in texts],
        answers=[encode(t) for t in texts],
        turns=turns,
        turn_answers=[tuple(encode(s) for s in segments) for segments in turns],
        eos=int(tokenizer.eos_token_id),
        encode=encode,
        digits=frozenset(encode("0123456789")),
        sleep=sleep,
        seed=seed,
    )


def turns_max_chain(task: TailTask, tokenizer: Any, max_tokens: int) -> int:
    """Longest prompt + completion tokens of one multi-turn episode of ``task``: its
    longest segments, each reply run on to ``max_tokens``."""
    from dew.objectives.rl.sources import ChatTokens

    chat = ChatTokens(tokenizer)
    longest = max(len(s) for turns in task.turns for s in turns)
    message = [{"role": "user", "content": "0" * longest + "="}]
    first = len(chat.first(message))
    between = len(chat.after_reply("0" * max_tokens, False, message))  # unstopped: longest
    turns = task.workload.max_turns
    return first + turns * max_tokens + (turns - 1) * between
