"""Completion-length presets: two-level lognormal models of RL rollout lengths.

Each preset draws lengths in two stages, so that samples of one task's group are
correlated the way they are in real GRPO traces:

* every task gets a log-mean ``m ~ Normal(mu, sigma_task)``;
* every sample of that task gets ``L = round(exp(Normal(m, sigma_sample)))``, at
  least 1, clipped to ``cap``. A draw that reaches the cap is a *length truncation*
  (the engine stopped at ``max_tokens``).

``sigma_task**2 + sigma_sample**2`` is the total variance of log-length. The presets:

``dapo``
    Early DAPO training of a 32B model: ``mu = 6.04`` (median about 420 tokens), total
    sigma 0.93 with a third of the log-variance between tasks and two thirds within a
    group, cap 20480. The mean length is about 650 tokens; truncation is rare (~1e-5).
``dapo-moments``
    The same trace described by its moments instead: mean 581 tokens, coefficient of
    variation 0.39 of the per-task mean and 0.55 within a group. For a lognormal,
    ``CV**2 = exp(sigma**2) - 1``, so ``sigma = sqrt(log(1 + CV**2))`` per level and
    ``mu = log(mean) - (sigma_task**2 + sigma_sample**2) / 2``. Same cap as ``dapo``.
    Its tail is far lighter than ``dapo``'s, which is the point of having both.
``tail``
    The answer lengths of dew's own heavy-tailed demo workload
    (:class:`dew.demo.tail.Workload`'s defaults, read from it): a target length per
    task, lognormal with median 24 and sigma 0.9, capped at 192. Every sample of a
    group aims at its task's target, so the whole spread is between tasks
    (``sigma_sample = 0``); a model that has not learned to stop yet spreads its
    samples around it, which this preset leaves out.
``longcot``
    Long chain of thought: ``mu = 8.90`` (median about 7300 tokens), total sigma 0.80,
    within-group CV 0.15 (so nearly all the spread is between tasks), cap 16000. The
    cap sits 0.975 total sigmas above ``mu``, so ``1 - Phi(0.975)`` = 16.5% of samples
    are truncated (the issue's "about 15%"); ``tests/plan`` checks the sampler's share
    on a large seeded sample.

Sampling is seeded and vectorised: :meth:`LengthPreset.sample` draws a ``[tasks, group]``
table; :class:`LengthDraws` gives the planner and the simulated engine the *same*
length for the same ``(task, sample, attempt)``, so their figures are comparable run
for run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

__all__ = ["PRESETS", "LengthDraws", "LengthPreset", "preset"]


@dataclass(frozen=True)
class LengthPreset:
    """A two-level lognormal length model (see the module docstring)."""

    name: str
    mu: float  # mean of log-length over all samples
    sigma_task: float  # std of the per-task log-mean
    sigma_sample: float  # std of a sample's log-length around its task's log-mean
    cap: int  # max_tokens: a draw at or above it is truncated to it

    def __post_init__(self) -> None:
        if not math.isfinite(self.mu):
            raise ValueError(f"{self.name}: mu must be finite, got {self.mu}")
        for name in ("sigma_task", "sigma_sample"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{self.name}: {name} must be finite and >= 0, got {value}")
        if self.cap < 1:
            raise ValueError(f"{self.name}: cap must be >= 1, got {self.cap}")

    @property
    def sigma(self) -> float:
        """Total std of log-length."""
        return math.hypot(self.sigma_task, self.sigma_sample)

    def lengths(self, log_mean: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Lengths and truncation flags from task log-means and standard normals.

        ``log_mean`` broadcasts against ``z``; both results have ``z``'s shape.
        """
        raw = np.rint(np.exp(log_mean + self.sigma_sample * z))
        truncated = raw >= self.cap  # reaching the cap is a truncation
        out = np.minimum(np.maximum(raw, 1), self.cap).astype(np.int64)
        return out, truncated

    def sample(
        self, rng: np.random.Generator, tasks: int, group: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(lengths, truncated)``, both ``[tasks, group]``: ``group`` samples per task."""
        if tasks < 1 or group < 1:
            raise ValueError(f"tasks={tasks} and group={group} must both be >= 1")
        log_mean = rng.normal(self.mu, self.sigma_task, size=(tasks, 1))  # [tasks, 1]
        z = rng.normal(size=(tasks, group))  # [tasks, group]
        return self.lengths(log_mean, z)

    def mean_length(self, samples: int = 400_000, seed: int = 0) -> float:
        """Mean clipped length, estimated on a seeded sample (exact enough for sizing)."""
        group = 8
        lengths, _ = self.sample(np.random.default_rng(seed), max(samples // group, 1), group)
        return float(lengths.mean())


def _moments(name: str, mean: float, cv_task: float, cv_sample: float, cap: int) -> LengthPreset:
    s_task = math.sqrt(math.log1p(cv_task**2))
    s_sample = math.sqrt(math.log1p(cv_sample**2))
    mu = math.log(mean) - (s_task**2 + s_sample**2) / 2
    return LengthPreset(name, mu, s_task, s_sample, cap)


def _split(name: str, mu: float, sigma: float, sigma_sample: float, cap: int) -> LengthPreset:
    return LengthPreset(name, mu, math.sqrt(sigma**2 - sigma_sample**2), sigma_sample, cap)


def _demo_tail(name: str) -> LengthPreset:
    from dew.demo.tail import Workload  # the numbers are the workload's, written once

    w = Workload()
    return LengthPreset(name, math.log(w.length_median), w.length_sigma, 0.0, w.length_cap)


PRESETS: Mapping[str, LengthPreset] = MappingProxyType(
    {
        # 1/3 of the log-variance between tasks, 2/3 within a group.
        "dapo": _split("dapo", 6.04, 0.93, 0.93 * math.sqrt(2 / 3), 20480),
        "dapo-moments": _moments("dapo-moments", 581.0, 0.39, 0.55, 20480),
        # within-group CV 0.15 fixes sigma_sample; the rest of sigma 0.80 is between tasks.
        "tail": _demo_tail("tail"),
        "longcot": _split("longcot", 8.90, 0.80, math.sqrt(math.log1p(0.15**2)), 16000),
    }
)


def preset(name: str) -> LengthPreset:
    """The preset called ``name``; a ValueError lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"preset={name!r} is not one of {sorted(PRESETS)}") from None


