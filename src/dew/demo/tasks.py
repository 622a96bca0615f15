"""The single-turn demo task: copy a short digit string, then stop.

A prompt is ``"<digits>="`` (for example ``"4071="``); the answer is the same digits
followed by the end-of-sequence token. The verifier gives partial credit position by
position: each digit position the completion got right earns one share, the stop
token right after the last digit earns ``stop_weight`` shares, and the reward is the
earned part of all shares, so it lies in [0, 1] and is reported as two parts,
``digits`` and ``stop``, that sum to it.

Why this task: a randomly initialized model over the ~100-token demo vocabulary
scores about 0.01 (one position in a hundred by chance) and a policy that only learned
to write digits about 0.1, far below anything a trained policy reaches, yet every
correct position is rewarded on its own, so GRPO gets a signal from the first step
and a tiny model learns it on a CPU in minutes. With answers of one fixed length,
every output digit copies the token the same distance back, so one learned attention
pattern serves all positions. The stop credit is adjustable because stopping is far
easier than copying: at full weight it is learned in a few dozen steps and lifts the
reward well above chance before any digit is copied; the demo sets it to 0 and caps
completions at the answer's length instead.

``make_task(n, seed=..., tokenizer=...)`` builds ``n`` tasks with ids ``"0" ..
str(n - 1)`` (the trainer's ``task_id`` rows); the result carries the prompts as token
ids, the verifier in the :class:`~dew.objectives.rl.sources.PromptSource` signature and
the longest prompt.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dew.core import Call, Task

__all__ = ["DigitTask", "make_prompts", "make_task", "score"]


def make_prompts(n: int, *, seed: int = 0, min_digits: int = 2, max_digits: int = 4) -> list[str]:
    """``n`` digit strings of ``min_digits .. max_digits`` digits, the same for a seed."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    rng = random.Random(seed)
    return [
        "".join(rng.choice("0123456789") for _ in range(rng.randint(min_digits, max_digits)))
        for _ in range(n)
    ]


def score(
    answer: Sequence[int], completion: Sequence[int], eos: int, *, stop_weight: float = 1.0
) -> dict[str, float]:
    """Position-wise credit of ``completion`` (raw ids, stop token included) against
    ``answer`` ids followed by ``eos``: each digit position weighs 1 and the stop
    position ``stop_weight``; ``digits`` + ``stop`` = weighted share of positions right."""
    if stop_weight < 0:
        raise ValueError(f"stop_weight must be >= 0, got {stop_weight}")
    target = [*answer, eos]
    got = list(completion)
    right = [i < len(got) and got[i] == t for i, t in enumerate(target)]
    total = len(answer) + stop_weight
    return {"digits": sum(right[:-1]) / total, "stop": stop_weight * right[-1] / total}


@dataclass(frozen=True)
class DigitTask:
    """The built task: ``prompts[i]`` are the token ids of task ``str(i)``."""

    texts: list[str]
    prompts: list[list[int]]
    answers: list[list[int]]
    eos: int
    max_prompt: int
    stop_weight: float = 1.0

    def verifier(self, task: Task, completion: str | list[int], call: Call) -> dict[str, float]:
        """PromptSource verifier: scores ``call.completion`` against the task's digits."""
        completion_ids = [int(t) for t in call.completion]
        answer = self.answers[int(task.id)]
        return score(answer, completion_ids, self.eos, stop_weight=self.stop_weight)


def make_task(
    n: int,
    *,
    seed: int = 0,
    tokenizer: Any = None,
    min_digits: int = 2,
    max_digits: int = 4,
    stop_weight: float = 1.0,
) -> DigitTask:
    """``n`` copy tasks over ``tokenizer`` (default: the demo's character tokenizer)."""
    if tokenizer is None:
        from dew.demo.model import make_tokenizer

        tokenizer = make_tokenizer()
    texts = make_prompts(n, seed=seed, min_digits=min_digits, max_digits=max_digits)

    from dew.objectives.rl.sources.chat import text_encoder

    encode = text_encoder(tokenizer)

    prompts = [encode(t + "=") for t in texts]
    answers = [encode(t) for t in texts]
    return DigitTask(
        texts=texts,
        prompts=prompts,
        answers=answers,
        eos=int(tokenizer.eos_token_id),
        max_prompt=max(map(len, prompts)),
        stop_weight=stop_weight,
    )
