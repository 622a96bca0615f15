"""End to end against Hugging Face TRL on the heavy-tailed workload (``dew.demo.tail``).

Where ``bench/vs_trl.py`` measures per-step overhead on three-token answers, this is the
workload asynchronous RL is for: answer lengths drawn from a lognormal with a long tail
up to the token cap, and a verifier (single-turn, ``tail``) or tool calls between turns
(multi-turn, ``tail-turns``) that take a drawn 10-300 ms each. Its parameters are
printed with the figures.

Per task, four runs per repetition, interleaved (one process at a time, so all see
the same background load): dew with ``--policy`` (scheduler ahead / oversample), the
same on a fleet of ``--fleet`` engine processes (``dew serve``, local; 0 leaves it out),
dew synchronous (``ahead=0``) and TRL's ``GRPOTrainer``, all from the demo's tuned settings
for the task (``DemoConfig.for_task``: the same model, initial weights, group size,
batch, learning rate, sampling and step cap; see ``_vs_trl_trl.grpo_config``). TRL
verifies a batch on a thread pool and runs the multi-turn episodes through
``rollout_func`` with the tools stepped concurrently (see ``_vs_trl_trl``).

Figures per run: wall seconds to reach the task's reward threshold (the mean over the
last 10 steps; a run ends there or at ``--max-steps``), completions per second, the
share of the wall time the trainer waited for its batch (dew: the scheduler's wait;
TRL: generation and scoring, during which its trainer does not train) and the peak
resident memory of the run's process (the fleet's engine processes not counted), and
the cores other work took during it (``bench/_stats.py``). Medians over the seeds, each
with its distribution-free interval, and each ratio also seed by seed (paired: the
runs of one seed see the same tasks and initial weights). Speed ratios are other seconds
over dew's (or dew's completions/s over the other's), so above 1 means dew is faster,
rounded down; the steps ratio, dew async's steps to the threshold over dew sync's, is
rounded up: either way a ratio shown at its target meets it. A run that never reached
the threshold counts as its whole length (a bound, ">"). No target counts as met when
any run had other work take more than ``_stats.QUIET`` cores.
``--save DIR`` keeps every run's raw result as JSON, and the command, wall time and
load of the whole run; ``--load DIR`` renders those again without running anything
(with ``--write``, under the saved run's command and times).

    .venv/bin/python bench/vs_trl_tail.py --seeds 200,201,202,203,204 --fleet 0 --write

dew's runs take one torch thread and TRL's two unless ``--dew-threads`` and ``--threads``
say otherwise: each system's faster count on two cores (see ``bench/vs_trl.py``).
``--write`` replaces the ``## vs trl: heavy-tailed workload`` section of
bench/RESULTS.md and its summary rows; ``--tiny`` runs two small steps (2 tasks x 4
samples of at most 16 tokens) of everything once and writes nothing.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_results.py, _vs_trl_*.py
import _results
from _results import provenance_lines, write_section, write_summary_row
from _stats import load_summary, median_interval, paired_ratios
from _vs_trl_common import WINDOW, RunResult, RunSpec
from dew.demo.tail import Workload
from vs_trl import (
    DEW_THREADS,
    load_results,
    median_reach,
    parse_seeds,
    reach_cell,
    run_provenance,
    run_worker,
    save_result,
    speed_ratio,
    threads_of,
)

RESULTS = _results.RESULTS
# The reward each task's runs race to, well above what an untrained model scores (about
# 0.01). Measured with the demo's settings (2026-12-03, seed 0): single-turn reached a
# 20-step mean of 0.15 after about 140 steps and 0.19 at 250; multi-turn 0.15 after
# about 190 and 0.16 at 220. Both plateau slowly after that, so higher thresholds would
# measure the step cap, not the speed.
THRESHOLDS = {"tail": 0.15, "tail-turns": 0.15}
# Targets of the comparison (ratios of seconds to the threshold, medians).
TARGETS = {"tail": 3.0, "tail-turns": 3.0}
SYNC_TARGET = 1.8
# Steps to the threshold, async over sync (medians): staleness may cost at most this.
STEPS_TARGET = 1.15
# dew's policy per task: batches ahead, no cut. The ablations of bench/async_steps.py
# chose them (bench/RESULTS.md, "async steps" and profile item 46). Each batch more
# ahead makes a step cheaper (the trainer waits less for the slowest group) and every
# trained rollout one update older. On tail, where a step is short, the older rollouts
# cost steps: two ahead keeps both of its targets clear of their limits, where three
# leaves the steps at the edge. On tail-turns the episodes' tool calls make the step
# long and the seconds the tight target, so it keeps three (two ahead took fewer steps
# on held-out seeds but missed the seconds: profile item 50). A cut of the slowest samples
# falls on the longest answers and costs steps; `dew plan`'s tail preset gives every
# sample of a group the same length, so it cannot see that.
PLANNED = {"tail": "2", "tail-turns": "3"}


@dataclass(frozen=True)
class Policy:
    """dew's scheduling policy for the run (``--policy ahead[,os=N]``)."""

    ahead: int = 1
    oversample: int = 0

    @classmethod
    def parse(cls, text: str) -> Policy:
        head, *rest = text.split(",")
        try:
            ahead = int(head)
            extra = dict(part.split("=", 1) for part in rest)
            oversample = int(extra.pop("os", 0))
        except ValueError:
            raise SystemExit(f"--policy {text!r}: ahead[,os=N], e.g. 2,os=2") from None
        if extra or ahead < 0 or oversample < 0:
            raise SystemExit(f"--policy {text!r}: ahead[,os=N] with whole numbers >= 0")
        return cls(ahead, oversample)

    def label(self, engines: int = 0) -> str:
        parts = [f"ahead {self.ahead}"]
        if self.oversample:
            parts.append(f"os {self.oversample}")
        if engines:
            parts.append(f"{engines} engine processes")
        return f"dew ({', '.join(parts)})"


