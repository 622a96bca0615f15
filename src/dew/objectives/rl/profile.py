"""The per-step profile: what the planner needs to model a run, measured on the run.

:class:`StepProfiler` is plain state (it owns no thread): the scheduler feeds it each
trainer call's rollouts and it returns one JSON-able mapping, the ``profile`` section of
that step's record, which ``dew plan --from-run`` fits (:mod:`dew.plan.fit`):

``format``
    :data:`PROFILE_FORMAT`; a reader refuses records without it or with a newer one.
``policy``
    The scheduler's knobs (``ahead``, ``max_lag``, ``oversample``, ``admit``,
    ``groups``, ``sync_every``) and ``tasks``, the groups this call consumed.
``lengths``
    Completion tokens per rollout (all turns of a multi-turn one), as
    :class:`~dew.core.LogHistogram` sketches: ``finished`` (admitted, cut or stale: the
    ones whose whole length is known) and ``cancelled`` (what cancelled rollouts had
    produced, when the source reports partial calls: a lower bound of their length).
``log_groups``
    Sums over the finished complete groups of log-length: ``groups``, ``mean_sum``
    and ``mean_sq`` (of each group's mean), ``within_ss`` and ``within_df`` (squared
    deviations from the group's mean, and their degrees of freedom): enough to split
    the spread of lengths between tasks and within a group.
``truncated``, ``length_cap``
    Finished rollouts that stopped at ``max_tokens``, and the longest of them (the cap,
    0 when none reached it).
``prompt``, ``turns``
    Prompt tokens of each finished rollout's first call, and its calls.
``outside``
    Seconds rollouts spent outside the engine after each of their model calls (a
    tool or an environment step; after the last, the verifier), counted since the
    last trainer call, from the source's ``outside`` sketch; absent when the source
    keeps none.
``engines``
    Each engine's iterations since the last call (:class:`~dew.core.EngineTimings`
    JSON), from the source's engine when it is :class:`~dew.core.Timed`; absent
    otherwise, or when the engine could not be read this time (``engines_error``
    then says why). Each entry's ``waiting`` holds the part of them that ran while the
    trainer waited for this call's rollouts (read when the wait began and ended): the
    engine alone, where the rest ran beside the trainer's own work. On one machine the
    two share its cores, and the planner's fit measures what that costs each.
``cpu``
    Seconds of the trainer thread's CPU the profile took, itself and this call's
    engine reads included (what the engine spends counting its iterations, and a
    source its time outside, is theirs: a lock and a dict update each).

Invariants: the profiler reads the source and the engine only through cumulative
snapshots, so the sum of a run's ``outside`` and ``engines`` sections is what they
counted from the first call on, up to the last call's read (a step counts the engine
up to the end of its wait; what runs after, while the batch is packed, goes to the
next); an engine that restarted counts from zero again and is taken whole; a read that
fails is counted by the next that succeeds; a step never raises for an engine it could
not read.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

from dew.core import EngineTimings, LogHistogram, Rollout, Timed, error_text
from dew.objectives.rl.config import SchedulerConfig

__all__ = ["PROFILE_FORMAT", "StepProfiler"]

PROFILE_FORMAT = 1


class StepProfiler:
    """One run's profile, a trainer call at a time (see the module docstring)."""

    def __init__(self, config: SchedulerConfig, source: Any) -> None:
        self._config = config
        outside = getattr(source, "outside", None)
        self._outside: LogHistogram | None = outside if isinstance(outside, LogHistogram) else None
        engine = getattr(source, "engine", None)
        self._engine: Timed | None = engine if isinstance(engine, Timed) else None
        self._seen_outside = LogHistogram()
        self._seen_engines: dict[str, EngineTimings] = {}
        self._wait_began: dict[str, EngineTimings] | None = None
        self._wait_ended: dict[str, EngineTimings] | None = None
        self._error: str | None = None
        self._read_cpu = 0.0  # CPU of the engine reads since the last step

    def wait_begins(self) -> None:
        """The trainer starts to wait for this call's rollouts."""
        self._wait_began = self._read()

    def wait_ends(self) -> None:
        """The trainer has this call's rollouts."""
        self._wait_ended = self._read() if self._wait_began is not None else None

    def _read(self) -> dict[str, EngineTimings] | None:
        if self._engine is None:
            return None
        cpu = time.thread_time()
        try:
            return {e.name: e for e in self._engine.timings()}
        except Exception as exc:  # a fleet member down: the next read counts it again
            self._error = error_text(exc)
            return None
        finally:
            self._read_cpu += time.thread_time() - cpu

    def step(
        self,
        groups: Sequence[Sequence[Rollout]],
        finished: Iterable[Rollout],
        cancelled: Iterable[Rollout],
    ) -> dict[str, Any]:
        """The profile of one call: ``groups`` it consumed (complete, finished),
        ``finished`` rollouts beyond them whose length is known (stale, cut), and
        ``cancelled`` ones that report what they had produced."""
        cpu = time.thread_time()
        config = self._config
        out: dict[str, Any] = {
            "format": PROFILE_FORMAT,
            "policy": {
                "ahead": config.ahead,
                "max_lag": config.max_lag,
                "oversample": config.oversample,
                "admit": config.admit,
                "groups": config.groups,
                "sync_every": config.sync_every,
                "tasks": len(groups),
            },
        }
        lengths, prompt, turns = LogHistogram(), LogHistogram(), LogHistogram()
        truncated = cap = 0
        stats = _GroupLogs()
        for group in groups:
            stats.add([max(r.completion_tokens, 1) for r in group if r.calls])
        for r in (*(r for g in groups for r in g), *finished):
            if not r.calls:
                continue
            n = r.completion_tokens
            lengths.add(n)
            prompt.add(len(r.calls[0].prompt))
            turns.add(len(r.calls))
            if r.truncation == "length":
                truncated += 1
                cap = max(cap, n)
        partial = LogHistogram()
        for r in cancelled:
            if r.calls:
                partial.add(r.completion_tokens)
        out["lengths"] = {"finished": lengths.to_json(), "cancelled": partial.to_json()}
        out["log_groups"] = stats.to_json()
        out["truncated"] = truncated
        out["length_cap"] = cap
        out["prompt"] = prompt.to_json()
        out["turns"] = turns.to_json()
        if self._outside is not None:
            now = self._outside.snapshot()
            out["outside"] = now.since(self._seen_outside).to_json()
            self._seen_outside = now
        if self._engine is not None:
            self._read_engines(out)
        out["cpu"] = time.thread_time() - cpu + self._read_cpu
        self._read_cpu = 0.0
        return out

    def _read_engines(self, out: dict[str, Any]) -> None:
        began, ended = self._wait_began, self._wait_ended
        self._wait_began = self._wait_ended = None
        now = ended if began is not None and ended is not None else self._read()
        if now is None:
            out["engines_error"] = self._error or "not read"
            self._error = None
            return
        engines = []
        for name, entry in now.items():
            before = self._seen_engines.get(name)
            iterations = entry.iterations
            since = iterations if before is None else iterations.since(before.iterations)
            row = EngineTimings(name, entry.max_active, since).to_json()
            start = None if began is None or ended is None else began.get(name)
            if start is not None:
                row["waiting"] = iterations.since(start.iterations).to_json()
            engines.append(row)
            self._seen_engines[name] = entry
        out["engines"] = engines


class _GroupLogs:
    """Sums of log-length over groups (see ``log_groups`` in the module docstring)."""

    def __init__(self) -> None:
        self.groups = 0
        self.mean_sum = self.mean_sq = self.within_ss = 0.0
        self.within_df = 0

    def add(self, lengths: Sequence[int]) -> None:
        if not lengths:
            return
        logs = [math.log(n) for n in lengths]
        mean = sum(logs) / len(logs)
        self.groups += 1
        self.mean_sum += mean
        self.mean_sq += mean * mean
        self.within_ss += sum((x - mean) ** 2 for x in logs)
        self.within_df += len(logs) - 1

    def to_json(self) -> dict[str, float]:
        return {
            "groups": self.groups,
            "mean_sum": self.mean_sum,
            "mean_sq": self.mean_sq,
            "within_ss": self.within_ss,
            "within_df": self.within_df,
        }
