"""``dew plan --from-run`` proven on reruns: fit a probe run, take the advice, run it.

For each workload and seed:

1. **probe**: run the default policy (``ahead 1``) for ``--steps`` steps;
2. **fit** the planner to the probe's records (its first ``--skip`` steps left out) and
   rank a small grid of policies (:func:`dew.plan.cli.default_policies`); the
   recommended one is what ``dew plan --from-run`` would print;
3. **grid**: run every policy of the grid (the recommended one among them; the probe
   is the default's run) from scratch with the same seed and steps.

Per policy it reports predicted against measured seconds per step and admitted samples
per second over the steps after the skip (target: within 15%), and the recommended
policy's measured speed against the default's and against the fastest of the grid
whose measured length bias stays within the planner's bound (target: within 10%).
Every run also reports its own limit fraction, ``max(train time, batch tokens / full
engine throughput)`` per step over its elapsed time, from its records.

Workloads: ``tail`` and ``tail-turns`` (``dew demo --task ...``), and ``copy`` (``dew
train examples/copy.toml``). Runs are subprocesses of the real commands, one at a time,
each with the cores other work took during it (``_stats.OtherLoad``).

    .venv/bin/python bench/plan_rerun.py --write               # all three, seed 0
    .venv/bin/python bench/plan_rerun.py --load runs/bench/plan-rerun --write
    .venv/bin/python bench/plan_rerun.py --tiny                # a smoke run, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
import timeit
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import provenance, provenance_lines, write_section, write_summary_row
from _stats import OtherLoad, load_summary
from dew.core import IterationLog, LogHistogram
from dew.objectives.rl.config import SchedulerConfig
from dew.plan._from_run import overrides, rank
from dew.plan.cli import default_policies
from dew.plan.fit import fit_run
from dew.plan.planner import plan, simulate

ROOT = Path(__file__).resolve().parent.parent
DEW = str(Path(sys.executable).with_name("dew"))
WORKLOADS = ("tail", "tail-turns", "copy")
MAX_BIAS = 0.02  # the recommender's bound on the mean admitted length's shift


def _knobs(policy: SchedulerConfig) -> dict[str, int | None]:
    return {
        "ahead": policy.ahead,
        "max_lag": policy.max_lag,
        "oversample": policy.oversample,
        "admit": policy.admit,
    }


def command(workload: str, policy: SchedulerConfig, steps: int, seed: int, run: Path) -> list[str]:
    knobs = _knobs(policy)
    if workload == "copy":
        cmd = [DEW, "train", str(ROOT / "examples" / "copy.toml"), "--no-progress"]
        cmd += ["--output.run_dir", str(run), "--training.steps", str(steps)]
        cmd += ["--training.seed", str(seed), "--output.checkpoint_every", str(steps)]
        for k, v in knobs.items():
            if v is not None:
                cmd += [f"--scheduler.{k}", str(v)]
        return cmd
    cmd = [DEW, "demo", "--task", workload, "--no-progress", "--run-dir", str(run)]
    cmd += ["--steps", str(steps), "--seed", str(seed)]
    for k, v in knobs.items():
        if v is not None:
            cmd += [f"--{k.replace('_', '-')}", str(v)]
    return cmd


def run_policy(
    workload: str, policy: SchedulerConfig, steps: int, seed: int, run: Path
) -> dict[str, Any]:
    """Run one policy to ``run`` (a fresh folder); its wall time and the load during it."""
    cmd = command(workload, policy, steps, seed, run)
    t0 = time.monotonic()
    with OtherLoad() as load:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return {
        "policy": policy.name,
        "cuts": bool(policy.oversample or policy.admit is not None),
        "run": str(run),
        "seconds": time.monotonic() - t0,
        "load": load.cores,
    }


def measured(run: Path, skip: int) -> dict[str, float]:
    """Seconds per step, admitted samples per second, the mean admitted length and the
    run's limit fraction, over the steps after ``skip`` (its own records)."""
    fit = fit_run(run, skip=skip)
    m = fit.measured
    records = [json.loads(x) for x in (run / "records.jsonl").read_text().splitlines() if x][skip:]
    admitted = LogHistogram()
    for r in records:
        admitted = admitted.merged(LogHistogram.from_json(r["profile"]["lengths"]["finished"]))
    return {
        "step_time": m.step_time,
        "samples_per_s": m.samples_per_s,
        "admitted_len": admitted.mean,
        "limit_fraction": m.limit_fraction,
    }


