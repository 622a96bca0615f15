"""The planner's model fitted to a run's own step records (``dew plan --from-run``).

A run folder's ``records.jsonl`` holds, per step, the scheduler's account and its
``profile`` (:mod:`dew.objectives.rl.profile`). :func:`fit_run` reads the steps after
the first ``skip`` and fits what :class:`~dew.plan.planner.Scenario` needs:

* **lengths**: a two-level lognormal (:class:`~dew.plan.presets.LengthPreset`). Its
  median and spread come from quantiles of the finished lengths (16th, 50th and 84th
  percentiles, about one sigma either side; only the lower side when more than a
  tenth of the rollouts reached the cap, whose tail the cap hides), and the split of
  the spread between tasks and within a group from the groups' log-length sums (the
  variance of group means less the part a group's own spread explains). The cap is
  the longest truncated length, or the run's ``max_tokens``.
* **latency**: the seconds rollouts spent outside the engine after each model call,
  as a lognormal from the same quantiles (0 when the source kept none).
* **turns**: the shares of rollouts that made 1, 2, 3, ... model calls; the planner
  draws each rollout's and splits its length evenly over them. A config's
  ``max_tokens`` bounds one call, so a multi-turn rollout's cap is that many times the
  most turns seen.
* **T**: the median over steps of the step's seconds less what it waited on rollouts:
  the trainer's own time per step (its update, the weight push, the packing), less
  what running beside the engines cost it (below).
* **sharing**: on one machine the trainer and the engines share its cores. The
  profile tells the engine's iterations that ran while the trainer waited (alone)
  from the rest (beside the trainer's work); at like active counts, seconds per
  iteration alone over beside is the share of its speed each keeps while both work
  (1 on separate devices). The engine line is fitted to the iterations as they would
  have run alone, and ``T`` to the trainer's work alone: its busy seconds less
  ``(1 - sharing)`` of the engine seconds beside it. The planner runs them side by side
  again with that sharing (:class:`~dew.plan.planner.Scenario`).
* **engine**: per engine, ``a + b * active`` by least squares over its iteration log
  (:meth:`dew.core.IterationLog.fit_line`); the planner runs as many engines as the
  last step saw, each with the iteration-weighted mean of their ``a`` and ``b``.

:class:`RunFit` keeps, next to each fitted value, the figure it was fitted on, so a
poor fit shows (``dew plan --from-run`` prints both), and the run's own measured step
time and admitted samples per second, to compare against the plan of its own policy.
A folder that cannot be fitted raises :class:`RunError`, one line saying what is
missing.
"""

from __future__ import annotations

import json
import math
import statistics
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dew.core import IterationLog, LogHistogram
from dew.core.sketch import BUCKETS_PER_OCTAVE
from dew.objectives.rl.config import SchedulerConfig
from dew.objectives.rl.profile import PROFILE_FORMAT
from dew.plan._engine import EngineConfig
from dew.plan.planner import Scenario
from dew.plan.presets import LengthPreset

__all__ = [
    "MIN_STEPS",
    "Measured",
    "RunError",
    "RunFit",
    "fit_records",
    "fit_run",
    "read_records",
    "run_config",
]

MIN_STEPS = 5  # steps left after the skip: fewer give no steady state to fit
_Z84 = 0.9945788  # the standard normal's 84th percentile: q84 / q50 = exp(sigma * _Z84)
_CAPPED = 0.10  # past this share at the cap, the upper quantiles are the cap's


class RunError(ValueError):
    """A run folder the planner cannot be fitted to (the message says why)."""


@dataclass(frozen=True)
class Measured:
    """What the run did over the fitted steps (means over them)."""

    step_time: float  # seconds per step
    busy: float  # median seconds per step the trainer was at work (the step less its wait)
    samples_per_s: float  # admitted samples per second
    waited: float  # seconds per step the trainer waited on rollouts
    limit_fraction: float  # sum of max(train time, batch tokens / full throughput) / elapsed
    lengths: Mapping[str, float]  # quantiles of the finished lengths (q16, q50, q84, q99)
    outside: Mapping[str, float]  # quantiles of the seconds outside the engine
    prompt: float  # median prompt tokens
    turns: float  # mean calls per rollout
    truncated: float  # share of finished rollouts at the cap
    profile_cpu: float  # mean CPU seconds per step the profile took


