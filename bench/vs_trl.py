"""End to end against Hugging Face TRL: dew and ``trl.GRPOTrainer`` on the demo's tasks.

Single-turn: the demo's tuned copy task (``DemoConfig.for_task("single")``: copy three
digits, tiny qwen2 model, char tokenizer, lr 1e-3, 4 prompts x 32 samples per step, 3
new tokens, temperature 1, group-std advantages, clip 0.2 / 0.28, no KL, one AdamW
update per generated batch, CPU, fp32). Both systems start from the same weights (the
demo's ``make_model`` with the run's seed) and score with the demo's own verifier. dew
runs as the demo does (scheduler ahead 1); TRL as GRPOTrainer does (generate, then
train, on the training model). Measured per seed: wall seconds from the start of
training until the mean reward of the last 10 steps first reaches 0.6 (a run is cut at
``--max-seconds``), and completions per second (completions trained / wall seconds of
training). Figures are the medians over ``--seeds``; the ratios put dew's speed over
TRL's, so above 1 means dew is faster.

Two-turn: the same copy skill spread over a conversation, three digits per turn, with
``--latency`` seconds slept in every environment step (see ``_vs_trl_common``). dew
async (ahead 1) against dew synchronous (ahead 0) and TRL (through ``rollout_func``,
see ``_vs_trl_trl``), each for the same ``--mt-steps`` steps: seconds per step,
completions (whole episodes) per second, and the time to reward 0.6 when a run gets
there.

Every run is its own process (``_vs_trl_worker.py``), one after another, never two at
once, each with torch pinned to its system's thread count (and OMP/MKL_NUM_THREADS set
to the same): ``--dew-threads`` (default 1) for dew, ``--threads`` (default 2) for TRL,
each system's faster count on two cores. ``--write`` replaces the ``## vs trl`` section
of bench/RESULTS.md and its summary rows; ``--tiny`` runs every part for a few steps on
one seed and writes nothing.
``--save DIR`` keeps every run's result as JSON, and the command, machine, wall time
and load of the whole run; ``--load DIR`` renders them again without running anything
(with the saved runs' settings, and with ``--write`` under the saved run's command).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_results.py, _vs_trl_*.py
import _results
from _results import (
    joined_provenance,
    provenance,
    provenance_lines,
    write_section,
    write_summary_row,
)
from _stats import OtherLoad
from _vs_trl_common import THRESHOLD, WINDOW, RunResult, RunSpec

BENCH = Path(__file__).resolve().parent
RESULTS = _results.RESULTS
NAMES = {"dew": "dew", "trl": "TRL"}
MULTI_RUNS = (  # (label, system, ahead)
    ("dew async (ahead 1)", "dew", 1),
    ("dew sync (ahead 0)", "dew", 0),
    ("TRL GRPOTrainer (rollout_func)", "trl", 1),
)


def run_worker(spec: RunSpec, timeout: float) -> RunResult:
    """Run one spec in a fresh process and read its result back."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(spec.threads),
        MKL_NUM_THREADS=str(spec.threads),
        TRL_EXPERIMENTAL_SILENCE="1",  # rollout_func is used on purpose; TRL's opt-out
        HF_HUB_OFFLINE="1",  # nothing is downloaded: models and tokenizer are built locally
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        with OtherLoad() as load:
            proc = subprocess.run(
                [sys.executable, str(BENCH / "_vs_trl_worker.py"), spec.to_json(), str(out)],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=env,
                cwd=tmp,  # anything a library writes to the working directory goes away
                check=False,
            )
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(
                f"{spec.system} {spec.task} seed {spec.seed} failed "
                f"(exit {proc.returncode}):\n{proc.stderr[-4000:]}"
            )
        result = RunResult.from_json(out.read_text())
    result.load = load.cores
    return result


# The file in a --save folder that says how its results were made.
PROVENANCE = "run.json"


def save_result(folder: str, part: str, label: str, result: RunResult) -> None:
    """Keep one run's result in ``folder`` (``--save``), named by part, label and seed."""
    name = f"{part}-{label}-{result.spec.seed}.json".replace(" ", "_")
    (Path(folder) / name).write_text(result.to_json())


