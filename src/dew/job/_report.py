"""What ``dew train`` tells the user on screen as the run goes, and at its end.

Everything here reads what the run already records (the step records, ``eval.jsonl``),
so the screen never says something the run folder does not hold:

* rows of the data that were skipped, and where they are listed;
* the first failure of each reward function and kind (the exception type), with the
  step it happened in; every failed attempt is in that step's record, under ``errors``;
* early in the run, a warning when most samples are masked (cut at
  ``sampling.max_tokens`` and trained on nothing), naming the knobs;
* every ``output.samples_every`` steps, ``output.samples`` trained samples (prompt,
  completion, reward, advantage) to ``samples.jsonl``, and to W&B as a table;
* at the end, a summary: steps, time, reward at the start and the end, the last
  evaluation, and where the export and the plot are.

Printed by the writer process alone (rank 0), to stderr, where the progress bar is.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["masked_warning", "reward_failures", "samples", "say", "skipped", "summary"]

SAMPLE_COLUMNS = ("step", "task", "sample", "prompt", "completion", "reward", "advantage")

# "key: infra_error: verifier failed: reward NAME raised Kind: message" (or another
# failure of NAME, such as a bad value or a timeout, after "reward NAME").
_REWARD = re.compile(r"verifier failed: (?:RewardError: )?reward (\S+?):? (.*)$")
MASKED_WARN_SHARE = 0.5  # a larger masked share in the first steps is worth a word
_EARLY_STEPS = 3


def say(text: str) -> None:
    print(f"dew train: {text}", file=sys.stderr, flush=True)


def skipped(count: int, total: int, listed: Path) -> None:
    if count:
        say(
            f"{count} of {total} data rows skipped (empty, or too long for the context "
            f"with sampling.max_tokens): listed in {listed}"
        )


def reward_failures() -> Callable[[Mapping[str, Any]], None]:
    """A ``fit`` log callback: the first failure of each reward and kind, on screen."""
    seen: set[tuple[str, str]] = set()

    def show(record: Mapping[str, Any]) -> None:
        errors: Sequence[str] = record.get("errors", ())
        failed = [m for e in errors if (m := _REWARD.search(e))]
        for match in failed:
            name, what = match.groups()
            kind = what.split(":", 1)[0]
            if (name, kind) in seen:
                continue
            seen.add((name, kind))
            say(
                f"step {record['step']}: reward {name} failed: {what} (that attempt is "
                "retried, up to scheduler.max_attempts; every failure is in records.jsonl "
                "under errors; this kind is shown once)"
            )

    return show


def masked_warning() -> Callable[[Mapping[str, Any]], None]:
    """A ``fit`` log callback: one warning when an early step masks most samples."""
    warned = False

    def check(record: Mapping[str, Any]) -> None:
        nonlocal warned
        step = int(record["step"])
        if warned or step > _EARLY_STEPS:
            return
        metrics = record.get("scheduler", {}).get("metrics", {})
        share = float(metrics.get("masked_share", 0.0))
        if share > MASKED_WARN_SHARE:
            warned = True
            say(
                f"step {step}: {share:.0%} of the samples were masked and trained nothing "
                "(cut at sampling.max_tokens while scheduler.truncation = 'mask'): raise "
                "sampling.max_tokens, or set scheduler.truncation = 'score' to train on "
                "their rewards"
            )

    return check


def samples(
    path: Path,
    every: int,
    count: int,
    scheduler: Any,
    decode: Callable[[Sequence[int]], str],
    table: Callable[[int, Sequence[str], list[list[Any]]], None] | None = None,
    *,
    resumed_at: int = 0,
) -> Callable[[Mapping[str, Any]], None]:
    """A ``fit`` log callback: every ``every`` steps, the first ``count`` rollouts the
    step trained (``scheduler.last_samples``, group by group) as JSON lines of ``path``,
    and to ``table`` (W&B's) when given. A run resumed at step ``resumed_at`` first
    drops the lines of the steps it trains again, as ``records.jsonl`` does."""
    if path.exists():
        kept = [r for r in _jsonl(path) if int(r["step"]) <= resumed_at]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def log(record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        if step % every:
            return
        rows = []
        for rollout, advantage in list(scheduler.last_samples)[:count]:
            call = rollout.calls[0] if rollout.calls else None
            rows.append(
                [
                    step,
                    rollout.task.id,
                    rollout.key.sample,
                    "" if call is None else decode(call.prompt),
                    "" if call is None else decode(call.completion),
                    rollout.reward,
                    advantage,
                ]
            )
        with path.open("a") as f:
            for row in rows:
                f.write(json.dumps(dict(zip(SAMPLE_COLUMNS, row, strict=True))) + "\n")
        if table is not None and rows:
            table(step, SAMPLE_COLUMNS, rows)

    return log


def summary(run: Path, seconds: float) -> list[str]:
    """The end of a run in a few lines (from ``records.jsonl`` and ``eval.jsonl``)."""
    records = _jsonl(run / "records.jsonl")
    if not records:
        return [f"no step recorded in {run}"]
    rewards = [
        r["scheduler"]["metrics"]["reward/mean"]
        for r in records
        if "reward/mean" in r.get("scheduler", {}).get("metrics", {})
    ]
    tokens = [int(r.get("trained_tokens", 0)) for r in records]
    lines = [
        f"{records[-1]['step']} steps in {seconds:.0f} s; trained tokens per step: "
        f"{tokens[0]} at the first, {sum(tokens) / len(tokens):.0f} on average"
    ]
    if rewards:
        k = max(1, min(5, len(rewards) // 4))
        first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
        lines.append(
            f"mean reward {first:.3f} over the first {k} steps, {last:.3f} over the last {k}"
        )
    evals = _jsonl(run / "eval.jsonl")
    if evals:
        e = evals[-1]
        passed = next((f"{k} {v:.3f}" for k, v in e.items() if k.startswith("pass@")), "")
        lines.append(
            f"evaluation at step {e['step']}: mean reward {e['reward/mean']:.3f}, {passed}"
        )
    return lines


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
