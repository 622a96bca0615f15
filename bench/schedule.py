"""Scheduling efficiency: the real RolloutScheduler on a simulated engine against the planner.

For each length preset, task batch shape and trainer step time ``T`` (a multiple of a
batch's generation time at full engine throughput), every policy runs twice on the same
seeded lengths: planned by :func:`dew.plan.planner.plan` (event-driven, no threads) and
measured with the real scheduler, a real trainer loop and
:class:`dew.plan.sim.SimulatedEngineSource` in scaled real time. The figures are
steady-state ones over the steps after ``--warmup``.

The fraction is of the limit ``max(T, batch tokens / full throughput)``; policies that
cut (oversample, admit) generate less than a full batch, so they are read in admitted
samples per second against the limit's, beside their length bias (mean admitted length
over mean drawn length).

Time scaling: each cell picks the scale that makes its limit step last ``--real-step``
real seconds (one value per batch shape). The scheduler's own cost per step (mostly
packing, on the trainer's thread) does not shrink with the scale, so the real/plan
ratio measured here is a pessimistic bound for real time; the table also gives that
cost in milliseconds and as a share of the unscaled step. The defaults, 1.2 s at 64x8
and 4.0 s at 128x16, keep a run under about half an hour on two cores; shorter steps
lower the ratio of the policies whose trainer waits on the engine (ahead 1 at T=0.5x).

    .venv/bin/python bench/schedule.py --write

``--write`` replaces the ``## schedule`` section of bench/RESULTS.md (others kept) and
draws bench/schedule.png. ``--tiny`` runs one small cell and writes nothing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_results.py
import _results
from _results import machine, write_section, write_summary_row
from dew.objectives.rl.config import SchedulerConfig
from dew.plan._trace import Figures, summarize
from dew.plan.cli import default_policies
from dew.plan.planner import Scenario, simulate
from dew.plan.sim import run_scheduler

HERE = Path(__file__).resolve().parent
RESULTS = _results.RESULTS
PLOT = HERE / "schedule.png"
QUANTUM = {"dapo": 16, "dapo-moments": 16, "longcot": 64}  # simulated tokens per token id


# The compared policies: `dew plan`'s defaults (oversample and admit as shares of the
# group and of the batch, max_lag as tight as each allows).
policies = default_policies


def label(p: SchedulerConfig, tasks: int, group: int) -> str:
    parts = ["sync" if p.ahead == 0 else f"ahead {p.ahead}"]
    if p.oversample:
        parts.append(f"os {round(100 * p.oversample / group)}%")
    if p.admit is not None:
        parts.append(f"admit {round(100 * p.admit / tasks)}%")
    return " + ".join(parts)


@dataclass
class Row:
    preset: str
    tasks: int
    group: int
    t_ratio: float
    policy: SchedulerConfig
    plan: Figures  # planned over the same steps and window as the real run
    steady: Figures  # planned over a longer run: the steady-state prediction
    real: Figures
    overhead_ms: float  # mean real ms per step the trainer spent in the call after waiting
    overhead_share: float  # that cost against the unscaled limit step
    wall: float  # real seconds of the measured run
    plan_seconds: float  # wall seconds the steady plan took (what `dew plan` costs a policy)
    steady_steps: int
    plan_repeats: int  # plan_seconds is the median of this many timed plans

    @property
    def name(self) -> str:
        return label(self.policy, self.tasks, self.group)

    @property
    def cuts(self) -> bool:
        return bool(self.policy.oversample) or self.policy.admit is not None

    @property
    def ratio(self) -> float:
        return self.real.fraction / self.plan.fraction


Cell = tuple[str, int, int, float, SchedulerConfig]  # preset, tasks, group, T ratio, policy


def plan_all(
    cells: list[Cell], steady_steps: int, repeats: int
) -> dict[Cell, tuple[Figures, float]]:
    """Every policy's steady plan, and the median wall seconds of ``repeats`` plans.

    Timed first, before any real run, in a process that has done nothing else yet: that
    is how ``dew plan`` runs. (Timed between real runs, the same plans were measurably
    slower, though the real runs' threads are joined by then; bench/RESULTS.md,
    "garbage collector", has the figure.) The plan is deterministic, so every repeat
    gives the same figures.
    """
    out = {}
    for cell in cells:
        preset, tasks, group, t_ratio, policy = cell
        long = Scenario.relative(
            preset, tasks, group, t_ratio, steps=steady_steps, warmup=4, quantum=QUANTUM[preset]
        )
        seconds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            steady = summarize(simulate(policy, long), long.warmup)
            seconds.append(time.perf_counter() - t0)
        out[cell] = (steady, float(np.median(seconds)))
    return out


def run_cell(
    preset: str,
    tasks: int,
    group: int,
    t_ratio: float,
    *,
    steps: int,
    warmup: int,
    real_step: float,
    steady_steps: int,
    steady_plans: dict[Cell, tuple[Figures, float]],
    plan_repeats: int,
) -> list[Row]:
    sc = Scenario.relative(
        preset, tasks, group, t_ratio, steps=steps, warmup=warmup, quantum=QUANTUM[preset]
    )
    rows = []
    for policy in policies(tasks, group):
        planned = summarize(simulate(policy, sc), warmup)
        steady, plan_seconds = steady_plans[(preset, tasks, group, t_ratio, policy)]
        scale = real_step / planned.limit_step
        t0 = time.monotonic()
        trace = run_scheduler(policy, sc, scale=scale)
        wall = time.monotonic() - t0
        window = trace.steps[warmup:]
        overhead = float(np.mean([s.ready - s.call - s.waited for s in window]))  # sim s
        rows.append(
            Row(
                preset,
                tasks,
                group,
                t_ratio,
                policy,
                planned,
                steady,
                summarize(trace, warmup),
                overhead * scale * 1e3,
                overhead * scale / planned.limit_step,
                wall,
                plan_seconds,
                steady_steps,
                plan_repeats,
            )
        )
    return rows


HEADER = (
    "| policy | fraction steady plan | fraction plan | fraction real | real/plan "
    "| samples/s vs limit steady / plan / real "
    "| length bias | lag / token lag | trainer idle | engine idle | wasted | overhead ms "
    "(share unscaled) |"
)


def table(rows: list[Row]) -> str:
    out = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for r in rows:
        p, q, st = r.plan, r.real, r.steady
        out.append(
            f"| {r.name} | {st.fraction:.3f} | {p.fraction:.3f} | {q.fraction:.3f} | {r.ratio:.3f} "
            f"| {st.samples_ratio:.3f} / {p.samples_ratio:.3f} / {q.samples_ratio:.3f} "
            f"| {q.length_bias:.3f} | {q.lag:.2f} / {q.token_lag:.2f} "
            f"| {q.trainer_idle:.2f} | {q.engine_idle:.2f} | {q.wasted:.2f} "
            f"| {r.overhead_ms:.0f} ({100 * r.overhead_share:.2f}%) |"
        )
    return "\n".join(out)


def targets(rows: list[Row]) -> list[str]:
    lines = []
    worst = max(rows, key=lambda r: abs(r.ratio - 1))
    within = sum(abs(r.ratio - 1) <= 0.05 for r in rows)
    lines.append(
        f"- real within 5% of the plan's fraction: {within}/{len(rows)} policies; worst "
        f"{worst.ratio:.3f} ({worst.preset} {worst.tasks}x{worst.group} T={worst.t_ratio}x "
        f"{worst.name}, {worst.overhead_ms:.0f} ms of scheduler cost per "
        f"{worst.real.step_time / worst.plan.limit_step * _real_step(worst):.2f} s scaled step)"
    )
    lines.append(planner_speed(rows))
    for r in rows:
        if r.preset == "longcot" and r.policy == SchedulerConfig.tight(ahead=2):
            lines.append(
                f"- longcot ahead 2 >= 0.95 at {r.tasks}x{r.group} T={r.t_ratio}x: steady plan "
                f"{r.steady.fraction:.3f} ({_ok(r.steady.fraction, 0.95)}), real "
                f"{r.real.fraction:.3f} ({_ok(r.real.fraction, 0.95)})"
            )
    for t in sorted({r.t_ratio for r in rows}):
        cell = [
            r
            for r in rows
            if r.preset == "dapo" and (r.tasks, r.group) == (128, 16) and r.t_ratio == t
        ]
        if cell:
            best = max(cell, key=lambda r: r.steady.samples_ratio)
            real = max(cell, key=lambda r: r.real.samples_ratio)
            lines.append(
                f"- dapo 128x16 T={t}x, best policy with max_lag <= 2 >= 0.9 (admitted samples/s "
                f"vs limit): steady plan {best.name} {best.steady.samples_ratio:.3f} "
                f"(length bias {best.steady.length_bias:.3f}, "
                f"{_ok(best.steady.samples_ratio, 0.9)}); real {real.name} "
                f"{real.real.samples_ratio:.3f} (length bias {real.real.length_bias:.3f}, "
                f"{_ok(real.real.samples_ratio, 0.9)})"
            )
    return lines


def planner_speed(rows: list[Row]) -> str:
    """Wall seconds of one policy's steady plan, per batch shape (median and slowest)."""
    parts = []
    for shape in sorted({(r.tasks, r.group) for r in rows}):
        times = [r.plan_seconds for r in rows if (r.tasks, r.group) == shape]
        slow = max((r for r in rows if (r.tasks, r.group) == shape), key=lambda r: r.plan_seconds)
        parts.append(
            f"{shape[0]}x{shape[1]} median {float(np.median(times)):.2f} s, slowest "
            f"{slow.plan_seconds:.2f} s ({slow.preset} T={slow.t_ratio}x {slow.name})"
        )
    steps, repeats = (rows[0].steady_steps, rows[0].plan_repeats) if rows else (0, 0)
    return (
        f"- planner, wall seconds per policy ({steps} steps, median of {repeats} "
        "plans, all timed before the first real run): " + "; ".join(parts)
    )