def load_results(
    folder: str, part: str, labels: Sequence[str], *, every: bool = False
) -> dict[str, list[RunResult]]:
    """The results :func:`save_result` kept for ``part`` (``--load``), by label, in seed
    order; a label with none saved is left out, unless ``every`` label must have some."""
    results: dict[str, list[RunResult]] = {}
    for label in labels:
        pattern = f"{part}-{label}-*.json".replace(" ", "_")
        found = [RunResult.from_json(p.read_text()) for p in Path(folder).glob(pattern)]
        if found:
            results[label] = sorted(found, key=lambda r: r.spec.seed)
    missing = [label for label in labels if label not in results]
    if not results or (every and missing):
        raise SystemExit(f"--load {folder}: no saved {part} results of {missing}")
    return results


def run_provenance(script: str, elapsed: float, args: argparse.Namespace) -> dict[str, Any]:
    """Command, machine, date, wall time and load of the run behind the figures: this
    process's (kept in the ``--save`` folder), or, rendering a ``--load`` folder, the
    saved run's when it kept them."""
    saved = None if args.load is None else Path(args.load) / PROVENANCE
    if saved is not None and saved.exists():
        return json.loads(saved.read_text())
    run = provenance(
        script,
        elapsed,
        f"torch {version('torch')} ({thread_text(args)})",
        f"transformers {version('transformers')}",
        f"trl {version('trl')}",
    )
    if args.load is not None:  # a render of runs whose own provenance was not kept
        run["note"] = f" (a render of {args.load}, which has no {PROVENANCE})"
    elif args.save:
        path = Path(args.save) / PROVENANCE
        if path.exists():  # an earlier invocation saved into this folder: keep it too
            run = joined_provenance(json.loads(path.read_text()), run)
        path.write_text(json.dumps(run))
    return run


def _progress(label: str, result: RunResult) -> None:
    reached = result.reached()
    when = "-" if reached is None else f"{reached[1]:.1f} s (step {reached[0]})"
    print(
        f"  {label} seed {result.spec.seed}: {result.steps} steps in {result.seconds:.1f} s, "
        f"{result.completions_per_second:,.0f} completions/s, reward {THRESHOLD} at {when}",
        file=sys.stderr,
        flush=True,
    )


# ------------------------------------------------------------------ figures


def reach_seconds(result: RunResult) -> float:
    """Seconds to the reward target; infinity when the run never got there."""
    reached = result.reached()
    return float("inf") if reached is None else reached[1]


def reach_cell(result: RunResult) -> str:
    reached = result.reached()
    if reached is not None:
        return f"{reached[1]:.1f} s (step {reached[0]})"
    if result.stopped == "seconds":
        return f"not reached in {result.seconds:.0f} s"
    return f"not reached in {result.steps} steps"


def median_reach(results: Sequence[RunResult]) -> tuple[float, str]:
    """(median seconds, cell); a median that falls on a run that never got there says so."""
    seconds = statistics.median(reach_seconds(r) for r in results)
    if seconds == float("inf"):
        return seconds, reach_cell(max(results, key=lambda r: r.seconds))
    return seconds, f"{seconds:.1f} s"


def _of_seeds(n: int) -> str:
    return "1 seed" if n == 1 else f"medians of {n} seeds"


def speed_ratio(dew_seconds: float, trl_seconds: float) -> float | None:
    """TRL seconds / dew seconds (dew's speed over TRL's); None when neither got there."""
    if dew_seconds == float("inf") and trl_seconds == float("inf"):
        return None
    if dew_seconds == float("inf"):
        return 0.0
    return trl_seconds / dew_seconds


@dataclass
class Report:
    """The printed figures (also the section's body) and the summary rows they support."""

    text: str
    rows: list[tuple[str, str, str, str]]  # (benchmark, measured, target, status)


def _status(ratio: float | None, *, strict: bool = False) -> str:
    if ratio is None:
        return "NOT met (neither reached it)"
    ok = ratio > 1 if strict else ratio >= 1
    return "met" if ok else f"NOT met ({ratio:.2f}x)"