def grid(tasks: int, group: int) -> list[SchedulerConfig]:
    return default_policies(tasks, group)


def one_workload(workload: str, seed: int, steps: int, skip: int, folder: Path) -> dict[str, Any]:
    default = SchedulerConfig.tight(ahead=1)
    probe_dir = folder / f"{workload}-{seed}-probe"
    probe = run_policy(workload, default, steps, seed, probe_dir)
    fit = fit_run(probe_dir, skip=skip)
    policies = grid(fit.tasks, fit.group)
    ranked = rank(fit, policies, max_bias=MAX_BIAS)
    planned = {p.name: dataclasses.asdict(f) for p, f in ranked.rows}
    runs = {default.name: probe}
    for policy, _ in ranked.rows:
        if policy.name in runs:
            continue
        path = folder / f"{workload}-{seed}-{policy.name.replace(' ', '').replace('+', '_')}"
        runs[policy.name] = run_policy(workload, policy, steps, seed, path)
    for name, r in runs.items():
        r["measured"] = measured(Path(r["run"]), skip)
        r["planned"] = planned[name]
    return {
        "workload": workload,
        "seed": seed,
        "default": default.name,
        "recommended": ranked.best.name,
        "override": overrides(
            ranked.best,
            "train" if workload == "copy" else "demo",
            "examples/copy.toml" if workload == "copy" else f"--task {workload}",
        ),
        "fit": {
            "median_length": float(2.718281828**fit.lengths.mu),
            "sigma": fit.lengths.sigma,
            "latency": fit.latency,
            "T": fit.T,
            "a": fit.engine.a,
            "b": fit.engine.b,
            "engines": fit.engines,
            "profile_cpu": fit.measured.profile_cpu,
        },
        "runs": runs,
        "obstacles": obstacles(probe_dir, skip),
        "split": split(probe_dir, skip),
    }


OBSTACLES = (
    ("as fitted", {}),
    ("separate devices", {"sharing": 1.0}),
    ("no verifier latency", {"latency": 0.0, "latency_sigma": 0.0}),
    ("one answer length", {"spread": 0.0}),
    ("none of these", {"sharing": 1.0, "latency": 0.0, "latency_sigma": 0.0, "spread": 0.0}),
)


OBSTACLES_COLUMNS = ("ahead 1", "sync")


def obstacles(probe: Path, skip: int) -> dict[str, dict[str, float]]:
    """What stands between a run and its limit: the planned fraction of the limit of the
    default and the synchronous policy on the probe's fitted model, and again with each
    obstacle taken away (cores shared with the trainer, the verifier's latency, the
    spread of answer lengths: every answer the fitted mean's length)."""
    fit = fit_run(probe, skip=skip)
    base = fit.scenario()
    out: dict[str, dict[str, float]] = {}
    for name, change in OBSTACLES:
        change = dict(change)
        sc = base
        if change.pop("spread", None) is not None:
            p = fit.lengths
            mean = p.mean_length()
            flat = dataclasses.replace(p, mu=math.log(mean), sigma_task=0.0, sigma_sample=0.0)
            sc = dataclasses.replace(sc, preset=flat)
        sc = dataclasses.replace(sc, **change)
        out[name] = {
            policy.name: plan(policy, sc).fraction
            for policy in (SchedulerConfig.tight(ahead=1), SchedulerConfig.tight(ahead=0))
        }
    return out


