"""``dew plan --from-run``: the fit beside what it was fitted on, then the ranking.

Plain functions over a :class:`~dew.plan.fit.RunFit`; they return lines and print
nothing, so the CLI and the benchmark read the same report.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from dew.objectives.rl.config import SchedulerConfig
from dew.plan._trace import Figures
from dew.plan.fit import RunFit
from dew.plan.planner import plan, recommend

__all__ = ["Ranked", "fit_lines", "overrides", "rank", "table"]


@dataclass(frozen=True)
class Ranked:
    """Every planned policy with its figures, the run's own first, and the one to run."""

    rows: list[tuple[SchedulerConfig, Figures]]
    own: Figures  # the run's own policy, planned
    best: SchedulerConfig
    best_figures: Figures


def _pct(predicted: float, measured: float) -> str:
    if not measured or not math.isfinite(predicted):
        return "   n/a"
    return f"{(predicted / measured - 1) * 100:+5.0f}%"


def fit_lines(fit: RunFit) -> list[str]:
    """The fitted model next to the run's figures it came from."""
    m, p = fit.measured, fit.lengths
    drawn = {
        q: math.exp(p.mu + z * p.sigma)
        for q, z in (("q16", -0.9945788), ("q50", 0.0), ("q84", 0.9945788))
    }
    lines = [
        f"fitted on {fit.steps} steps: {fit.tasks} tasks x {fit.group} per step, "
        f"policy {fit.policy.name}",
        f"  lengths    lognormal(median {math.exp(p.mu):.3g}, sigma {p.sigma:.3g}: "
        f"{p.sigma_task:.3g} between tasks, {p.sigma_sample:.3g} within a group), cap {p.cap}",
        "             fitted q16/q50/q84 "
        + " / ".join(f"{min(drawn[q], p.cap):.3g}" for q in ("q16", "q50", "q84"))
        + "   run's "
        + " / ".join(f"{m.lengths[q]:.3g}" for q in ("q16", "q50", "q84"))
        + f"   (q99 {m.lengths['q99']:.3g}, {m.truncated:.1%} at the cap)",
    ]
    if fit.latency:
        lines.append(
            f"  outside    lognormal(median {fit.latency * 1e3:.3g} ms, "
            f"sigma {fit.latency_sigma:.3g})   run's q16/q50/q84 "
            + " / ".join(f"{m.outside[q] * 1e3:.3g}" for q in ("q16", "q50", "q84"))
            + " ms"
        )
    else:
        lines.append("  outside    0 s (none recorded)")
    e = fit.engine
    lines.append(
        f"  engine     {fit.engines} x (a {e.a * 1e3:.3g} ms + b {e.b * 1e3:.3g} ms x active), "
        f"max {e.max_active} active: full throughput "
        f"{e.full_throughput * fit.engines:,.0f} tokens/s"
    )
    for name, (a, b, n) in fit.per_engine.items():
        lines.append(
            f"             {name}: a {a * 1e3:.3g} ms, b {b * 1e3:.3g} ms, {n:,} iterations"
        )
    lines.append(
        f"  trainer    T {fit.T:.3g} s of work per step alone; at work {m.busy:.3g} s per step "
        f"(its step less its wait, median) and waiting {m.waited:.3g} s"
    )
    lines.append(
        f"  sharing    {fit.sharing:.2f}: the share of its speed the trainer and an engine "
        "keep while both work"
        + (" (separate devices)" if fit.sharing == 1.0 else " (shared cores)")
    )
    lines.append(
        f"  turns      {m.turns:.2g} calls per rollout ("
        + ", ".join(f"{k}: {share:.0%}" for k, share in enumerate(fit.turns, 1) if share)
        + f"), a rollout's length split evenly over them; prompts median {m.prompt:.3g} "
        "tokens"
    )
    lines.append(f"  cost       the profile took {m.profile_cpu * 1e3:.2g} ms CPU per step")
    lines.append(
        f"  the run    {m.step_time:.3g} s per step, {m.samples_per_s:.3g} admitted samples/s, "
        f"{m.limit_fraction:.2f} of its limit max(T, batch tokens / full throughput)"
    )
    lines.extend(f"  note: {w}" for w in fit.warnings)
    return lines


def rank(
    fit: RunFit,
    policies: Sequence[SchedulerConfig],
    *,
    max_bias: float = 0.02,
    steps: int = 16,
    warmup: int = 4,
    seed: int = 0,
) -> Ranked:
    """Plan the run's own policy and ``policies`` on the fitted scenario; the recommended
    one is :func:`~dew.plan.planner.recommend`'s choice among them all."""
    scenario = fit.scenario(steps=steps, warmup=warmup, seed=seed)
    own = dataclasses.replace(fit.policy, timeout=None)
    rows = [(own, plan(own, scenario))]
    for policy in policies:
        if policy.name != own.name:
            rows.append((policy, plan(policy, scenario)))
    best = recommend(rows, max_bias)
    figures = next(f for p, f in rows if p is best)
    return Ranked(rows, rows[0][1], best, figures)


def overrides(policy: SchedulerConfig, kind: str, run_line: str = "") -> str:
    """The command-line overrides that run ``policy`` (``kind``: "demo" or "train")."""
    knobs = {
        "ahead": policy.ahead,
        "max_lag": policy.max_lag,
        "oversample": policy.oversample,
        "admit": policy.admit,
    }
    if kind == "train":
        head = ["dew train", run_line or "CONFIG"]
        parts = [f"--scheduler.{k} {v}" for k, v in knobs.items() if v is not None]
    else:
        head = ["dew demo", run_line]
        parts = [f"--{k.replace('_', '-')} {v}" for k, v in knobs.items() if v is not None]
    return " ".join(x for x in (*head, *parts) if x)


def table(ranked: Ranked, fit: RunFit) -> list[str]:
    """The ranking: each policy's predicted figures, the run's own against its measure."""
    head = (
        f"{'policy':<28} {'fraction':>8} {'samples/s':>9} {'s/step':>7} {'tr idle':>7} "
        f"{'lag':>5} {'bias':>6} {'wasted':>6}"
    )
    lines = [head]
    for i, (policy, f) in enumerate(ranked.rows):
        mark = " (this run)" if i == 0 else ""
        lines.append(
            f"{(policy.name + mark):<28} {f.fraction:>8.3f} {f.samples_per_s:>9.3g} "
            f"{f.step_time:>7.3g} {f.trainer_idle:>7.2f} {f.lag:>5.2f} {f.length_bias:>6.3f} "
            f"{f.wasted:>6.3f}"
        )
    m, own = fit.measured, ranked.own
    lines.append(
        f"this run, predicted against measured: {own.step_time:.3g} vs {m.step_time:.3g} s per "
        f"step ({_pct(own.step_time, m.step_time)}), {own.samples_per_s:.3g} vs "
        f"{m.samples_per_s:.3g} samples/s ({_pct(own.samples_per_s, m.samples_per_s)})"
    )
    return lines