@dataclass(frozen=True)
class Run:
    """One of the compared runs."""

    label: str
    system: str
    ahead: int = 1
    oversample: int = 0
    engines: int = 0


def saved_policy(folder: str, task: str) -> Policy:
    """The policy of the in-process dew runs saved in ``folder`` for ``task``, read off
    their specs (so ``--load`` renders runs made under an earlier default)."""
    specs = [
        RunResult.from_json(path.read_text()).spec
        for path in Path(folder).glob(f"{task}-dew_(ahead_*.json")
        if "engine_processes" not in path.name
    ]
    found = {(spec.ahead, spec.oversample) for spec in specs}
    if len(found) != 1:
        saved = found or "none"
        raise SystemExit(f"--load {folder}: pass --policy (saved {task} policies: {saved})")
    return Policy(*found.pop())


def task_policies(tasks: list[str], policy: str | None, load: str | None) -> dict[str, Policy]:
    """dew's policy for each task: ``--policy`` on all of them when given, else the saved
    runs' own (``--load``), else :data:`PLANNED`."""
    if policy is not None:
        return {task: Policy.parse(policy) for task in tasks}
    if load:
        return {task: saved_policy(load, task) for task in tasks}
    return {task: Policy.parse(PLANNED[task]) for task in tasks}


def _runs(policy: Policy, fleet: int) -> list[Run]:
    """dew with the policy, the same on a fleet (when ``fleet``), dew sync, TRL."""
    ours = Run(policy.label(), "dew", policy.ahead, policy.oversample)
    runs = [ours]
    if fleet:
        runs.append(Run(policy.label(fleet), "dew", policy.ahead, policy.oversample, fleet))
    return [*runs, Run("dew sync (ahead 0)", "dew", 0), Run("TRL GRPOTrainer", "trl")]


