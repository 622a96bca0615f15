"""The scheduler's hand-off: a trainer call whose batch is complete, before and after the
driver hands it over ahead of the rollouts the same call submits.

``dew train examples/copy.toml`` (three-token answers: the engine keeps ahead of the
trainer, so every step's wait is the hand-off alone), run by two source trees in turn
for each seed: ``--before`` (a checkout of the commit to compare against; its ``src`` is
put first on ``PYTHONPATH``) and this one. Per run: seconds per step and seconds the
trainer waited per step, means over the steps after ``--skip``, from the run's records;
the ratio of each seed's two runs, then their median and spread.

    git worktree add /tmp/dew-before 8961630
    .venv/bin/python bench/handoff.py --before /tmp/dew-before --seeds 21,22,23 --write
    .venv/bin/python bench/handoff.py --load runs/bench/handoff --write
    .venv/bin/python bench/handoff.py --tiny       # a smoke run: this tree against itself
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import provenance, provenance_lines, write_section
from _stats import OtherLoad, load_summary

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("before", "after")


def run_copy(src: Path | None, seed: int, steps: int, run: Path) -> dict[str, Any]:
    """One ``dew train`` of the copy example by the tree whose ``src`` is ``src`` (None:
    this one); its wall time and the cores other work took meanwhile."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")]).rstrip(":")
    cmd = [sys.executable, "-m", "dew.cli", "train", str(ROOT / "examples" / "copy.toml")]
    cmd += ["--no-progress", "--output.run_dir", str(run), "--training.steps", str(steps)]
    cmd += ["--training.seed", str(seed), "--output.checkpoint_every", str(steps)]
    t0 = time.monotonic()
    with OtherLoad() as load:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return {"run": str(run), "seconds": time.monotonic() - t0, "load": load.cores}


def figures(run: Path, skip: int) -> dict[str, float]:
    """Mean seconds per step and seconds waited per step after ``skip`` steps."""
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    steps = [r for r in records if "scheduler" in r][skip:]
    if not steps:
        raise SystemExit(f"{run}: no step after the first {skip}")
    return {
        "step": statistics.fmean(float(r["seconds"]) for r in steps),
        "waited": statistics.fmean(float(r["scheduler"]["waited"]) for r in steps),
    }


def measure(before: Path, seeds: list[int], steps: int, skip: int, out: Path) -> list[dict]:
    if not (before / "src" / "dew").is_dir():
        raise SystemExit(f"--before {before}: no src/dew there (a checkout of dew)")
    results = []
    for seed in seeds:
        row: dict[str, Any] = {"seed": seed}
        for side in SIDES:  # interleaved: one seed's two runs follow each other
            run = out / f"seed-{seed}" / side
            ran = run_copy(before / "src" if side == "before" else None, seed, steps, run)
            row[side] = {**ran, **figures(run, skip)}
            print(f"seed {seed} {side}: {row[side]['step'] * 1e3:.1f} ms/step", flush=True)
        results.append(row)
    return results


def render(results: list[dict], prov: dict[str, Any], before: str) -> str:
    loads = [r[side]["load"] for r in results for side in SIDES]
    load_line, _ = load_summary(loads)
    lines = [
        "## scheduler hand-off",
        "",
        "`dew train examples/copy.toml` run by the tree before the change and by this one,",
        "in turn for each seed: the trainer's call gets a complete batch before the rollouts",
        "the same call submits are started (before: after them). Means per step over the",
        "steps after the skip, from each run's records; ratio: after over before. Before:",
        f"commit {before}.",
        "",
        provenance_lines(prov).rstrip("\n"),
        f"- load: {load_line}",
        "",
        "| seed | s/step before | after | ratio | waited before | after | other load |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for r in results:
        b, a = r["before"], r["after"]
        ratios.append(a["step"] / b["step"])
        lines.append(
            f"| {r['seed']} | {b['step']:.4f} | {a['step']:.4f} | {ratios[-1]:.2f}x | "
            f"{b['waited'] * 1e3:.1f} ms | {a['waited'] * 1e3:.1f} ms | "
            f"{max(b['load'], a['load']):.2f} |"
        )
    waits = [r["after"]["waited"] / r["before"]["waited"] for r in results]
    lines += [
        "",
        f"Seconds per step, after over before: median {statistics.median(ratios):.2f}x "
        f"({min(ratios):.2f}-{max(ratios):.2f}x); seconds waited per step: median "
        f"{statistics.median(waits):.2f}x ({min(waits):.2f}-{max(waits):.2f}x).",
    ]
    return "\n".join(lines) + "\n"


def _commit(tree: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, help="a checkout of the commit to compare against")
    ap.add_argument("--seeds", default="21,22,23", help="comma-separated seeds")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=6, help="first steps left out")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "handoff")
    ap.add_argument("--load", type=Path, default=None, metavar="DIR", help="render DIR's results")
    ap.add_argument("--write", action="store_true", help="write the section to RESULTS.md")
    ap.add_argument("--tiny", action="store_true", help="one seed, few steps: a smoke run")
    args = ap.parse_args()
    if args.load is not None:
        saved = json.loads((args.load / "results.json").read_text())
    else:
        if args.tiny:  # this tree against itself: the mechanics, not a comparison
            args.before, args.seeds, args.steps, args.skip = args.before or ROOT, "0", 6, 2
        if args.before is None:
            ap.error("--before PATH is needed to measure (or --load DIR to render)")
        if not (ROOT / "runs" / "examples" / "copy.jsonl").exists():
            make = [sys.executable, str(ROOT / "examples" / "make_assets.py")]
            subprocess.run(make, cwd=ROOT, check=True)
        t0 = time.monotonic()
        seeds = [int(s) for s in args.seeds.split(",")]
        results = measure(args.before.resolve(), seeds, args.steps, args.skip, args.out)
        prov = provenance("handoff.py", time.monotonic() - t0)
        saved = {"results": results, "provenance": prov, "before": _commit(args.before)}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(saved, indent=1))
    text = render(saved["results"], saved["provenance"], saved.get("before", "unknown"))
    print(text)
    if args.write:
        write_section(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