@dataclass(frozen=True)
class RunFit:
    """The planner's inputs fitted to a run, and what they were fitted on."""

    lengths: LengthPreset
    latency: float
    latency_sigma: float
    T: float
    engine: EngineConfig  # as it runs alone
    engines: int
    sharing: float  # the share of their speed the trainer and an engine keep side by side
    turns: tuple[float, ...]  # shares of rollouts making 1, 2, 3, ... model calls
    tasks: int
    group: int
    policy: SchedulerConfig  # the run's own
    steps: int  # steps fitted on
    measured: Measured
    per_engine: Mapping[str, tuple[float, float, int]]  # name -> (a, b, iterations)
    warnings: Sequence[str] = field(default_factory=tuple)

    def scenario(self, *, steps: int = 16, warmup: int = 4, seed: int = 0) -> Scenario:
        return Scenario(
            self.lengths,
            self.tasks,
            self.group,
            self.T,
            steps=steps,
            warmup=warmup,
            seed=seed,
            engine=self.engine,
            latency=self.latency,
            latency_sigma=self.latency_sigma,
            engines=self.engines,
            sharing=self.sharing,
            turns=self.turns,
        )


def read_records(run: str | Path) -> list[dict[str, Any]]:
    """The step records of a run folder (or of a ``records.jsonl`` path)."""
    path = Path(run)
    if path.is_dir():
        path = path / "records.jsonl"
    if not path.is_file():
        raise RunError(f"{path}: no step records (records.jsonl) to fit")
    records = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                raise RunError(f"{path}:{n}: not a JSON record") from None
    return records