def run_task(task: str, runs: list[Run], args: argparse.Namespace) -> dict[str, list[RunResult]]:
    results: dict[str, list[RunResult]] = {run.label: [] for run in runs}
    for seed in args.seeds:
        for run in runs:
            spec = RunSpec(
                system=run.system,
                task=task,
                seed=seed,
                threads=threads_of(run.system, args),
                max_seconds=args.max_seconds,
                max_steps=args.max_steps,
                stop_at_reward=True,
                ahead=run.ahead,
                oversample=run.oversample,
                engines=run.engines,
                threshold=THRESHOLDS[task],
                small=args.tiny,
            )
            result = run_worker(spec, timeout=args.max_seconds + 300)
            if args.save:
                save_result(args.save, task, run.label, result)
            print(
                f"  {task} {run.label} seed {seed}: {result.steps} steps in "
                f"{result.seconds:.1f} s, {reach_cell(result)}, idle "
                f"{result.idle_share:.0%}, peak RSS {result.peak_rss_mb:,.0f} MB",
                file=sys.stderr,
                flush=True,
            )
            results[run.label].append(result)
    return results


def _down(ratio: float) -> str:
    """``ratio`` with two decimals, rounded down: 1.7993 reads 1.79, never 1.80."""
    return f"{math.floor(ratio * 100) / 100:.2f}x"


def _up(ratio: float) -> str:
    """``ratio`` with two decimals, rounded up: for a ratio that must stay under a
    target, 1.1501 reads 1.16, never 1.15."""
    return f"{math.ceil(ratio * 100 - 1e-9) / 100:.2f}x"


def reach_steps(result: RunResult) -> int:
    """Steps to the threshold; a run that never got there counts at its whole length."""
    reached = result.reached()
    return result.steps if reached is None else reached[0]


def reach_seconds(result: RunResult) -> float:
    """Seconds to the threshold; a run that never got there counts at its whole length."""
    reached = result.reached()
    return result.seconds if reached is None else reached[1]


def _by_seed(results: list[RunResult], of: Any) -> dict[int, float]:
    return {r.spec.seed: float(of(r)) for r in results}


def _interval_text(values: list[float], fmt: str, unit: str = "") -> str:
    span = median_interval(values)
    if len(values) == 1:
        return f"{fmt.format(span.median)}{unit} (one seed: no interval)"
    return f"{span.text(fmt, unit)}, {span.coverage:.1%} interval"


def ratio_text(ours: list[RunResult], other: list[RunResult]) -> tuple[str, float | None]:
    """(text, ratio) of other's median seconds to the threshold over ours; a lower
    bound ('>') when other's median run never got there, counted at its whole length."""
    mine, _ = median_reach(ours)
    theirs, _ = median_reach(other)
    ratio = speed_ratio(mine, theirs)
    if ratio is None:
        return "n/a (neither reached it)", None
    if ratio == float("inf"):
        bound = statistics.median(r.seconds for r in other) / mine
        return f"> {_down(bound)} (not reached in its run)", bound
    return _down(ratio), ratio


def steps_ratio(ours: list[RunResult], sync: list[RunResult]) -> float:
    """Median steps to the threshold of ``ours`` over ``sync``'s (unreached runs at
    their whole length)."""
    mine = statistics.median(reach_steps(r) for r in ours)
    return mine / statistics.median(reach_steps(r) for r in sync)


def paired(top: list[RunResult], bottom: list[RunResult], of: Any) -> list[float]:
    """The per-seed ratios ``of(top) / of(bottom)``, in seed order."""
    return paired_ratios(_by_seed(top, of), _by_seed(bottom, of))


def paired_text(top: list[RunResult], bottom: list[RunResult], of: Any) -> str:
    """The per-seed ratios ``of(top) / of(bottom)``: median and interval."""
    return f"per seed {_interval_text(paired(top, bottom, of), '{:.2f}', 'x')}"


