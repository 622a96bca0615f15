"""Where async runs spend extra steps: ablations of dew's knobs, steps to the threshold.

Runs dew on a heavy-tailed task (``dew.demo.tail``) once per seed and variant, the
variants of one seed back to back (one process at a time, as ``bench/vs_trl_tail.py``
does), each until its reward reaches the task's threshold (the mean of the last 10
steps, as there) or ``--max-steps``. A variant is a name and the ``DemoConfig`` fields it
sets on top of the task's tuned settings (``--variant 'ahead 1:ahead=1,max_lag=1'``);
the default set is sync, ahead 2 with the task's settings (no cut, importance cap
and behavior clip) and each of its parts and of the objective's off-policy knobs changed
alone, ahead 3 among them (the benchmark's policy is ahead 2 on tail, 3 on tail-turns).

Figures per variant, over the seeds: steps to the threshold (median and the
distribution-free interval of ``bench/_stats.py``), those steps over the synchronous
run's of the same seed (paired), the reward at step ``--at`` (the mean of the 10 steps
ending there: how far a run had got before the last stretch to the threshold), seconds
per step and to the threshold, how much sooner than the synchronous run each variant got
there (sync's median seconds over its, rounded down as ``bench/vs_trl_tail.py`` rounds
it, and per seed), and from the runs' records: the mean lag of the trained rollouts
(updates), the mean length of the admitted completions and of the cancelled ones when
cut, the KL between the behavior and proximal policies and the share of trained tokens
the behavior clip picks (``GRPOObjective.clip_behavior``; reported whether it is on or
not). The cores other work took during each run are reported too; a table with a run
over ``_stats.QUIET`` is marked as measured under load.

    .venv/bin/python bench/async_steps.py --task tail --seeds 100,101,102,103,104 --write

``--save DIR`` keeps every run's result; ``--load DIR`` renders them again without
running anything (those of ``--seeds`` only, when given); ``--write`` replaces this
task's ``## async steps`` section of bench/RESULTS.md (``--title T``: the section
``## async steps: TASK, T`` instead); ``--tiny`` runs two small steps of two variants
and writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_results.py, _vs_trl_*.py
from _results import provenance_lines, write_section
from _stats import load_summary, median_interval
from _vs_trl_common import WINDOW, RunResult, RunSpec
from vs_trl import load_results, parse_seeds, run_provenance, run_worker, save_result
from vs_trl_tail import THRESHOLDS, paired, ratio_text, reach_seconds, reach_steps

SYNC = "sync"
DEFAULT_SEEDS = "100,101,102,103,104"
_A2 = {"ahead": 2, "max_lag": 2}
# name -> DemoConfig fields on top of the task's tuned ones (ahead and max_lag aside:
# importance cap 10, the behavior clip on both sides). The first is the baseline every
# other is paired with; then ahead 2 without a cut and each of its parts changed alone: no
# behavior clip, one batch ahead or three, the objective's cap of 2, the cut of the
# slowest samples, keys/values recomputed at a push (step lag for every token), the
# masked behavior weight; and ahead 3 (tail-turns' policy) with the engine admitting
# arrivals at every iteration (its admit_wait at 0), and with the behavior clip on each of
# its rules.
VARIANTS: dict[str, dict[str, Any]] = {
    SYNC: {"ahead": 0, "max_lag": 0},
    "ahead 2": _A2,
    "ahead 2, no behavior clip": {**_A2, "clip_behavior": False},
    "ahead 1": {"ahead": 1, "max_lag": 1},
    "ahead 3": {"ahead": 3, "max_lag": 3},
    "ahead 2, cap 2": {**_A2, "importance_cap": 2.0},
    "ahead 2, os 2": {**_A2, "oversample": 2},
    "ahead 2, recompute": {**_A2, "on_load": "recompute"},
    "ahead 2, masked importance": {**_A2, "importance": "mask"},
    "ahead 3, admit at once": {"ahead": 3, "max_lag": 3, "admit_wait": 0},
    "ahead 3, behavior clip both sides": {"ahead": 3, "max_lag": 3, "clip_behavior": "both"},
    "ahead 3, behavior clip negative side": {
        "ahead": 3,
        "max_lag": 3,
        "clip_behavior": "negative",
    },
}


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """``'name:field=value,field=value'`` -> (name, fields); values are Python literals
    where they parse as one (``1``, ``0.5``, ``None``, ``'mask'``), else strings."""
    import ast

    name, sep, body = text.partition(":")
    if not sep or not name.strip():
        raise SystemExit(f"--variant {text!r}: name:field=value[,field=value]")
    if "/" in name:  # the name is part of each saved run's file name (--save)
        raise SystemExit(f"--variant {text!r}: the name {name.strip()!r} may not hold '/'")
    fields: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in body.split(","))):
        key, eq, value = part.partition("=")
        if not eq:
            raise SystemExit(f"--variant {text!r}: {part!r} is not field=value")
        try:
            fields[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            fields[key.strip()] = value.strip()
    return name.strip(), fields


def _spec(task: str, seed: int, fields: dict[str, Any], args: argparse.Namespace) -> RunSpec:
    return RunSpec(
        system="dew",
        task=task,
        seed=seed,
        threads=args.threads,
        max_seconds=args.max_seconds,
        max_steps=args.max_steps,
        stop_at_reward=True,
        threshold=THRESHOLDS[task],
        small=args.tiny,
        overrides=fields,
    )


def run_all(
    task: str, variants: dict[str, dict[str, Any]], args: argparse.Namespace
) -> dict[str, list[RunResult]]:
    results: dict[str, list[RunResult]] = {name: [] for name in variants}
    for seed in args.seeds:
        for name, fields in variants.items():
            result = run_worker(_spec(task, seed, fields, args), timeout=args.max_seconds + 300)
            if args.save:
                save_result(args.save, task, name, result)
            print(
                f"  {task} {name} seed {seed}: {reach_steps(result)} steps to the threshold "
                f"({result.stopped}), {result.seconds_per_step:.3f} s/step, load "
                f"{result.load if result.load is None else round(result.load, 2)}",
                file=sys.stderr,
                flush=True,
            )
            results[name].append(result)
    return results


def reward_at(result: RunResult, step: int) -> float | None:
    """Mean reward of the ``WINDOW`` steps ending at ``step``; a run that reached the
    threshold before it counts at the threshold, one that stopped short of both is None."""
    if result.steps >= step:
        return statistics.fmean(result.rewards[step - WINDOW : step])
    return result.spec.threshold if result.reached() else None


def _span(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return fmt.format(values[0])
    return median_interval(values).text(fmt)


def _seeds(seeds: list[int]) -> str:
    """``[100, 101, 102, 105]`` -> ``"100-102, 105"``."""
    runs: list[list[int]] = []
    for seed in sorted(seeds):
        if runs and seed == runs[-1][-1] + 1:
            runs[-1].append(seed)
        else:
            runs.append([seed])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _mean_of(results: list[RunResult], key: str, fmt: str) -> str:
    values = [r.diagnostics[key] for r in results if key in r.diagnostics]
    return fmt.format(statistics.fmean(values)) if values else "-"


def report(task: str, results: dict[str, list[RunResult]], at: int) -> str:
    threshold = THRESHOLDS[task]
    base = results[SYNC] if SYNC in results else None
    lines = [
        f"| variant | seeds | steps to {threshold}, per seed | median (interval) | / sync's, per "
        f"seed | reward at step {at} | s/step | seconds to {threshold} | sync's seconds / "
        "these, medians; per seed | lag | admitted len | cut len | mismatch KL | "
        "behavior-clipped |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, measured in results.items():
        steps = [float(reach_steps(r)) for r in measured]
        per_seed = ", ".join(f"{reach_steps(r)}" + ("" if r.reached() else "+") for r in measured)
        steps_paired = faster = "-"
        if base is not None and name != SYNC:
            steps_paired = _span(paired(measured, base, reach_steps), "{:.2f}x")
            # the time figure: how much sooner than sync the threshold came
            speedups = _span(paired(base, measured, reach_seconds), "{:.2f}x")
            faster = f"{ratio_text(measured, base)[0]}; {speedups}"
        rewards = [v for r in measured if (v := reward_at(r, at)) is not None]
        lines.append(
            f"| {name} | {_seeds([r.spec.seed for r in measured])} | {per_seed} "
            f"| {_span(steps, '{:.0f}')} | {steps_paired} "
            f"| {_span(rewards, '{:.3f}') if rewards else '-'} "
            f"| {statistics.median(r.seconds_per_step for r in measured):.3f} "
            f"| {_span([reach_seconds(r) for r in measured], '{:.1f}')} | {faster} "
            f"| {_mean_of(measured, 'lag', '{:.2f}')} "
            f"| {_mean_of(measured, 'admitted_len', '{:.1f}')} "
            f"| {_mean_of(measured, 'cut_partial_len', '{:.1f}')} "
            f"| {_mean_of(measured, 'mismatch_kl', '{:.4f}')} "
            f"| {_mean_of(measured, 'behavior_clipped', '{:.2%}')} |"
        )
    machine, _ = load_summary([r.load for rs in results.values() for r in rs])
    lines += [
        "",
        f"- a `+` marks a run that stopped at its step cap before the threshold (counted at "
        f"its cap); a run that reached it before step {at} counts at it there; medians over "
        f"the seeds with their distribution-free interval (`bench/_stats.py`)",
        f"- machine: {machine}",
    ]
    return "\n".join(lines)


def ran_with(measured: list[RunResult]) -> str:
    """What a variant ran with: its fields and, where its runs saved it, the objective
    those resolved to (all seeds of one variant share both)."""
    first = measured[0]
    fields = f"`{first.spec.overrides}`"
    return f"{fields}, trained with `{first.objective}`" if first.objective else fields


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="tail", choices=sorted(THRESHOLDS))
    ap.add_argument(
        "--seeds",
        default=None,
        help=f"comma-separated seeds (default {DEFAULT_SEEDS}; with --load, every saved seed)",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=None,
        help="name:field=value,... (repeatable; default: the ablation set)",
    )
    ap.add_argument("--at", type=int, default=100, help="the step whose reward is compared")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--max-steps", type=int, default=300, help="step cap per run")
    ap.add_argument("--max-seconds", type=float, default=600.0, help="wall cap per run")
    ap.add_argument("--save", default=None, help="folder to keep every run's result in")
    ap.add_argument("--load", default=None, help="render the results saved in this folder")
    ap.add_argument("--tiny", action="store_true", help="two small steps, no write")
    ap.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    ap.add_argument(
        "--title", default=None, help="written as '## async steps: TASK, TITLE' (another section)"
    )
    args = ap.parse_args()
    picked = args.seeds is not None
    args.seeds = parse_seeds(args.seeds if picked else DEFAULT_SEEDS)
    args.dew_threads = args.threads  # what run_provenance reads
    variants = dict(parse_variant(v) for v in args.variant) if args.variant else dict(VARIANTS)
    if not args.seeds or min(args.threads, args.max_steps, args.at) < 1:
        raise SystemExit("need a seed, and --threads, --max-steps and --at >= 1")
    if args.at < WINDOW:
        raise SystemExit(f"--at {args.at}: at least {WINDOW}, the reward window")
    if args.tiny:
        args.seeds, args.max_steps, args.at, args.write = [0], 2, WINDOW, False
        variants = dict(list(variants.items())[:2])
    if args.save:
        Path(args.save).mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if args.load:
        results = load_results(args.load, args.task, list(variants))
        if picked:  # only these seeds' saved runs, say to render a half of them
            results = {
                name: kept
                for name, runs in results.items()
                if (kept := [r for r in runs if r.spec.seed in args.seeds])
            }
            if not results:
                raise SystemExit(f"--load {args.load}: no saved runs of seeds {args.seeds}")
    else:
        results = run_all(args.task, variants, args)
    elapsed = time.monotonic() - t0
    seeds = sorted({r.spec.seed for rs in results.values() for r in rs})
    text = (
        f"### {args.task} (seeds {', '.join(map(str, seeds))})\n\n"
        + "\n".join(f"- {name}: {ran_with(measured)}" for name, measured in results.items())
        + "\n\n"
        + report(args.task, results, args.at)
    )
    print(text)
    print(f"\nbench wall time: {elapsed:.0f} s")
    run = run_provenance("async_steps.py", elapsed, args)
    if args.write:
        title = args.task if args.title is None else f"{args.task}, {args.title}"
        write_section(
            f"## async steps: {title}\n\n{__doc__.split(chr(10) + chr(10))[1]}\n\n"
            f"{provenance_lines(run)}\n{text}\n"
        )
        print("wrote the async steps section of bench/RESULTS.md")


if __name__ == "__main__":
    main()
