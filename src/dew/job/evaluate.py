"""Evaluation of a ``dew train`` run: the eval rows, scored by the run's rewards.

Every ``training.eval_every`` steps (and after the last step), each usable row of
``data.eval_path`` gets ``training.eval_samples`` completions from the trainer's own
model at its current weights (a KV-cached decoding loop on the trainer's thread;
greedy when ``training.eval_temperature`` is 0, else sampled at that temperature with
no top-k/top-p filter), with the run's ``max_tokens`` and stop tokens,
scored by the same reward functions as training. Recorded per evaluation, one JSON line
in the run folder's ``eval.jsonl``: the step, the mean reward over all samples, and
``pass@k``, the share of rows with at least one of their k samples scoring at least
``training.eval_pass``. A sample whose reward fails counts as not passing and is
counted in ``errors`` (its first message kept), never scored as 0.

Runs on the trainer's thread between two steps (a ``fit`` log callback), so the
weights do not change under it.

:func:`probe` is the same loop before the first step, on the first training rows: the
reward functions tried on the starting model's own completions, so that a reward that
fails on every one (a column it reads missing or of another type, a value that is not
a number, no function scoring anything) is a config error rather than a run that
trains nothing.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dew.core import Call, SamplingParams, Task, parse_reward
from dew.job.data import Rows
from dew.objectives.rl.sources.chat import ChatTokens
from dew.objectives.rl.sources.prompts import GroupVerifier, Verifier, encode_prompt

__all__ = ["PROBE_ROWS", "PROBE_TOKENS", "evaluate", "probe"]

PROBE_ROWS = 4  # data rows the rewards are tried on before the first step
PROBE_TOKENS = 64  # at most this many tokens of each probe completion


def evaluate(
    model: Any,
    tokenizer: Any,
    rows: Rows,
    verifier: GroupVerifier | Verifier,
    sampling: SamplingParams,
    *,
    samples: int,
    temperature: float,
    threshold: float,
    chat: bool,
    seed: int = 0,
) -> dict[str, Any]:
    """Score ``samples`` completions of every row (see the module docstring)."""
    import torch

    chat_tokens = ChatTokens(tokenizer) if chat else None
    stop = list(sampling.stop_ids) if sampling.stop_ids else [int(tokenizer.eos_token_id)]
    rewards: list[float] = []
    passed = 0
    errors: list[str] = []
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    try:
        for i in range(len(rows)):
            prompt = encode_prompt(
                rows[i][rows.column], f"eval row {i}", tokenizer=tokenizer, chat=chat_tokens
            )
            best = float("-inf")
            made = _generate(model, prompt, sampling, samples, temperature, stop, generator)
            texts, calls = [], []
            for completion in made:
                ended = bool(completion) and completion[-1] in stop
                texts.append(tokenizer.decode(completion[:-1] if ended else completion))
                zeros = [0.0] * len(completion)  # no log-probs: nothing trains on these
                calls.append(
                    Call(prompt=prompt, completion=completion, log_probs=zeros, version=-1)
                )
            for result in _scores(verifier, Task(str(i)), texts, calls):
                if isinstance(result, Exception):  # RewardError: named, counted, never a 0
                    errors.append(str(result))
                    continue
                reward, _ = parse_reward(result)
                rewards.append(reward)
                best = max(best, reward)
            passed += best >= threshold
    finally:
        model.train(was_training)
    return {
        "reward/mean": sum(rewards) / len(rewards) if rewards else float("nan"),
        f"pass@{samples}": passed / len(rows),
        "rows": len(rows),
        "samples": samples,
        "errors": len(errors),
        **({"first_error": errors[0]} if errors else {}),
    }


def _scores(
    verifier: GroupVerifier | Verifier, task: Task, texts: list[str], calls: list[Call]
) -> list[Any]:
    """One result per completion: its parts, or the exception that failed it."""
    if isinstance(verifier, GroupVerifier):
        return list(verifier.score_group(task, texts, calls))
    out: list[Any] = []
    for text, call in zip(texts, calls, strict=True):
        try:
            out.append(verifier(task, text, call))
        except ValueError as exc:  # RewardError: named, counted, never a 0
            out.append(exc)
    return out


def _generate(
    model: Any,
    prompt: list[int],
    sampling: SamplingParams,
    samples: int,
    temperature: float,
    stop: list[int],
    generator: Any,
) -> list[list[int]]:
    """``samples`` completions of ``prompt`` (token ids, stop token kept)."""
    import torch

    device = next(model.parameters()).device
    # transformers 5.x renamed past_key_values to cache; take whichever this model has.
    params = inspect.signature(model.forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"
    out = []
    with torch.no_grad():
        for _ in range(samples):
            ids = torch.tensor([prompt], device=device)
            completion: list[int] = []
            past = None
            for _ in range(sampling.max_tokens):
                result = model(input_ids=ids, use_cache=True, **{cache_kw: past})
                logits = result.logits[0, -1].float()
                past = getattr(result, cache_kw)
                if temperature == 0:
                    token = int(torch.argmax(logits))
                else:
                    probs = torch.softmax(logits / temperature, dim=-1)
                    token = int(torch.multinomial(probs.cpu(), 1, generator=generator))
                completion.append(token)
                if token in stop:
                    break
                ids = torch.tensor([[token]], device=device)
            out.append(completion)
    return out


def recorder(run: Path, evaluate_now: Callable[[], dict[str, Any]], every: int, last: int) -> Any:
    """A ``fit`` log callback: evaluate after every ``every``-th step and the ``last``."""

    def maybe(record: Any) -> None:
        step = int(record["step"])
        if step % every and step != last:
            return
        t0 = time.monotonic()
        result = {"step": step, **evaluate_now(), "seconds": time.monotonic() - t0}
        with open(run / "eval.jsonl", "a") as f:
            f.write(json.dumps(result) + "\n")

    return maybe


def probe(
    model: Any,
    tokenizer: Any,
    rows: Rows,
    verifier: GroupVerifier | Verifier,
    sampling: SamplingParams,
    *,
    chat: bool,
    seed: int,
) -> tuple[int, int, str | None]:
    """The rewards tried on one completion (at most :data:`PROBE_TOKENS` tokens, at the
    sampling temperature) of each of the first :data:`PROBE_ROWS` rows: ``(failed,
    tried, first error)``."""
    first = dataclasses.replace(rows, usable=rows.usable[:PROBE_ROWS], skipped={})
    short = dataclasses.replace(sampling, max_tokens=min(sampling.max_tokens, PROBE_TOKENS))
    temperature = sampling.temperature
    got = evaluate(
        model,
        tokenizer,
        first,
        verifier,
        short,
        samples=1,
        temperature=temperature,
        threshold=math.inf,
        chat=chat,
        seed=seed,
    )
    return int(got["errors"]), len(first), got.get("first_error")
