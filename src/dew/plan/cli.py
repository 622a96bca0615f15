"""``dew plan``: predict each scheduling policy's throughput before spending accelerators.

Example::

    dew plan --preset dapo --tasks 64 --group 8 --T 0.5x
    dew plan --preset longcot --tasks 128 --group 16 --T 120 --policies "0;1;2;1,os=4"
    dew plan --preset tail --tasks 8 --group 8 --T 0.15 --latency 0.05 --latency-sigma 0.6

The last line names the policy to run: the most admitted samples per second among the
policies whose length bias stays within ``--max-bias`` (see
:func:`dew.plan.planner.recommend`).

``--T`` is seconds, or a multiple of one batch's generation time at full engine
throughput when it ends in ``x``. ``--policies`` is a ``;``-separated list of
``ahead[,os=N][,admit=N][,lag=N]`` (oversample and admit may be given as ``N%`` of the
group and of the tasks).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from dew.objectives.rl.config import SchedulerConfig
from dew.plan._engine import EngineConfig
from dew.plan.planner import Scenario, generation_time, plan, recommend
from dew.plan.presets import PRESETS, preset

__all__ = ["default_policies", "main", "parse_policy"]


def default_policies(tasks: int, group: int) -> list[SchedulerConfig]:
    """The compared policies, each with the tightest ``max_lag`` its knobs allow."""
    quarter = max(group // 4, 1)
    tight = SchedulerConfig.tight
    return [
        tight(ahead=0),
        tight(ahead=1),
        tight(ahead=2),
        tight(ahead=1, oversample=quarter),
        tight(ahead=1, oversample=group),
        tight(ahead=1, admit=max(tasks * 3 // 4, 1)),
        tight(ahead=2, oversample=quarter),
    ]


def _count(text: str, of: int, name: str) -> int:
    try:
        if text.endswith("%"):
            return max(round(float(text[:-1]) / 100 * of), 1)
        return int(text)
    except ValueError:
        raise ValueError(f"policy {name}={text!r}: expected an int or a percentage") from None


def parse_policy(text: str, tasks: int, group: int) -> SchedulerConfig:
    """``ahead[,os=N|N%][,admit=N|N%][,lag=N]`` as a scheduler config.

    Without ``lag``, ``max_lag`` is the smallest the other knobs allow
    (:meth:`SchedulerConfig.tight`). ``groups`` is left at its default: the scenario's
    group replaces it when the policy is planned.
    """
    head, *opts = [p.strip() for p in text.split(",")]
    try:
        kw: dict[str, int | None] = {"ahead": int(head)}
    except ValueError:
        raise ValueError(f"policy {text!r}: must start with ahead (an int)") from None
    for opt in opts:
        key, _, value = opt.partition("=")
        if key == "os":
            kw["oversample"] = _count(value, group, "os")
        elif key == "admit":
            kw["admit"] = _count(value, tasks, "admit")
        elif key == "lag":
            kw["max_lag"] = _count(value, 1, "lag")
        else:
            raise ValueError(f"policy {text!r}: unknown option {key!r} (os, admit, lag)")
    if "max_lag" in kw:
        return SchedulerConfig(**kw)  # type: ignore[arg-type]
    return SchedulerConfig.tight(**kw)


def _seconds(text: str, gen: float) -> float:
    try:
        return float(text[:-1]) * gen if text.endswith("x") else float(text)
    except ValueError:
        raise ValueError(f"--T={text!r}: seconds, or a multiple such as 0.5x") from None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="dew plan",
        description="Predict each scheduling policy's throughput, idle time, lag and "
        "length bias before spending accelerators, with an event-driven model of one "
        "shared engine and a trainer.",
        epilog="examples:\n  dew plan --preset dapo --tasks 64 --group 8 --T 0.5x\n"
        '  dew plan --preset longcot --tasks 128 --group 16 --T 120 --policies "0;1;2;1,os=4"\n'
        "  dew plan --preset tail --tasks 8 --group 8 --T 0.15 --latency 0.05 --latency-sigma 0.6",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--preset",
        default=None,
        choices=sorted(PRESETS),
        help="rollout-length distribution fitted to published traces (default: dapo)",
    )
    ap.add_argument("--tasks", type=int, default=None, help="tasks per batch (default: 64)")
    ap.add_argument("--group", type=int, default=None, help="samples per task (default: 8)")
    ap.add_argument(
        "--T",
        default=None,
        help="trainer seconds per step; 'Nx' means N times one batch's generation time at "
        "full engine throughput (default: 1x)",
    )
    ap.add_argument(
        "--policies",
        default=None,
        help="';'-separated policies, each ahead[,os=N][,admit=N][,lag=N] (oversample and "
        "admit also as N%% of the group or the tasks); default: a fixed comparison set",
    )
    ap.add_argument("--steps", type=int, default=12, help="steps planned per policy (default: 12)")
    ap.add_argument(
        "--warmup", type=int, default=3, help="first steps left out of the figures (default: 3)"
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampled lengths")
    ap.add_argument(
        "--a", type=float, default=None, help="engine seconds per iteration (default: 4.5e-3)"
    )
    ap.add_argument(
        "--b",
        type=float,
        default=None,
        help="engine seconds per active sequence per iteration (default: 4e-5)",
    )
    ap.add_argument(
        "--max-active",
        type=int,
        default=None,
        help="sequences the engine runs at once (default: 256)",
    )
    ap.add_argument(
        "--latency",
        type=float,
        default=None,
        help="median seconds from a rollout's last token to its score, drawn per rollout "
        "from a lognormal (default: 0, scored at once)",
    )
    ap.add_argument(
        "--latency-sigma",
        type=float,
        default=None,
        help="sigma of that lognormal (default: 0, every rollout waits --latency)",
    )
    ap.add_argument(
        "--max-bias",
        type=float,
        default=0.02,
        help="the recommended policy's mean admitted length stays within this share of "
        "the drawn mean (default: 0.02)",
    )
    ap.add_argument(
        "--from-run",
        default=None,
        metavar="RUN",
        help="fit the model to a run folder's step records instead of --preset, --tasks, "
        "--group, --T, --a, --b, --max-active and --latency (see dew.plan.fit)",
    )
    ap.add_argument(
        "--skip-steps",
        type=int,
        default=3,
        help="with --from-run: first steps left out of the fit (default: 3)",
    )
    args = ap.parse_args(argv)
    if args.from_run is not None:
        return _from_run(ap, args)
    for name, default in _MODEL_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    try:
        return _from_flags(args)
    except ValueError as exc:
        ap.error(str(exc))
    return 2


# The model's flags, left None by the parser so that --from-run can refuse them.
_MODEL_DEFAULTS = {
    "preset": "dapo",
    "tasks": 64,
    "group": 8,
    "T": "1x",
    "a": 4.5e-3,
    "b": 0.04e-3,
    "max_active": 256,
    "latency": 0.0,
    "latency_sigma": 0.0,
}


def _policies(args: argparse.Namespace, tasks: int, group: int) -> list[SchedulerConfig]:
    if not args.policies:
        return default_policies(tasks, group)
    return [parse_policy(x, tasks, group) for x in args.policies.split(";") if x.strip()]


def _from_run(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from pathlib import Path

    from dew.plan._from_run import fit_lines, overrides, rank, table
    from dew.plan.fit import RunError, fit_run, run_config

    given = [f"--{k.replace('_', '-')}" for k in _MODEL_DEFAULTS if getattr(args, k) is not None]
    if given:
        ap.error(f"--from-run fits {', '.join(given)} from the run's records; drop them")
    try:
        fit = fit_run(args.from_run, skip=args.skip_steps)
        policies = _policies(args, fit.tasks, fit.group)
    except (RunError, ValueError) as exc:
        print(f"dew plan: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(fit_lines(fit)))
    ranked = rank(
        fit, policies, max_bias=args.max_bias, steps=args.steps, warmup=args.warmup, seed=args.seed
    )
    print("\n".join(table(ranked, fit)))
    best, f = ranked.best, ranked.best_figures
    run = Path(args.from_run)
    kind, config = run_config(run if run.is_dir() else run.parent)
    folder = run if run.is_dir() else run.parent
    line = {"demo": f"--task {config.get('task', 'single')}", "train": str(folder / "config.toml")}
    print(
        f"recommended: {best.name}: {f.fraction:.2f} of the limit, {f.samples_per_s:.3g} "
        f"samples/s ({f.samples_per_s / ranked.own.samples_per_s:.2f}x this run's policy as "
        f"planned), lag {f.lag:.2f}, length bias {f.length_bias:.3f}"
    )
    if best.name == fit.policy.name:
        print("  this run's own policy: keep it")
    for k in [kind] if kind else ["demo", "train"]:
        print(f"  run it: {overrides(best, k, line.get(k, ''))}")
    return 0


def _from_flags(args: argparse.Namespace) -> int:
    engine = EngineConfig(args.a, args.b, args.max_active)
    p = preset(args.preset)
    gen = generation_time(p, args.tasks, args.group, engine)
    T = _seconds(args.T, gen)
    sc = Scenario(
        p,
        args.tasks,
        args.group,
        T,
        steps=args.steps,
        warmup=args.warmup,
        seed=args.seed,
        engine=engine,
        latency=args.latency,
        latency_sigma=args.latency_sigma,
    )
    pols = _policies(args, args.tasks, args.group)
    print(
        f"{args.preset}: {args.tasks} tasks x {args.group}, T = {T:.3g} s, one batch at full "
        f"throughput ({engine.full_throughput:,.0f} tokens/s) = {gen:.3g} s"
        + (
            f", verifier latency lognormal(median {args.latency:g} s, sigma {args.latency_sigma:g})"
            if args.latency
            else ""
        )
    )
    head = (
        f"{'policy':<28} {'fraction':>8} {'samples':>8} {'tr idle':>7} {'en idle':>7} "
        f"{'lag':>5} {'tok lag':>7} {'bias':>6} {'wasted':>6} {'ms':>5}"
    )
    print(head)
    rows = []
    for pol in pols:
        t0 = time.perf_counter()
        f = plan(pol, sc)
        rows.append((pol, f))
        ms = (time.perf_counter() - t0) * 1e3
        print(
            f"{pol.name:<28} {f.fraction:>8.3f} {f.samples_ratio:>8.3f} {f.trainer_idle:>7.2f} "
            f"{f.engine_idle:>7.2f} {f.lag:>5.2f} {f.token_lag:>7.2f} {f.length_bias:>6.3f} "
            f"{f.wasted:>6.3f} {ms:>5.0f}"
        )
    print(
        "fraction: of max(T, batch tokens / full throughput); samples: admitted samples/s "
        "against the limit's; bias: mean admitted length / mean drawn length"
    )
    print(
        f"recommended: {recommend(rows, args.max_bias).name} (the most samples/s with a "
        f"length bias within {args.max_bias:g})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