def split(probe: Path, skip: int) -> dict[str, float]:
    """The default's step, planned (on the probe's fit) against measured (the probe's
    records after the skip): the trainer's wait and its time at work, means per step;
    and what the profile cost: its CPU per step and its size in a record (medians)."""
    fit = fit_run(probe, skip=skip)
    sc = fit.scenario()
    steps = simulate(fit.policy, sc).steps[sc.warmup :]
    records = [json.loads(x) for x in (probe / "records.jsonl").read_text().splitlines() if x]
    records = records[skip:]
    waited = [r["scheduler"]["waited"] for r in records]
    return {
        "planned_wait": statistics.fmean(s.waited for s in steps),
        "planned_busy": statistics.fmean(s.end - s.call - s.waited for s in steps),
        "measured_wait": statistics.fmean(waited),
        "measured_busy": statistics.fmean(r["seconds"] for r in records) - statistics.fmean(waited),
        "profile_cpu_ms": statistics.median(r["profile"]["cpu"] for r in records) * 1e3,
        "profile_bytes": statistics.median(len(json.dumps(r["profile"])) for r in records),
    }


def counting_costs() -> dict[str, Any]:
    """What counting costs where it happens: an engine's ``IterationLog.add`` per
    iteration and a source's ``LogHistogram.add`` per call, microseconds (the best of
    three timeit repeats of 200,000 calls), with the date and load of the measurement."""
    log, hist, n = IterationLog(), LogHistogram(), 200_000
    iteration = min(timeit.repeat(lambda: log.add(37, 0.001), number=n, repeat=3)) / n
    histogram = min(timeit.repeat(lambda: hist.add(0.05), number=n, repeat=3)) / n
    return {
        "iteration_add_us": iteration * 1e6,
        "histogram_add_us": histogram * 1e6,
        "date": datetime.date.today().isoformat(),
        "load": os.getloadavg()[0],
    }


def _err(predicted: float, measured: float) -> float:
    return predicted / measured - 1.0