def _ok(value: float, target: float) -> str:
    return "met" if value >= target else f"MISSED by {target - value:.3f}"


_REAL_STEP: dict[tuple[int, int], float] = {}


def _real_step(r: Row) -> float:
    return _REAL_STEP[(r.tasks, r.group)]


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({(r.preset, r.tasks, r.group, r.t_ratio) for r in rows})
    cols = 4
    fig, axes = plt.subplots(
        -(-len(cells) // cols),
        cols,
        figsize=(4 * cols, 3.2 * -(-len(cells) // cols)),
        squeeze=False,
    )
    for ax, cell in zip(axes.flat, cells, strict=False):
        rs = [r for r in rows if (r.preset, r.tasks, r.group, r.t_ratio) == cell]
        x = np.arange(len(rs))
        ax.bar(x - 0.27, [r.steady.samples_ratio for r in rs], 0.27, label="steady plan")
        ax.bar(x, [r.plan.samples_ratio for r in rs], 0.27, label="plan, same steps")
        ax.bar(x + 0.27, [r.real.samples_ratio for r in rs], 0.27, label="real")
        ax.plot(x, [r.real.length_bias for r in rs], "k.", label="length bias")
        ax.set_xticks(x, [r.name for r in rs], rotation=60, ha="right", fontsize=7)
        ax.set_ylim(0, 1.15)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_title(f"{cell[0]} {cell[1]}x{cell[2]} T={cell[3]}x", fontsize=9)
    for ax in list(axes.flat)[len(cells) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("admitted samples/s against the limit (real scheduler vs planner)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="dapo,dapo-moments,longcot")
    ap.add_argument("--shapes", default="64x8,128x16", help="tasks x group, comma separated")
    ap.add_argument("--T", default="0.5,1.0", help="T as multiples of a batch's generation time")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--steady-steps", type=int, default=16, help="steps of the steady plan (dew plan's default)"
    )
    ap.add_argument(
        "--real-step", default="1.2,4.0", help="real seconds of a limit step, per shape"
    )
    ap.add_argument(
        "--plan-repeats", type=int, default=3, help="timed plans per policy (median reported)"
    )
    ap.add_argument("--tiny", action="store_true", help="one small cell; writes nothing")
    ap.add_argument("--write", action="store_true", help="write RESULTS.md and the plot")
    args = ap.parse_args(argv)
    if args.tiny:
        args.presets, args.shapes, args.T = "dapo", "16x4", "1.0"
        args.steps, args.warmup, args.real_step, args.steady_steps = 4, 1, "0.15", 6
        args.plan_repeats = 1
        args.write = False
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    steps_real = [float(v) for v in args.real_step.split(",")]
    if len(steps_real) != len(shapes):
        raise ValueError(f"--real-step needs one value per shape ({len(shapes)})")
    _REAL_STEP.update(dict(zip(shapes, steps_real, strict=True)))
    t_start = time.monotonic()
    grid = [
        (preset, tasks, group, t)
        for preset in args.presets.split(",")
        for tasks, group in shapes
        for t in (float(v) for v in args.T.split(","))
    ]
    steady = plan_all(
        [(*g, p) for g in grid for p in policies(g[1], g[2])], args.steady_steps, args.plan_repeats
    )
    rows: list[Row] = []
    for preset, tasks, group, t in grid:
        cell = run_cell(
            preset,
            tasks,
            group,
            t,
            steps=args.steps,
            warmup=args.warmup,
            real_step=_REAL_STEP[(tasks, group)],
            steady_steps=args.steady_steps,
            steady_plans=steady,
            plan_repeats=args.plan_repeats,
        )
        rows += cell
        print(f"\n{preset} {tasks}x{group} T={t}x", flush=True)
        print(table(cell), flush=True)
    elapsed = time.monotonic() - t_start
    summary = targets(rows)
    print("\n" + "\n".join(summary))
    print(f"\nbench wall time: {elapsed:.0f} s")
    if not args.write:
        return
    plot(rows, PLOT)
    cmd = " ".join([".venv/bin/python", "bench/schedule.py", *sys.argv[1:]])
    host = machine()
    parts = [
        "## schedule",
        "",
        "Real RolloutScheduler + trainer loop on the time-scaled simulated engine "
        "(`dew.plan.sim`) next to the event-driven planner (`dew plan`), same seeded lengths. "
        f"Engine: 4.5 ms + 0.04 ms x active per iteration, 256 slots. {args.steps} steps per "
        f"run, figures over the last {args.steps - args.warmup}. A limit step lasts "
        + ", ".join(f"{s} s real at {a}x{b}" for (a, b), s in _REAL_STEP.items())
        + "; the scheduler cost (overhead column: trainer-side ms per step after the "
        "rollouts were in, mostly `pack`) does not scale with time, so its share in the "
        "scaled run is far larger than at real step times (share column). Policies that cut "
        "are read in samples/s vs limit beside their length bias. The steady plan runs "
        f"{args.steady_steps} steps (its wall time, the median of {args.plan_repeats} plans "
        "timed before any real run, is the planner figure); over the short "
        "window a fraction can exceed 1, as the window's batches were partly generated "
        "before it.",
        "",
        f"- command: `{cmd}`",
        f"- machine: {host} (shared with other jobs; load average "
        f"{os.getloadavg()[0]:.1f} at the end)",
        f"- date: {datetime.date.today().isoformat()}, wall time {elapsed:.0f} s",
        "",
        "Targets:",
        "",
        *summary,
        "",
        "![schedule](schedule.png)",
    ]
    for cell in sorted({(r.preset, r.tasks, r.group, r.t_ratio) for r in rows}, key=str):
        cr = [r for r in rows if (r.preset, r.tasks, r.group, r.t_ratio) == cell]
        parts += ["", f"### {cell[0]} {cell[1]}x{cell[2]} T={cell[3]}x", "", table(cr)]
    write_section("\n".join(parts) + "\n")
    within = sum(abs(r.ratio - 1) <= 0.05 for r in rows)
    write_summary_row(
        "schedule: real vs planner",
        summary[0][2:],
        "every policy within 5% of the planner's fraction",
        "met" if within == len(rows) else f"NOT met ({within}/{len(rows)})",
    )
    for name, prefix, target in (
        ("schedule: longcot ahead 2", "- longcot", ">= 0.95 of the limit"),
        ("schedule: dapo 128x16 best policy", "- dapo", ">= 0.9 of the limit (samples/s)"),
    ):
        found = [line[2:] for line in summary if line.startswith(prefix)]
        if found:
            missed = [line for line in found if "MISSED" in line]
            status = "met" if not missed else f"NOT met in {len(missed)} of {len(found)}"
            write_summary_row(name, "; ".join(found), target, status)
    speed = next(line for line in summary if line.startswith("- planner"))
    slowest = max(r.plan_seconds for r in rows)
    write_summary_row(
        "planner speed",
        speed[2:],
        "well under a second per policy (here: under 0.5 s)",
        "met" if slowest < 0.5 else f"NOT met (slowest {slowest:.2f} s)",
    )


if __name__ == "__main__":
    main()
