"""End to end against Hugging Face TRL on the heavy-tailed workload (``dew.demo.tail``).

Where ``bench/vs_trl.py`` measures per-step overhead on three-token answers, this is the
workload asynchronous RL is for: answer lengths drawn from a lognormal with a long tail
up to the token cap, and a verifier (single-turn, ``tail``) or tool calls between turns
(multi-turn, ``tail-turns``) that take a drawn 10-300 ms each. Its parameters are
printed with the figures.

Per task, three runs per repetition, interleaved (one process at a time, so all see
the same background load): dew with ``--policy`` (scheduler ahead / oversample), dew
synchronous (``ahead=0``) and TRL's ``GRPOTrainer``, all from the demo's tuned settings
for the task (``DemoConfig.for_task``: the same model, initial weights, group size,
batch, learning rate, sampling and step cap; see ``_vs_trl_trl.grpo_config``). TRL
verifies a batch on a thread pool and runs the multi-turn episodes through
``rollout_func`` with the tools stepped concurrently (see ``_vs_trl_trl``).

Figures per run: wall seconds to reach the task's reward threshold (the mean over the
last 10 steps; a run ends there or at ``--max-steps``), completions per second, the
share of the wall time the trainer waited for its batch (dew: the scheduler's wait;
TRL: generation and scoring, during which its trainer does not train) and the peak
resident memory of the run's process. Medians over the repetitions; ratios are other
seconds over dew's, so above 1 means dew is faster.

    .venv/bin/python bench/vs_trl_tail.py --repeats 3 --write

``--write`` replaces the ``## vs trl: heavy-tailed workload`` section of
bench/RESULTS.md and its summary rows; ``--tiny`` runs two small steps (2 tasks x 4
samples of at most 16 tokens) of everything once and writes nothing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from dataclasses import dataclass
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_results.py, _vs_trl_*.py
import _results
from _results import machine, write_section, write_summary_row
from _vs_trl_common import WINDOW, RunResult, RunSpec
from dew.demo.tail import Workload
from vs_trl import median_reach, reach_cell, run_worker, speed_ratio

RESULTS = _results.RESULTS
# The reward each task's runs race to, well above what an untrained model scores (about
# 0.01). Measured with the demo's settings (2026-12-03, seed 0): single-turn reached a
# 20-step mean of 0.15 after about 140 steps and 0.19 at 250; multi-turn 0.15 after
# about 190 and 0.16 at 220. Both plateau slowly after that, so higher thresholds would
# measure the step cap, not the speed.
THRESHOLDS = {"tail": 0.15, "tail-turns": 0.15}
# Targets of the comparison (ratios of seconds to the threshold, medians).
TARGETS = {"tail": 2.0, "tail-turns": 3.0}
SYNC_TARGET = 1.8


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

    def label(self) -> str:
        return f"dew (ahead {self.ahead}" + (f", os {self.oversample})" if self.oversample else ")")


def _runs(policy: Policy) -> list[tuple[str, str, int, int]]:
    """(label, system, ahead, oversample) of the three compared runs."""
    return [
        (policy.label(), "dew", policy.ahead, policy.oversample),
        ("dew sync (ahead 0)", "dew", 0, 0),
        ("TRL GRPOTrainer", "trl", 1, 0),
    ]


def run_task(task: str, policy: Policy, args: argparse.Namespace) -> dict[str, list[RunResult]]:
    runs = _runs(policy)
    results: dict[str, list[RunResult]] = {label: [] for label, *_ in runs}
    for seed in range(args.repeats):
        for label, system, ahead, oversample in runs:
            spec = RunSpec(
                system=system,
                task=task,
                seed=seed,
                threads=args.threads,
                max_seconds=args.max_seconds,
                max_steps=args.max_steps,
                stop_at_reward=True,
                ahead=ahead,
                oversample=oversample,
                threshold=THRESHOLDS[task],
                small=args.tiny,
            )
            result = run_worker(spec, timeout=args.max_seconds + 300)
            print(
                f"  {task} {label} seed {seed}: {result.steps} steps in "
                f"{result.seconds:.1f} s, {reach_cell(result)}, idle "
                f"{result.idle_share:.0%}, peak RSS {result.peak_rss_mb:,.0f} MB",
                file=sys.stderr,
                flush=True,
            )
            results[label].append(result)
    return results


def report(task: str, policy: Policy, results: dict[str, list[RunResult]]) -> tuple[str, list]:
    """The task's table, its ratios, and its summary rows."""
    threshold = THRESHOLDS[task]
    lines = [
        f"| run | seed | time to reward {threshold} | steps | completions/s | s/step "
        "| trainer idle | peak RSS |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    seconds: dict[str, float] = {}
    for label, runs in results.items():
        for r in runs:
            lines.append(
                f"| {label} | {r.spec.seed} | {reach_cell(r)} | {r.steps} "
                f"| {r.completions_per_second:,.0f} | {r.seconds_per_step:.3f} "
                f"| {r.idle_share:.0%} | {r.peak_rss_mb:,.0f} MB |"
            )
        seconds[label], cell = median_reach(runs)
        lines.append(
            f"| {label} | median | {cell} | {statistics.median(r.steps for r in runs):g} "
            f"| {statistics.median(r.completions_per_second for r in runs):,.0f} "
            f"| {statistics.median(r.seconds_per_step for r in runs):.3f} "
            f"| {statistics.median(r.idle_share for r in runs):.0%} "
            f"| {statistics.median(r.peak_rss_mb for r in runs):,.0f} MB |"
        )
    ours, sync, trl = (label for label, *_ in _runs(policy))
    vs_trl = speed_ratio(seconds[ours], seconds[trl])
    vs_sync = speed_ratio(seconds[ours], seconds[sync])

    def text(ratio: float | None) -> str:
        return "n/a (neither reached it)" if ratio is None else f"{ratio:.2f}x"

    def status(ratio: float | None, target: float) -> str:
        if ratio is None or ratio < target:
            return f"NOT met ({text(ratio)})"
        return "met"

    lines += [
        "",
        f"- time to reward {threshold}, TRL seconds / {ours} seconds (medians): "
        f"{text(vs_trl)} (target >= {TARGETS[task]:g}x)",
        f"- time to reward {threshold}, dew sync seconds / {ours} seconds (medians): "
        f"{text(vs_sync)} (target >= {SYNC_TARGET:g}x)",
    ]
    n = len(results[ours])
    of = "1 run" if n == 1 else f"medians of {n}"
    rows = [
        (
            f"vs TRL, {task}: time to reward {threshold}",
            f"{ours} vs TRL: {text(vs_trl)} ({of})",
            f">= {TARGETS[task]:g}x",
            status(vs_trl, TARGETS[task]),
        ),
        (
            f"async vs sync, {task}: time to reward {threshold}",
            f"{ours} vs dew sync: {text(vs_sync)} ({of})",
            f">= {SYNC_TARGET:g}x",
            status(vs_sync, SYNC_TARGET),
        ),
    ]
    return "\n".join(lines), rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="tail,tail-turns", help="comma-separated tasks")
    ap.add_argument("--repeats", type=int, default=3, help="repetitions (seeds 0..N-1)")
    ap.add_argument("--policy", default="1", help="dew's policy: ahead[,os=N] (default 1)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every run")
    ap.add_argument("--max-steps", type=int, default=400, help="step cap per run")
    ap.add_argument("--max-seconds", type=float, default=900.0, help="wall cap per run")
    ap.add_argument("--tiny", action="store_true", help="two steps of everything, no write")
    ap.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args()
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in THRESHOLDS]
    if not tasks or unknown:
        raise SystemExit(f"--tasks: choose from {sorted(THRESHOLDS)}, got {args.tasks!r}")
    if args.repeats < 1 or args.threads < 1 or args.max_steps < 1:
        raise SystemExit("--repeats, --threads and --max-steps must be >= 1")
    policy = Policy.parse(args.policy)
    if args.tiny:
        args.repeats, args.max_steps, args.max_seconds, args.write = 1, 2, 120.0, False
    if find_spec("trl") is None:
        raise SystemExit("trl is not installed here; it comes with the dev extra")

    workload = Workload().describe()
    print(workload, file=sys.stderr, flush=True)
    t0 = time.monotonic()
    body, rows = [], []
    for task in tasks:
        table, task_rows = report(task, policy, run_task(task, policy, args))
        body.append(f"### {task} (seeds 0-{args.repeats - 1})\n\n{table}\n")
        rows += task_rows
    elapsed = time.monotonic() - t0
    text = f"- {workload}\n\n" + "\n".join(body)
    print(text)
    for name, measured, target, status in rows:
        print(f"{name}: {measured}; target {target}: {status}")
    print(f"\nbench wall time: {elapsed:.0f} s")
    if not args.write:
        return
    command = " ".join([".venv/bin/python", "bench/vs_trl_tail.py", *sys.argv[1:]])
    host = machine(
        f"torch {version('torch')} ({args.threads} torch threads per run)",
        f"transformers {version('transformers')}",
        f"trl {version('trl')}",
    )
    write_section(
        "## vs trl: heavy-tailed workload\n\n"
        f"{__doc__.split(chr(10) + chr(10))[2]}\n\n"
        f"- command: `{command}`\n"
        f"- machine: {host}\n"
        f"- date: {datetime.date.today().isoformat()}, wall time {elapsed:.0f} s, "
        f"1-minute load average at the end {os.getloadavg()[0]:.1f}\n"
        f"- threshold: the mean reward of the last {WINDOW} steps\n{text}"
    )
    for row in rows:
        write_summary_row(*row)
    print(f"wrote the heavy-tailed section of {RESULTS}")


if __name__ == "__main__":
    main()