def single_report(results: dict[str, list[RunResult]]) -> Report:
    """Per-seed rows, median rows, the two dew/TRL ratios and their summary rows."""
    lines = [
        f"| system | seed | time to reward {THRESHOLD} | steps run | completions/s | s/step |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for system in ("dew", "trl"):
        for r in results[system]:
            lines.append(
                f"| {NAMES[system]} | {r.spec.seed} | {reach_cell(r)} | {r.steps} "
                f"| {r.completions_per_second:,.0f} | {r.seconds_per_step:.3f} |"
            )
    seconds: dict[str, float] = {}
    rate: dict[str, float] = {}
    for system in ("dew", "trl"):
        runs = results[system]
        seconds[system], cell = median_reach(runs)
        rate[system] = statistics.median(r.completions_per_second for r in runs)
        per_step = statistics.median(r.seconds_per_step for r in runs)
        steps = statistics.median(r.steps for r in runs)
        lines.append(
            f"| {NAMES[system]} | median | {cell} | {steps:g} | {rate[system]:,.0f} "
            f"| {per_step:.3f} |"
        )
    ratio = speed_ratio(seconds["dew"], seconds["trl"])
    rate_ratio = rate["dew"] / rate["trl"]
    ratio_text = "n/a (neither reached it)" if ratio is None else f"{ratio:.2f}x"
    lines += [
        "",
        f"- time to reward {THRESHOLD}, dew speed / TRL speed (TRL s / dew s, medians): "
        f"{ratio_text}",
        f"- completions/s, dew / TRL (medians): {rate_ratio:.2f}x",
    ]
    seeds = len(results["dew"])
    if ratio is None:
        reached = "neither reached it"
    else:
        reached = (
            f"dew {seconds['dew']:.1f} s, TRL {seconds['trl']:.1f} s ({_of_seeds(seeds)}): "
            f"dew/TRL speed {ratio:.2f}x"
        )
    target = "dew faster (ratio >= 1)"
    rows = [
        (f"vs TRL: time to reward {THRESHOLD}", reached, target, _status(ratio)),
        (
            "vs TRL: completions/s",
            f"dew {rate['dew']:,.0f}, TRL {rate['trl']:,.0f} completions/s "
            f"({_of_seeds(seeds)}): {rate_ratio:.2f}x",
            target,
            _status(rate_ratio),
        ),
    ]
    return Report("\n".join(lines), rows)


def multi_report(results: dict[str, list[RunResult]], latency: float) -> Report:
    """Rows per run and seed, the async/sync and async/TRL ratios, the summary row."""
    lines = [
        f"| run | seed | steps | s/step | completions/s | time to reward {THRESHOLD} "
        f"| reward, last {WINDOW} steps |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    rate: dict[str, float] = {}
    step: dict[str, float] = {}
    for label, _, _ in MULTI_RUNS:
        for r in results[label]:
            lines.append(
                f"| {label} | {r.spec.seed} | {r.steps} | {r.seconds_per_step:.3f} "
                f"| {r.completions_per_second:,.0f} | {reach_cell(r)} | {r.final_reward():.2f} |"
            )
        rate[label] = statistics.median(r.completions_per_second for r in results[label])
        step[label] = statistics.median(r.seconds_per_step for r in results[label])
    async_, sync, trl = (label for label, _, _ in MULTI_RUNS)
    async_ratio = rate[async_] / rate[sync]
    lines += [
        "",
        f"- completions/s, dew async / dew sync: {async_ratio:.2f}x",
        f"- completions/s, dew async / TRL: {rate[async_] / rate[trl]:.2f}x",
    ]
    row = (
        "multi-turn async vs sync",
        f"two-turn copy task, {latency * 1000:g} ms environment latency: dew ahead 1 "
        f"{step[async_]:.3f} s/step, ahead 0 {step[sync]:.3f} s/step: async/sync "
        f"completions/s {async_ratio:.2f}x (TRL {step[trl]:.3f} s/step)",
        "async faster than sync (ratio > 1)",
        _status(async_ratio, strict=True),
    )
    return Report("\n".join(lines), [row])


# ------------------------------------------------------------------ the run


def parse_seeds(text: str) -> list[int]:
    """``--seeds`` text as a list of ints; one clear line and exit 2 on anything else."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--seeds {text!r}: comma-separated integers") from None
    if not seeds:
        raise SystemExit("--seeds: give at least one seed")
    return seeds


# Each system runs on its faster torch thread count on the 2-core machine (RESULTS.md,
# "vs trl: heavy-tailed workload: profile", item 14): dew on one, since the tiny model's
# matrices are too small for a second OpenMP thread to pay and its engine and trainer
# threads already compute at once; TRL on ``--threads``, for its one ``generate`` call.
DEW_THREADS = 1


def threads_of(system: str, args: argparse.Namespace) -> int:
    return args.dew_threads if system == "dew" else args.threads


def thread_text(args: argparse.Namespace) -> str:
    if args.dew_threads == args.threads:
        return f"{args.threads} torch threads per run"
    return f"TRL {args.threads} torch threads per run, dew {args.dew_threads}"


def run_single(seeds: list[int], args: argparse.Namespace) -> dict[str, list[RunResult]]:
    results: dict[str, list[RunResult]] = {"dew": [], "trl": []}
    print("single-turn copy task", file=sys.stderr, flush=True)
    for seed in seeds:
        for system in ("dew", "trl"):  # alternating, so both see the same background load
            spec = RunSpec(
                system=system,
                task="single",
                seed=seed,
                threads=threads_of(system, args),
                max_seconds=args.max_seconds,
                max_steps=args.max_steps,
                stop_at_reward=True,
            )
            result = run_worker(spec, timeout=args.max_seconds + 300)
            if args.save:
                save_result(args.save, "single", system, result)
            _progress(NAMES[system], result)
            results[system].append(result)
    return results


def run_multi(seeds: list[int], args: argparse.Namespace) -> dict[str, list[RunResult]]:
    results: dict[str, list[RunResult]] = {label: [] for label, _, _ in MULTI_RUNS}
    print(f"two-turn copy task, {args.latency * 1000:g} ms latency", file=sys.stderr, flush=True)
    for seed in seeds:
        for label, system, ahead in MULTI_RUNS:
            spec = RunSpec(
                system=system,
                task="multi",
                seed=seed,
                threads=threads_of(system, args),
                max_seconds=args.mt_steps * 10.0,  # a cap the step count reaches first
                max_steps=args.mt_steps,
                stop_at_reward=False,
                ahead=ahead,
                latency=args.latency,
            )
            result = run_worker(spec, timeout=args.mt_steps * 10 + 300)
            if args.save:
                save_result(args.save, "multi", label, result)
            _progress(label, result)
            results[label].append(result)
    return results


def method(args: argparse.Namespace) -> str:
    return (
        "dew against Hugging Face TRL's `GRPOTrainer` on the demo's copy task "
        '(`DemoConfig.for_task("single")`: tiny qwen2, char tokenizer, lr 1e-3, 4 prompts '
        "x 32 samples per step, 3 new tokens, temperature 1, group-std advantages, clip "
        "0.2/0.28, no KL, one AdamW update per batch, grad norm 1, CPU fp32), both from the "
        "same initial weights and scored by the demo's verifier. dew runs as the demo does "
        "(scheduler ahead 1, in-process RolloutServer; the single-turn source submits "
        "every prompt as a future, so no thread waits on a generation, and runs the "
        "verifier on 2 threads); TRL samples with `model.generate` "
        'on the training model, then trains (`loss_type="dr_grpo"`: a constant '
        "normalizer, as dew's). Time to reward: wall seconds from the start of training "
        f"until the mean reward of the last {WINDOW} steps first reaches {THRESHOLD} (runs "
        f"capped at {args.max_seconds:g} s); completions/s: completions trained / wall "
        "seconds of training. Each run is its own process, one at a time, torch pinned "
        f"({thread_text(args)}; dew's engine and trainer threads compute at the same time, "
        "TRL's generation and training one after the other). Two-turn task: the same "
        "skill over two turns of three "
        f"digits, {args.latency * 1000:g} ms slept in every environment step, "
        f"{args.mt_steps} steps per run; a completion is a whole episode. TRL runs it "
        "through `rollout_func` (its tools / `environment_factory` path continues a "
        "conversation only on a parsed tool call), one batched `model.generate` per turn, "
        "the environments stepped concurrently."
    )


def _settings_of(
    args: argparse.Namespace,
    singles: dict[str, list[RunResult]],
    multis: dict[str, list[RunResult]],
) -> None:
    """Set the run's settings in ``args`` from saved results (``--load``), so the section
    describes the runs it shows, not this command's defaults."""
    one = next(iter(singles.values()))[0].spec
    args.max_seconds, args.max_steps = one.max_seconds, one.max_steps
    many = next(iter(multis.values()))[0].spec
    args.mt_steps, args.latency = many.max_steps, many.latency
    threads = {r.spec.system: r.spec.threads for rs in singles.values() for r in rs}
    args.threads = threads.get("trl", one.threads)
    args.dew_threads = threads.get("dew", one.threads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2", help="seeds of the single-turn runs")
    ap.add_argument("--mt-seeds", default="0", help="seeds of the two-turn runs")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of TRL's runs")
    ap.add_argument(
        "--dew-threads", type=int, default=DEW_THREADS, help="torch threads of dew's runs"
    )
    ap.add_argument("--max-seconds", type=float, default=300.0, help="cap per single-turn run")
    ap.add_argument("--max-steps", type=int, default=5000, help="step cap per single-turn run")
    ap.add_argument("--mt-steps", type=int, default=400, help="steps of every two-turn run")
    ap.add_argument("--latency", type=float, default=0.02, help="seconds per environment step")
    ap.add_argument("--save", default=None, help="folder to keep every run's result in")
    ap.add_argument("--load", default=None, help="render the results saved in this folder")
    ap.add_argument("--tiny", action="store_true", help="a few steps of everything, no write")
    ap.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args()
    seeds, mt_seeds = parse_seeds(args.seeds), parse_seeds(args.mt_seeds)
    if args.tiny:
        seeds, mt_seeds = seeds[:1], mt_seeds[:1]
        args.max_steps, args.mt_steps, args.max_seconds = 2, 2, 60.0
        args.write = False
    if args.threads < 1 or args.dew_threads < 1:
        raise SystemExit("--threads and --dew-threads must be >= 1")
    if find_spec("trl") is None:
        raise SystemExit(
            "trl is not installed here; it comes with the dev extra: pip install -e '.[dev]'"
        )
    if args.save:
        Path(args.save).mkdir(parents=True, exist_ok=True)

    t0 = time.monotonic()
    if args.load:
        singles = load_results(args.load, "single", list(NAMES), every=True)
        labels = [label for label, _, _ in MULTI_RUNS]
        multis = load_results(args.load, "multi", labels, every=True)
        _settings_of(args, singles, multis)
        seeds = sorted({r.spec.seed for rs in singles.values() for r in rs})
        mt_seeds = sorted({r.spec.seed for rs in multis.values() for r in rs})
    else:
        singles, multis = run_single(seeds, args), run_multi(mt_seeds, args)
    single = single_report(singles)
    multi = multi_report(multis, args.latency)
    elapsed = time.monotonic() - t0
    body = (
        f"### single-turn copy task (seeds {','.join(map(str, seeds))})\n\n{single.text}\n\n"
        f"### two-turn copy task, {args.latency * 1000:g} ms environment latency "
        f"(seeds {','.join(map(str, mt_seeds))})\n\n{multi.text}\n"
    )
    print(body)
    for name, measured, target, status in single.rows + multi.rows:
        print(f"{name}: {measured}; target {target}: {status}")
    print(f"\nbench wall time: {elapsed:.0f} s ({thread_text(args)})")
    run = run_provenance("vs_trl.py", elapsed, args)
    if not args.write:
        return
    lines = provenance_lines(run)
    write_section(f"## vs trl\n\n{method(args)}\n\n{lines}\n{body}")
    for row in single.rows + multi.rows:
        write_summary_row(*row)
    print(f"wrote the vs trl section of {RESULTS}")


if __name__ == "__main__":
    main()