def load_text(results: dict[str, list[RunResult]]) -> tuple[str, bool]:
    """(what the load was, whether every run had a quiet machine)."""
    text, quiet = load_summary([r.load for rs in results.values() for r in rs])
    return (text, True) if quiet else (f"{text}: no target counts", False)


def report(task: str, runs: list[Run], results: dict[str, list[RunResult]]) -> tuple[str, list]:
    """The task's table, its ratios, and its summary rows."""
    threshold = THRESHOLDS[task]
    lines = [
        f"| run | seed | time to reward {threshold} | steps | completions/s | s/step "
        "| trainer idle | other load | peak RSS |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def load_cell(r: RunResult) -> str:
        return "-" if r.load is None else f"{r.load:.2f}"

    for label, measured in results.items():
        for r in measured:
            lines.append(
                f"| {label} | {r.spec.seed} | {reach_cell(r)} | {r.steps} "
                f"| {r.completions_per_second:,.0f} | {r.seconds_per_step:.3f} "
                f"| {r.idle_share:.0%} | {load_cell(r)} | {r.peak_rss_mb:,.0f} MB |"
            )
        _, cell = median_reach(measured)
        steps = median_interval([reach_steps(r) for r in measured])
        lines.append(
            f"| {label} | median | {cell} | {steps.median:g} "
            f"| {statistics.median(r.completions_per_second for r in measured):,.0f} "
            f"| {statistics.median(r.seconds_per_step for r in measured):.3f} "
            f"| {statistics.median(r.idle_share for r in measured):.0%} | "
            f"| {statistics.median(r.peak_rss_mb for r in measured):,.0f} MB |"
        )
    ours, *others = (run.label for run in runs if run.label in results)
    sync, trl = "dew sync (ahead 0)", "TRL GRPOTrainer"

    def rate(label: str) -> float:
        return statistics.median(r.completions_per_second for r in results[label])

    lines.append("")
    lines.append(
        f"- steps to reward {threshold} (a run that never got there counts at its whole "
        "length), median and distribution-free interval over the seeds:"
    )
    for label, measured in results.items():
        values = [float(reach_steps(r)) for r in measured]
        lines.append(f"  - {label}: {_interval_text(values, '{:.0f}')}")
    ratios: dict[str, tuple[str, float | None]] = {}
    for other in others:
        ratios[other] = ratio_text(results[ours], results[other])
        lines.append(
            f"- {other} seconds to reward {threshold} / {ours}'s (medians): "
            f"{ratios[other][0]}, {paired_text(results[other], results[ours], reach_seconds)}; "
            f"completions/s, {ours} / {other}: {_down(rate(ours) / rate(other))}"
        )
    steps = steps_ratio(results[ours], results[sync])
    lines.append(
        f"- **steps to reward {threshold}, {ours} / dew sync (medians): {_up(steps)}**, "
        f"{paired_text(results[ours], results[sync], reach_steps)}"
    )
    for label, measured in results.items():  # runs saved before the field have none
        if measured[0].objective:
            lines.append(f"- {label} trained with `{measured[0].objective}`")
    load, quiet = load_text(results)
    lines.append(f"- machine: {load}")

    def status(ok: bool) -> str:
        if not quiet:
            return "NOT counted (load)"
        return "met" if ok else "NOT met"

    n = len(results[ours])
    of = "1 run" if n == 1 else f"medians of {n}"
    rows = [
        (
            f"vs TRL, {task}: time to reward {threshold}",
            f"{ours} vs TRL: {ratios[trl][0]} ({of}); "
            f"completions/s {_down(rate(ours) / rate(trl))}",
            f">= {TARGETS[task]:g}x",
            status(ratios[trl][1] is not None and ratios[trl][1] >= TARGETS[task]),
        ),
        (
            f"async vs sync, {task}: time to reward {threshold}",
            f"{ours} vs dew sync: {ratios[sync][0]} ({of}); completions/s "
            f"{_down(rate(ours) / rate(sync))}",
            f">= {SYNC_TARGET:g}x",
            status(ratios[sync][1] is not None and ratios[sync][1] >= SYNC_TARGET),
        ),
        (
            f"async vs sync, {task}: steps to reward {threshold}",
            f"{ours} / dew sync: {_up(steps)} ({of}; "
            f"{paired_text(results[ours], results[sync], reach_steps)})",
            f"<= {STEPS_TARGET:g}x",
            status(steps <= STEPS_TARGET),
        ),
    ]
    return "\n".join(lines), rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="tail,tail-turns", help="comma-separated tasks")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds, one run each")
    ap.add_argument(
        "--policy",
        default=None,
        help="dew's policy on every task: ahead[,os=N] (default per task, the ablations' "
        f"choice: {', '.join(f'{t} {p}' for t, p in PLANNED.items())}; with --load, the "
        "saved runs' own)",
    )
    ap.add_argument("--fleet", type=int, default=2, help="engine processes of the fleet run")
    ap.add_argument("--save", default=None, help="folder to keep every run's result in")
    ap.add_argument("--load", default=None, help="render the results saved in this folder")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of TRL's runs")
    ap.add_argument(
        "--dew-threads", type=int, default=DEW_THREADS, help="torch threads of dew's runs"
    )
    ap.add_argument("--max-steps", type=int, default=400, help="step cap per run")
    ap.add_argument("--max-seconds", type=float, default=900.0, help="wall cap per run")
    ap.add_argument("--tiny", action="store_true", help="two steps of everything, no write")
    ap.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args()
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in THRESHOLDS]
    if not tasks or unknown:
        raise SystemExit(f"--tasks: choose from {sorted(THRESHOLDS)}, got {args.tasks!r}")
    args.seeds = parse_seeds(args.seeds)
    if not args.seeds or min(args.threads, args.dew_threads, args.max_steps) < 1 or args.fleet < 0:
        raise SystemExit("need a seed, --threads, --dew-threads and --max-steps >= 1, --fleet >= 0")
    policies = task_policies(tasks, args.policy, args.load)
    if args.tiny:
        args.seeds, args.max_steps, args.max_seconds, args.write = [0], 2, 120.0, False
    if args.save:
        Path(args.save).mkdir(parents=True, exist_ok=True)
    if find_spec("trl") is None:
        raise SystemExit("trl is not installed here; it comes with the dev extra")

    workload = Workload().describe()
    print(workload, file=sys.stderr, flush=True)
    t0 = time.monotonic()
    body, rows = [], []
    for task in tasks:
        runs = _runs(policies[task], args.fleet)
        if args.load:
            results = load_results(args.load, task, [run.label for run in runs])
        else:
            results = run_task(task, runs, args)
        seeds = sorted({r.spec.seed for rs in results.values() for r in rs})
        table, task_rows = report(task, runs, results)
        named = "seed" if len(seeds) == 1 else "seeds"
        body.append(f"### {task} ({named} {', '.join(map(str, seeds))})\n\n{table}\n")
        rows += task_rows
    elapsed = time.monotonic() - t0
    text = f"- {workload}\n\n" + "\n".join(body)
    print(text)
    for name, measured, target, status in rows:
        print(f"{name}: {measured}; target {target}: {status}")
    print(f"\nbench wall time: {elapsed:.0f} s")
    run = run_provenance("vs_trl_tail.py", elapsed, args)
    if not args.write:
        return
    lines = provenance_lines(run)
    write_section(
        "## vs trl: heavy-tailed workload\n\n"
        f"{__doc__.split(chr(10) + chr(10))[2]}\n\n{lines}"
        f"- threshold: the mean reward of the last {WINDOW} steps\n{text}"
    )
    for row in rows:
        write_summary_row(*row)
    print(f"wrote the heavy-tailed section of {RESULTS}")


if __name__ == "__main__":
    main()
