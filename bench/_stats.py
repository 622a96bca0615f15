"""Medians with intervals, and how busy the machine was with other work during a run.

Intervals: a distribution-free interval for the median of ``n`` values (seeds), the
``k``-th smallest to the ``k``-th largest with ``k`` as large as still covers the median
with at least ``level`` probability (the binomial rule: ``P(k <= B < n - k + 1)`` for
``B ~ Binomial(n, 1/2)``). It assumes nothing about the shape of the values, which is
why it suits steps to a threshold: one slow seed stretches a mean, not a median. With
few values the level may be out of reach; the widest interval (smallest to largest)
is then used and its own coverage reported (5 values: 93.8%, 6: 96.9%).

Load: the CPU seconds the whole machine spent busy (``/proc/stat``: user, nice, system,
irq, softirq and steal) during a run, less the CPU seconds of the processes that ran it
(this process and its waited-for children, from ``getrusage``), over the run's wall
seconds: the cores other work took. A comparison is only fair when every run of it saw
about none; :data:`QUIET` is the most that still counts as a quiet machine.
"""

from __future__ import annotations

import math
import os
import resource
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# Cores that other work may take during a run of a quiet machine: the host's own
# daemons take a few hundredths, a second benchmark or a test run takes one or more.
QUIET = 0.15


@dataclass(frozen=True)
class Interval:
    """A median, the interval around it and that interval's coverage (0-1)."""

    median: float
    low: float
    high: float
    coverage: float

    def text(self, fmt: str = "{:.0f}", unit: str = "") -> str:
        """``"144 (130-163)"`` style: the median, then the interval."""
        f = fmt.format
        return f"{f(self.median)}{unit} ({f(self.low)}-{f(self.high)}{unit})"


def _coverage(n: int, k: int) -> float:
    """P(the k-th smallest <= median <= the k-th largest) for n values (1-based k)."""
    below = sum(math.comb(n, i) for i in range(k)) / 2**n  # P(B < k)
    return 1.0 - 2.0 * below


def median_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """The median of ``values`` and its distribution-free interval (module docstring)."""
    if not values:
        raise ValueError("median_interval of no values")
    if not 0 < level < 1:
        raise ValueError(f"level={level!r} must be in (0, 1)")
    ordered = sorted(values)
    n = len(ordered)
    k = 1
    while k + 1 <= (n + 1) // 2 and _coverage(n, k + 1) >= level:
        k += 1
    return Interval(statistics.median(ordered), ordered[k - 1], ordered[n - k], _coverage(n, k))


def paired_ratios(top: dict[int, float], bottom: dict[int, float]) -> list[float]:
    """``top[seed] / bottom[seed]`` for the seeds both have, in seed order."""
    seeds = sorted(set(top) & set(bottom))
    if not seeds:
        raise ValueError("no seed in common")
    return [top[s] / bottom[s] for s in seeds]


def _busy_seconds() -> float:
    """Seconds of CPU the whole machine has spent busy since boot (``/proc/stat``)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    """CPU seconds of this process and of its children that have been waited for."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        use = resource.getrusage(who)
        total += use.ru_utime + use.ru_stime
    return total


def load_summary(loads: Sequence[float | None]) -> tuple[str, bool]:
    """(what the runs' ``loads`` say about the machine, whether it was quiet for all)."""
    if any(load is None for load in loads):
        return "load not measured for some runs", False
    worst = max(loads)  # type: ignore[type-var]
    if worst <= QUIET:
        return f"quiet: other work took at most {worst:.2f} cores during any run", True
    busy = sum(load > QUIET for load in loads)  # type: ignore[operator]
    return (
        f"UNDER LOAD: other work took up to {worst:.2f} cores ({busy} of {len(loads)} runs "
        f"over {QUIET:g})",
        False,
    )


class OtherLoad:
    """Measures the cores other work took while a block ran (module docstring).

    ``with OtherLoad() as load: run()`` then ``load.cores``; None where ``/proc/stat``
    cannot be read (not Linux). Children started in the block must have been waited
    for by its end, or their CPU counts as other work.
    """

    def __init__(self) -> None:
        self.cores: float | None = None
        self._start: tuple[float, float, float] | None = None

    def __enter__(self) -> OtherLoad:
        try:
            self._start = (_busy_seconds(), _own_seconds(), time.monotonic())
        except (OSError, ValueError):
            self._start = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._start is None:
            return
        busy, own, t0 = self._start
        wall = time.monotonic() - t0
        others = (_busy_seconds() - busy) - (_own_seconds() - own)
        self.cores = max(0.0, others) / wall if wall > 0 else 0.0
