"""How much a delay alone slows learning: growth rates of saved sync and async runs.

Early in a run of the heavy-tailed tasks the reward grows by about the same factor each
step: the more often the policy is right, the more right answers its batches hold to
learn from. An async run learns from batches its policy sampled ``d`` updates ago (the
runs' mean lag), so what it learns at an update comes from a policy that many updates
behind. Take sync's growth per update, ``x[k+1] = x[k] + r * x[k]``; with the same ``r``
and the delay, ``x[k+1] = x[k] + r * x[k-d]``, whose growth factor ``g`` solves
``g**d * (g - 1) = r`` (:func:`delayed_growth`). Steps to a reward in that phase then
scale as ``log(g_sync) / log(g)``. On top of that, the reward an async run reports at
update ``k`` is that of update ``k - d``'s policy, which adds ``d`` steps before it is
seen.

For each ``--load`` folder (saved runs of ``bench/async_steps.py`` or
``bench/vs_trl_tail.py``), the mean reward curve over the seeds of each of two runs
(``--sync``, ``--async``), the growth per update fitted to ``log`` of its 10-step means
while they lie between ``--low`` and ``--high`` (:func:`growth_rate`), async's growth as
the delay predicts it, and the steps ratios, predicted and measured (medians over the
seeds, as the benchmarks give them). With ``--detail``, for each of the two runs also the
step at which its mean curve first reaches each of ``MARKS`` (where along the run the
steps are lost), and where its seconds went (:func:`step_split`). Nothing is run:

    .venv/bin/python bench/async_growth.py --load bench/saved/async_steps_800_turns \\
        --load bench/saved/async_steps_820_turns --load bench/saved/async_steps_830_turns
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _vs_trl_common import WINDOW
from vs_trl import load_results
from vs_trl_tail import reach_steps

MARKS = (0.03, 0.06, 0.09, 0.12)  # rewards whose first step --detail reports
SKIP = 20  # the first steps, slower in every mode, reported apart by --detail


def window_means(curves: Sequence[Sequence[float]]) -> np.ndarray:
    """The mean over runs of each step's reward, averaged over ``WINDOW`` steps ending
    there; the runs cut to the shortest. [runs][steps] -> [steps - WINDOW + 1]."""
    n = min(len(c) for c in curves)
    mean = np.mean([np.asarray(c[:n], dtype=float) for c in curves], axis=0)  # [n]
    return np.convolve(mean, np.ones(WINDOW) / WINDOW, mode="valid")


def first_steps(means: np.ndarray, levels: Sequence[float]) -> list[int | None]:
    """For each level, the 1-based step ending the first window of ``means`` (as
    :func:`window_means` gives them) at or above it; None when none is."""
    out: list[int | None] = []
    for level in levels:
        hits = np.flatnonzero(means >= level)
        out.append(int(hits[0]) + WINDOW if len(hits) else None)
    return out


def step_split(
    step_seconds: Sequence[float], idle: Sequence[float], skip: int = SKIP
) -> tuple[float, float, float, float]:
    """(seconds a step, of it the trainer's wait for its batch, the rest) as means over
    the steps after the first ``skip``, and the mean seconds of those first steps.
    ``step_seconds`` is the clock at the end of each step, ``idle`` each step's wait."""
    took = np.diff(np.asarray(step_seconds, dtype=float), prepend=0.0)  # [steps]
    wait = np.asarray(idle, dtype=float)  # [steps]
    late = slice(skip, None)
    return (
        float(took[late].mean()),
        float(wait[late].mean()),
        float((took - wait)[late].mean()),
        float(took[:skip].mean()),
    )


def growth_rate(means: np.ndarray, low: float, high: float) -> float:
    """The factor the curve grows by per step: ``exp`` of the least-squares slope of
    ``log(means)`` over the steps whose value lies in ``[low, high]``."""
    steps = np.flatnonzero((means >= low) & (means <= high))
    if len(steps) < 3:
        raise ValueError(f"fewer than 3 steps between {low} and {high}")
    slope = np.polyfit(steps, np.log(means[steps]), 1)[0]
    return float(math.exp(slope))


def delayed_growth(r: float, d: float) -> float:
    """The growth factor ``g > 1`` of ``x[k+1] = x[k] + r * x[k-d]``: the root of
    ``g**d * (g - 1) = r`` (bisection; the left side rises with ``g``)."""
    if r <= 0 or d < 0:
        raise ValueError(f"needs r > 0 and d >= 0, got r={r}, d={d}")
    lo, hi = 1.0, 1.0 + r
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mid**d * (mid - 1) < r else (lo, mid)
    return (lo + hi) / 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--load", action="append", required=True, help="a folder of saved runs")
    ap.add_argument("--task", default="tail-turns")
    ap.add_argument("--sync", default="sync", help="the synchronous run's label")
    ap.add_argument("--async", dest="lagged", default="ahead 3", help="the async run's label")
    ap.add_argument("--low", type=float, default=0.015)
    ap.add_argument("--high", type=float, default=0.06)
    ap.add_argument("--detail", action="store_true", help="reward marks and step seconds too")
    args = ap.parse_args()
    details: list[str] = []
    print(
        "| runs | seeds | growth per update, sync | async, measured | async, the delay's "
        "prediction | mean lag | steps async / sync: growth alone | with the delay to see it | "
        "measured |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for folder in args.load:
        runs = load_results(folder, args.task, [args.sync, args.lagged], every=True)
        sync, lagged = runs[args.sync], runs[args.lagged]
        means = {k: window_means([r.rewards for r in runs[k]]) for k in (args.sync, args.lagged)}
        g_sync = growth_rate(means[args.sync], args.low, args.high)
        g_lag = growth_rate(means[args.lagged], args.low, args.high)
        lag = statistics.fmean(r.diagnostics.get("lag", 0.0) for r in lagged)
        g_pred = delayed_growth(g_sync - 1, lag)
        steps = [statistics.median(reach_steps(r) for r in rs) for rs in (sync, lagged)]
        growth = math.log(g_sync) / math.log(g_pred)
        seeds = f"{sync[0].spec.seed}-{sync[-1].spec.seed}"
        print(
            f"| {Path(folder).name} | {seeds} | {g_sync:.4f} | {g_lag:.4f} | {g_pred:.4f} | "
            f"{lag:.2f} | {growth:.3f}x | {growth + lag / steps[0]:.3f}x | "
            f"{steps[1] / steps[0]:.3f}x |"
        )
        if args.detail:
            for label in (args.sync, args.lagged):
                details.append(_detail(Path(folder).name, seeds, label, runs[label], means[label]))
    if args.detail:
        marks = " | ".join(f"{m:g}" for m in MARKS)
        print(
            f"\n| runs | seeds | run | first step at {marks} | seconds a step | trainer waits "
            f"| trainer works | first {SKIP} steps, per step |"
        )
        print("|---|---|---|" + "---:|" * (len(MARKS) + 4))
        print("\n".join(details))


def _detail(name: str, seeds: str, label: str, runs: Sequence[Any], means: np.ndarray) -> str:
    """One --detail row: the reward marks of the runs' mean curve ``means`` (as
    :func:`window_means` gives it), and their step seconds over the seeds (the range,
    lowest to highest)."""
    at = first_steps(means, MARKS)
    split = np.array([step_split(r.step_seconds, r.idle) for r in runs])  # [seeds, 4]
    spans = [f"{lo:.3f}-{hi:.3f}" for lo, hi in zip(split.min(0), split.max(0), strict=True)]
    marks = " | ".join("-" if a is None else str(a) for a in at)
    return f"| {name} | {seeds} | {label} | {marks} | {' | '.join(spans)} |"


if __name__ == "__main__":
    main()