def render(
    results: list[dict[str, Any]], prov: dict[str, Any], counting: dict[str, Any] | None = None
) -> tuple[str, list[tuple[str, str, str, str]]]:
    loads = [r["load"] for res in results for r in res["runs"].values()]
    load_text, quiet = load_summary(loads)
    lines = [
        "## plan from a run: reruns",
        "",
        "Each workload: a probe run of the default policy, `dew plan --from-run` fitted to it,",
        "then every policy of the planner's grid run from scratch with the same seed. Figures",
        "over the steps after the skip; predicted is the plan of the fitted model, measured",
        "is the run's own records. `fraction`: the run's own limit (per step, max(train time,",
        "batch tokens / full engine throughput)) over its elapsed time.",
        "",
        provenance_lines(prov).rstrip("\n"),
        f"- load: {load_text}",
        "",
    ]
    if counting:
        lines[-1:-1] = [
            f"- counting, where it happens: `IterationLog.add` {counting['iteration_add_us']:.2f} "
            f"us per engine iteration, `LogHistogram.add` {counting['histogram_add_us']:.2f} us "
            f"per model call (timeit, best of 3 x 200,000 calls; {counting['date']}, 1-minute "
            f"load average {counting['load']:.1f})",
        ]
    rows: list[tuple[str, str, str, str]] = []
    per_workload: dict[str, dict[str, list[Any]]] = {}
    for res in results:
        w, seed, runs = res["workload"], res["seed"], res["runs"]
        f = res["fit"]
        lines += [
            f"### {w} (seed {seed})",
            "",
            f"fit: median length {f['median_length']:.3g} tokens (sigma {f['sigma']:.2f}), "
            f"outside the engine {f['latency'] * 1e3:.3g} ms, T {f['T']:.3g} s, engine a "
            f"{f['a'] * 1e3:.3g} ms + b {f['b'] * 1e3:.3g} ms x active ({f['engines']} engine); "
            f"the profile cost {f['profile_cpu'] * 1e3:.2g} ms CPU per step",
            "",
            "| policy | s/step predicted | measured | error | samples/s predicted | measured "
            "| error | admitted length | fraction | other load |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        base_len = runs[res["default"]]["measured"]["admitted_len"]
        step_errs, rate_errs = [], []
        for name, r in runs.items():
            p, m = r["planned"], r["measured"]
            e1, e2 = (
                _err(p["step_time"], m["step_time"]),
                _err(p["samples_per_s"], m["samples_per_s"]),
            )
            step_errs.append(abs(e1))
            rate_errs.append(abs(e2))
            mark = " **(recommended)**" if name == res["recommended"] else ""
            mark += " (default)" if name == res["default"] else ""
            load = "n/a" if r["load"] is None else f"{r['load']:.2f}"
            lines.append(
                f"| {name}{mark} | {p['step_time']:.3g} | {m['step_time']:.3g} | {e1:+.0%} | "
                f"{p['samples_per_s']:.3g} | {m['samples_per_s']:.3g} | {e2:+.0%} | "
                f"{m['admitted_len'] / base_len:.3f}x | {m['limit_fraction']:.2f} | {load} |"
            )
        # fair: cuts nothing (no length selection by construction), or its measured
        # mean admitted length stays within the recommender's bound of the default's
        fair = {
            n: r
            for n, r in runs.items()
            if not r["cuts"] or abs(r["measured"]["admitted_len"] / base_len - 1) <= MAX_BIAS
        } or runs
        best = max(fair, key=lambda n: fair[n]["measured"]["samples_per_s"])
        rec = runs[res["recommended"]]["measured"]["samples_per_s"]
        vs_best = rec / fair[best]["measured"]["samples_per_s"]
        vs_default = rec / runs[res["default"]]["measured"]["samples_per_s"]
        median_step, median_rate = statistics.median(step_errs), statistics.median(rate_errs)
        lines += [
            "",
            f"recommended `{res['recommended']}` ({res['override']}): measured {vs_default:.2f}x "
            f"the default's samples/s, {vs_best:.2f}x the fastest measured policy that cuts "
            f"nothing or stays within the length-bias bound (`{best}`). Median absolute error over "
            f"the grid: {median_step:.0%} in "
            f"s/step, {median_rate:.0%} in samples/s; worst {max(step_errs):.0%} and "
            f"{max(rate_errs):.0%}.",
            "",
        ]
        if res.get("split"):
            sp = res["split"]
            lines += [
                f"The default's step, planned against measured: waiting {sp['planned_wait']:.3f} "
                f"against {sp['measured_wait']:.3f} s, at work {sp['planned_busy']:.3f} against "
                f"{sp['measured_busy']:.3f} s (means per step). The profile took "
                f"{sp['profile_cpu_ms']:.2f} ms of the trainer thread's CPU per step and "
                f"{sp['profile_bytes'] / 1e3:.1f} KB of its record (medians).",
                "",
            ]
        if res.get("obstacles"):
            sync = SchedulerConfig.tight(ahead=0).name
            measured_sync = runs[sync]["measured"]["limit_fraction"] if sync in runs else math.nan
            measured_default = runs[res["default"]]["measured"]["limit_fraction"]
            lines += [
                "What stands between the run and its limit: the planned fraction of the "
                "limit on the probe's fit (the limit with the trainer's work alone, `T`), "
                "with each obstacle taken away. The runs' own records give "
                f"{measured_default:.2f} (async) and {measured_sync:.2f} (sync) of a limit "
                "made with the trainer's time at work as measured, which sharing the cores "
                "stretches.",
                "",
                "| model | " + " | ".join(OBSTACLES_COLUMNS) + " |",
                "|---|" + "---|" * len(OBSTACLES_COLUMNS),
            ]
            for name, row in res["obstacles"].items():
                cells = " | ".join(f"{row[c]:.2f}" for c in OBSTACLES_COLUMNS)
                lines.append(f"| {name} | {cells} |")
            lines.append("")
        agg = per_workload.setdefault(w, {"chosen": [], "grid": [], "vs_best": [], "seeds": []})
        for name in {res["recommended"], res["default"]}:
            p, m = runs[name]["planned"], runs[name]["measured"]
            agg["chosen"].append(abs(_err(p["step_time"], m["step_time"])))
            agg["chosen"].append(abs(_err(p["samples_per_s"], m["samples_per_s"])))
        agg["grid"] += step_errs + rate_errs
        agg["vs_best"].append(vs_best)
        agg["seeds"].append(seed)
    veto = "" if quiet else " (NOT counted: load)"
    for w, agg in per_workload.items():
        seeds = ", ".join(str(x) for x in agg["seeds"])
        chosen, grid = max(agg["chosen"]), max(agg["grid"])
        rows.append(
            (
                f"plan from run, {w}: predicted vs measured, recommended and default",
                f"worst error {chosen:.0%} (s/step and samples/s; seeds {seeds})",
                "<= 15%",
                ("met" if chosen <= 0.15 else "NOT met") + veto,
            )
        )
        rows.append(
            (
                f"plan from run, {w}: predicted vs measured, every policy of the grid",
                f"worst error {grid:.0%} (seeds {seeds})",
                "<= 15%",
                ("met" if grid <= 0.15 else "NOT met") + veto,
            )
        )
        rows.append(
            (
                f"plan from run, {w}: recommended vs the best policy run",
                f"{min(agg['vs_best']):.2f}x at worst (seeds {seeds})",
                ">= 0.90x",
                ("met" if min(agg["vs_best"]) >= 0.9 else "NOT met") + veto,
            )
        )
    return "\n".join(lines) + "\n", rows


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--seeds", default="0", help="comma-separated seeds")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=6, help="first steps left out (the pipeline fills)")
    ap.add_argument("--out", default="runs/bench/plan-rerun", help="where the runs go")
    ap.add_argument("--load", default=None, metavar="DIR", help="render the saved results in DIR")
    ap.add_argument("--write", action="store_true", help="write the section to bench/RESULTS.md")
    ap.add_argument("--tiny", action="store_true", help="one workload, few steps: a smoke run")
    args = ap.parse_args()
    if args.load:
        saved = json.loads((Path(args.load) / "results.json").read_text())
        results, prov = saved["results"], saved["provenance"]
        counting = saved.get("counting")
        for res in results:  # saved before these were planned: from its probe
            probe = Path(res["runs"][res["default"]]["run"])
            if "obstacles" not in res and (probe / "records.jsonl").exists():
                res["obstacles"] = obstacles(probe, args.skip)
            if "split" not in res and (probe / "records.jsonl").exists():
                res["split"] = split(probe, args.skip)
        if "counting" not in saved:
            saved["counting"] = counting = counting_costs()
        (Path(args.load) / "results.json").write_text(json.dumps(saved, indent=1))
    else:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        workloads = ["copy"] if args.tiny else args.workloads.split(",")
        steps, skip = (8, 2) if args.tiny else (args.steps, args.skip)
        if not (ROOT / "runs" / "examples" / "copy.jsonl").exists() and "copy" in workloads:
            subprocess.run(
                [sys.executable, str(ROOT / "examples" / "make_assets.py")], cwd=ROOT, check=True
            )
        t0 = time.monotonic()
        results = []
        for seed in (int(s) for s in args.seeds.split(",")):
            for w in workloads:
                if w not in WORKLOADS:
                    raise SystemExit(f"--workloads: {w!r} is not one of {WORKLOADS}")
                results.append(one_workload(w, seed, steps, skip, out / f"seed-{seed}"))
                print(f"{w} seed {seed}: recommended {results[-1]['recommended']}", flush=True)
        prov = provenance("plan_rerun.py", time.monotonic() - t0)
        counting = counting_costs()
        saved = {"results": results, "provenance": prov, "counting": counting}
        (out / "results.json").write_text(json.dumps(saved, indent=1))
    text, rows = render(results, prov, counting)
    print(text)
    if args.write:
        write_section(text)
        for row in rows:
            write_summary_row(*row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