_TASK_BLOCK = 256  # tasks per generator: one seeding per 256 tasks, not one per task


class LengthDraws:
    """Deterministic lengths per ``(task, sample, attempt)`` for one seed.

    Tasks are drawn in blocks of 256: one generator seeded by ``(seed, block)`` gives
    the block's task log-means, and one seeded by ``(seed, block, attempt + 1)`` the
    ``[256, block]`` table of that attempt's sample draws (sample ``s`` of task ``t``
    is entry ``[t % 256, s]``). Lengths are rounded up to a multiple of ``quantum``
    (1: exact), which lets a simulation carry one token per ``quantum`` tokens and
    stay exact.
    """

    def __init__(
        self, preset: LengthPreset, seed: int = 0, *, quantum: int = 1, block: int = 64
    ) -> None:
        if quantum < 1:
            raise ValueError(f"quantum must be >= 1, got {quantum}")
        self.preset = preset
        self.seed = seed
        self.quantum = quantum
        self.block = block
        self._log_means: dict[int, np.ndarray] = {}  # task block -> [256] log-means
        # (task block, attempt) -> lengths and truncation flags, [256][block] as lists
        self._tables: dict[tuple[int, int], tuple[list[list[int]], list[list[bool]]]] = {}

    def _table(self, tblock: int, attempt: int) -> tuple[list[list[int]], list[list[bool]]]:
        log_mean = self._log_means.get(tblock)
        if log_mean is None:
            rng = np.random.default_rng([self.seed, tblock])
            log_mean = rng.normal(self.preset.mu, self.preset.sigma_task, size=_TASK_BLOCK)
            self._log_means[tblock] = log_mean
        rng = np.random.default_rng([self.seed, tblock, attempt + 1])
        z = rng.normal(size=(_TASK_BLOCK, self.block))  # [256, block]
        n, t = self.preset.lengths(log_mean[:, None], z)
        q = self.quantum
        table = ((-(-n // q) * q).tolist(), t.tolist())  # lengths rounded up to the quantum
        self._tables[(tblock, attempt)] = table
        return table

    def first_tokens(self, first: int, tasks: int, group: int) -> int:
        """Total length of samples ``0 .. group - 1``, first attempt, of ``tasks`` tasks
        from task ``first`` on: what :meth:`get` gives, summed a table row at a time."""
        if not 0 <= group <= self.block:
            raise ValueError(f"group={group} must be in [0, {self.block}]")
        if first < 0 or tasks < 0:
            raise ValueError(f"first={first} and tasks={tasks} must be >= 0")
        total = 0
        for task in range(first, first + tasks):
            tblock, row = divmod(task, _TASK_BLOCK)
            table = self._tables.get((tblock, 0)) or self._table(tblock, 0)
            total += sum(table[0][row][:group])
        return total

    def get(self, task: int, sample: int, attempt: int = 0) -> tuple[int, bool]:
        """``(length, truncated)`` of one draw; the same arguments give the same answer."""
        if not 0 <= sample < self.block:
            raise ValueError(f"sample={sample} must be in [0, {self.block})")
        if task < 0 or attempt < 0:
            raise ValueError(f"task={task} and attempt={attempt} must be >= 0")
        tblock, row = divmod(task, _TASK_BLOCK)
        table = self._tables.get((tblock, attempt)) or self._table(tblock, attempt)
        return table[0][row][sample], table[1][row][sample]