def run_config(run: Path) -> tuple[str, dict[str, Any]]:
    """``("demo", config.json)`` or ``("train", config.toml)`` of a run folder, or
    ``("", {})`` when it holds neither."""
    try:
        return "demo", json.loads((run / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    try:
        return "train", tomllib.loads((run / "config.toml").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "", {}


def _max_tokens(run: Path) -> int | None:
    """``max_tokens`` from the run's config (``dew demo``'s or ``dew train``'s)."""
    _, config = run_config(run)
    for holder in (config, config.get("sampling") or {}):
        value = holder.get("max_tokens") if isinstance(holder, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def fit_run(run: str | Path, *, skip: int = 3) -> RunFit:
    """Fit the planner to the run folder ``run``, leaving out its first ``skip`` steps."""
    path = Path(run)
    folder = path if path.is_dir() else path.parent
    return fit_records(read_records(path), skip=skip, max_tokens=_max_tokens(folder))


def _quantiles(h: LogHistogram) -> dict[str, float]:
    return {f"q{round(q * 100)}": h.quantile(q) for q in (0.16, 0.5, 0.84, 0.99)}


def _lognormal(h: LogHistogram, capped: bool) -> tuple[float, float]:
    """``(median, sigma)`` of a lognormal through ``h``'s quantiles."""
    q16, q50, q84 = (h.quantile(q) for q in (0.16, 0.5, 0.84))
    if q50 <= 0:
        return 0.0, 0.0
    low = math.log(q50 / q16) / _Z84 if q16 > 0 else math.nan
    if capped or not q84 > 0:
        return q50, max(low, 0.0) if math.isfinite(low) else 0.0
    high = math.log(q84 / q50) / _Z84
    sigma = (low + high) / 2 if math.isfinite(low) else high
    return q50, max(sigma, 0.0)


def _profiled(records: Sequence[Mapping[str, Any]], skip: int) -> list[Mapping[str, Any]]:
    if skip < 0:
        raise RunError(f"--skip-steps={skip}: must be >= 0")
    steps = [r for r in records if "step" in r and "scheduler" in r]
    if not steps:
        raise RunError(
            "the records have no scheduler steps (was the run driven by a RolloutScheduler?)"
        )
    missing = [r["step"] for r in steps if "profile" not in r]
    if missing:
        raise RunError(
            f"steps {missing[0]}..{missing[-1]} have no profile: records from a dew "
            "older than the planner's profile; rerun a few steps with this version"
        )
    newer = {r["profile"].get("format") for r in steps} - {PROFILE_FORMAT}
    if newer:
        raise RunError(
            f"profile format {sorted(newer, key=str)} is not {PROFILE_FORMAT}: records "
            "from another dew version"
        )
    kept = steps[skip:]
    if len(kept) < MIN_STEPS:
        raise RunError(
            f"{len(steps)} steps recorded, {len(kept)} after skipping {skip}: the fit needs "
            f"at least {MIN_STEPS} (run more steps or pass a smaller --skip-steps)"
        )
    return kept


def fit_records(
    records: Sequence[Mapping[str, Any]], *, skip: int = 3, max_tokens: int | None = None
) -> RunFit:
    """Fit the planner to step records (see the module docstring)."""
    steps = _profiled(records, skip)
    warnings: list[str] = []
    profiles = [r["profile"] for r in steps]
    lengths, outside, prompt, turns = (LogHistogram() for _ in range(4))
    cancelled = LogHistogram()
    logs = {"groups": 0.0, "mean_sum": 0.0, "mean_sq": 0.0, "within_ss": 0.0, "within_df": 0.0}
    truncated, cap = 0, 0
    engines: dict[str, IterationLog] = {}
    alone: dict[str, IterationLog] = {}  # iterations while the trainer waited
    beside: dict[str, IterationLog] = {}  # the rest: beside the trainer's own work
    busy: list[float] = []  # per step: engine seconds beside the trainer (engine mean)
    batch_tokens: list[float] = []  # per step: its batch's tokens, at the mean finished length
    engine_slots: dict[str, int] = {}
    kept_outside = False
    for p in profiles:
        finished = LogHistogram.from_json(p["lengths"]["finished"])
        lengths = lengths.merged(finished)
        batch_tokens.append(finished.mean * int(p["policy"]["groups"]) * int(p["policy"]["tasks"]))
        cancelled = cancelled.merged(LogHistogram.from_json(p["lengths"]["cancelled"]))
        prompt = prompt.merged(LogHistogram.from_json(p["prompt"]))
        turns = turns.merged(LogHistogram.from_json(p["turns"]))
        for k in logs:
            logs[k] += float(p["log_groups"][k])
        truncated += int(p["truncated"])
        cap = max(cap, int(p["length_cap"]))
        if "outside" in p:
            kept_outside = True
            outside = outside.merged(LogHistogram.from_json(p["outside"]))
        step_busy = []
        for e in p.get("engines") or ():
            name = str(e["name"])
            log = IterationLog.from_json(e["iterations"])
            _merge(engines, name, log)
            engine_slots[name] = int(e["max_active"])
            if "waiting" in e:
                waiting = IterationLog.from_json(e["waiting"])
                rest = log.since(waiting)
                _merge(alone, name, waiting)
                _merge(beside, name, rest)
                step_busy.append(sum(sec for _, sec in rest.rows().values()))
        busy.append(statistics.fmean(step_busy) if step_busy else 0.0)
    if lengths.count == 0:
        raise RunError("the fitted steps finished no rollout: nothing to fit lengths to")
    share_capped = truncated / lengths.count
    median, sigma = _lognormal(lengths, capped=share_capped > _CAPPED)
    sigma_task, sigma_sample = _split(sigma, logs)
    # A config's max_tokens bounds one call: a multi-turn rollout's is that many per turn.
    turns_max = max(math.floor(turns.quantile(1.0)), 1) if turns.count else 1
    cap = cap or (max_tokens and max_tokens * turns_max) or max(int(lengths.quantile(1.0)) * 4, 1)
    preset = LengthPreset("fitted", math.log(max(median, 1.0)), sigma_task, sigma_sample, cap)

    if kept_outside:
        latency, latency_sigma = _lognormal(outside, capped=False)
    else:
        latency, latency_sigma = 0.0, 0.0
        warnings.append("the source kept no time outside the engine: verifier latency taken as 0")

    sharing = _sharing(alone, beside)
    if sharing is None:
        sharing = 1.0
        if beside:
            warnings.append(
                "too few iterations at like loads with and without the trainer at work to "
                "measure how they share the machine: taken as separate devices"
            )
    else:  # what the iterations beside the trainer would have taken alone
        engines = {
            n: _scaled(alone.get(n), beside.get(n), sharing) or log for n, log in engines.items()
        }
    per_engine, engine, n_engines = _fit_engines(engines, engine_slots, steps, warnings)

    seconds = [float(r["seconds"]) for r in steps]
    waited = [float(r["scheduler"]["waited"]) for r in steps]
    busy_T = [s - w for s, w in zip(seconds, waited, strict=True)]
    # The trainer's work alone: step k's busy time ran beside the engine for the engine
    # seconds the next step's profile counts before its wait (its training, its push).
    alongside = [*busy[1:], busy[-1]]
    T = statistics.median(
        t - (1.0 - sharing) * min(e, t) for t, e in zip(busy_T, alongside, strict=True)
    )
    policy_json = profiles[-1]["policy"]
    group = int(policy_json["groups"])
    tasks = max(int(p["policy"]["tasks"]) for p in profiles)
    policy = SchedulerConfig(
        groups=group,
        oversample=int(policy_json["oversample"]),
        admit=policy_json["admit"],
        max_lag=int(policy_json["max_lag"]),
        ahead=int(policy_json["ahead"]),
        sync_every=int(policy_json["sync_every"]),
    )
    if cancelled.count:
        warnings.append(
            f"{cancelled.count} rollouts were cancelled before they finished: the fitted "
            "lengths miss their tails (fit a run with oversample 0 and no admit)"
        )
    elif policy.oversample or policy.admit is not None:
        warnings.append(
            "the run cut its slowest rollouts (oversample or admit): the fitted lengths "
            "are biased short; fit a run with oversample 0 and no admit"
        )
    elapsed = sum(seconds)
    samples = sum(int(r["scheduler"]["groups"]) * group for r in steps)
    full = engine.full_throughput * n_engines
    limit = sum(max(t, n / full) for t, n in zip(busy_T, batch_tokens, strict=True))
    measured = Measured(
        step_time=elapsed / len(steps),
        busy=statistics.median(busy_T),
        samples_per_s=samples / elapsed,
        waited=sum(waited) / len(steps),
        limit_fraction=limit / elapsed,
        lengths=_quantiles(lengths),
        outside=_quantiles(outside) if kept_outside else {},
        prompt=prompt.quantile(0.5),
        turns=turns.mean,
        truncated=share_capped,
        profile_cpu=sum(float(p["cpu"]) for p in profiles) / len(profiles),
    )
    return RunFit(
        lengths=preset,
        latency=latency,
        latency_sigma=latency_sigma,
        T=T,
        engine=engine,
        engines=n_engines,
        sharing=sharing,
        turns=_turn_shares(turns),
        tasks=tasks,
        group=group,
        policy=policy,
        steps=len(steps),
        measured=measured,
        per_engine=per_engine,
        warnings=tuple(warnings),
    )


def _split(sigma: float, logs: Mapping[str, float]) -> tuple[float, float]:
    """``(sigma_task, sigma_sample)`` with ``sigma_task**2 + sigma_sample**2 = sigma**2``,
    split by the groups' log-length sums."""
    g, df = logs["groups"], logs["within_df"]
    if g < 2 or df < 1:
        return sigma, 0.0
    within = logs["within_ss"] / df
    mean = logs["mean_sum"] / g
    between = max(logs["mean_sq"] / g - mean * mean, 0.0) * g / (g - 1)
    size = 1.0 + df / g  # mean group size
    task = max(between - within / size, 0.0)
    total = task + within
    if total <= 0:
        return sigma, 0.0
    return sigma * math.sqrt(task / total), sigma * math.sqrt(within / total)


def _turn_shares(turns: LogHistogram) -> tuple[float, ...]:
    """Shares of rollouts making 1, 2, ... calls, from the sketch of calls per rollout
    (small integers fall in distinct buckets: the middle of each rounds to its own)."""
    counts: dict[int, int] = {}
    for i, n in turns.to_json()["buckets"].items():
        k = max(round(2 ** ((int(i) + 0.5) / BUCKETS_PER_OCTAVE)), 1)
        counts[k] = counts.get(k, 0) + n
    if not counts:
        return (1.0,)
    total = sum(counts.values())
    return tuple(counts.get(k, 0) / total for k in range(1, max(counts) + 1))


def _merge(into: dict[str, IterationLog], name: str, log: IterationLog) -> None:
    into[name] = into[name].merged(log) if name in into else log


def _bins(log: IterationLog) -> dict[int, tuple[int, float]]:
    """Iterations and seconds per quarter-octave of active count."""
    out: dict[int, tuple[int, float]] = {}
    for k, (n, sec) in log.rows().items():
        if n and k:
            b = math.floor(math.log2(k) * 4)
            n0, s0 = out.get(b, (0, 0.0))
            out[b] = (n0 + n, s0 + sec)
    return out


MIN_MATCHED = 5  # iterations at like loads, either way, that measure the sharing


def _sharing(alone: Mapping[str, IterationLog], beside: Mapping[str, IterationLog]) -> float | None:
    """How fast an engine goes beside the trainer's work against alone: the geometric
    mean, over loads seen both ways, of seconds per iteration alone over beside (in
    ``(0, 1]``; None without :data:`MIN_MATCHED` iterations each way at like loads)."""
    total = weight = 0.0
    matched_alone = matched_beside = 0
    for name, a_log in alone.items():
        b_log = beside.get(name)
        if b_log is None:
            continue
        a_bins, b_bins = _bins(a_log), _bins(b_log)
        for b in a_bins.keys() & b_bins.keys():
            (na, sa), (nb, sb) = a_bins[b], b_bins[b]
            if sa <= 0 or sb <= 0:
                continue
            w = na * nb / (na + nb)
            total += w * math.log((sa / na) / (sb / nb))
            weight += w
            matched_alone += na
            matched_beside += nb
    if min(matched_alone, matched_beside) < MIN_MATCHED:
        return None
    return min(max(math.exp(total / weight), 0.05), 1.0)


def _scaled(
    alone: IterationLog | None, beside: IterationLog | None, sharing: float
) -> IterationLog | None:
    """The iterations as they would have run alone: those beside the trainer's work
    take ``sharing`` of their seconds."""
    if alone is None or beside is None:
        return None
    rows = {str(k): [n, sec * sharing] for k, (n, sec) in beside.rows().items()}
    return alone.merged(IterationLog.from_json(rows))


def _fit_engines(
    engines: Mapping[str, IterationLog],
    slots: Mapping[str, int],
    steps: Sequence[Mapping[str, Any]],
    warnings: list[str],
) -> tuple[dict[str, tuple[float, float, int]], EngineConfig, int]:
    if not engines:
        raise RunError(
            "the records hold no engine iterations (the engine reports none: "
            "the planner needs a dew engine, a fleet of dew serve, or vLLM)"
        )
    per: dict[str, tuple[float, float, int]] = {}
    for name, log in sorted(engines.items()):
        n = log.iterations
        line = log.fit_line()
        if line is None:
            rows = log.rows()
            mean = sum(s for _, s in rows.values()) / max(n, 1)
            line = (mean, 0.0)
            warnings.append(
                f"engine {name}: its active counts were too alike to tell a from b; "
                "b taken as 0 (the fit holds near the run's own load)"
            )
        per[name] = (line[0], line[1], n)
    last = steps[-1]["profile"].get("engines") or ()
    n_engines = max(len(last), 1)
    total = sum(n for _, _, n in per.values())
    a = sum(a * n for a, _, n in per.values()) / total
    b = sum(b * n for _, b, n in per.values()) / total
    if a <= 0:  # a line through noisy means can cross zero; an iteration still costs time
        smallest = min(s / n for log in engines.values() for n, s in log.rows().values() if n)
        warnings.append(
            f"fitted a = {a:.3g} s is not positive: taken as the fastest iteration seen"
        )
        a = smallest
    max_active = max(slots.values())
    return per, EngineConfig(a, max(b, 0.0), max_active), n_engines
