"""Cheap, mergeable sketches of what a run costs, for the per-step profile.

A run's step records carry, besides the scheduler's account, what the planner needs to
model the run (:mod:`dew.plan.fit`): how long completions are, how long a rollout
spends outside the engine (a verifier, a tool), and how long an engine iteration takes
with how many sequences active. Everything here is a counter that only grows, so the
owner (an engine, a source) keeps one cumulative sketch and a reader takes a
:meth:`snapshot` now and then; the difference of two snapshots (``since``) is what
happened between them.

* :class:`LogHistogram`: counts of non-negative values in log-spaced buckets,
  ``BUCKETS_PER_OCTAVE`` per doubling, so a quantile read from it is within half a
  bucket (about 2%) of the true one whatever the scale: tokens and seconds alike.
  Zeros get their own count. Merging and differencing are exact.
* :class:`IterationLog`: an engine's iterations by active-sequence count: for each
  count, how many iterations ran with it and their total seconds. ``fit_line`` finds
  ``a + b * active``, the engine model the planner uses, by least squares over the
  per-count means weighted by iterations.
* :class:`EngineTimings` and :class:`Timed`: how an engine (or a fleet, one entry per
  member) reports its log; the HTTP engines read their server's over ``GET /dew/timings``.

Invariants: counts are non-negative integers and only grow in a live sketch;
``x.since(y)`` of a snapshot ``y`` taken before ``x`` has non-negative counts, and
``y.merged(x.since(y))`` equals ``x``. Both classes take a lock on every write and
snapshot, since an engine thread writes while a scheduler reads.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "BUCKETS_PER_OCTAVE",
    "MIN_SPREAD",
    "EngineTimings",
    "IterationLog",
    "LogHistogram",
    "Timed",
]

BUCKETS_PER_OCTAVE = 16
# Active counts closer together than this (std over mean) leave a line's slope to noise.
MIN_SPREAD = 0.1
_SCALE = BUCKETS_PER_OCTAVE / math.log(2.0)


def _bucket(x: float) -> int:
    """The bucket holding ``x > 0``: ``[2**(i/16), 2**((i+1)/16))``."""
    return math.floor(math.log(x) * _SCALE)


class LogHistogram:
    """Counts of values ``>= 0`` in log-spaced buckets (see the module docstring)."""

    __slots__ = ("_buckets", "_lock", "_sum", "_zeros")

    def __init__(self) -> None:
        self._buckets: dict[int, int] = {}
        self._zeros = 0
        self._sum = 0.0
        self._lock = threading.Lock()

    def add(self, x: float, n: int = 1) -> None:
        """Count ``x`` (a finite number ``>= 0``) ``n`` times."""
        if not (x >= 0 and math.isfinite(x)):
            raise ValueError(f"LogHistogram.add: expected a finite value >= 0, got {x!r}")
        with self._lock:
            if x == 0:
                self._zeros += n
            else:
                i = _bucket(x)
                self._buckets[i] = self._buckets.get(i, 0) + n
            self._sum += x * n

    def extend(self, values: Iterable[float]) -> None:
        for x in values:
            self.add(x)

    @property
    def count(self) -> int:
        with self._lock:
            return self._zeros + sum(self._buckets.values())

    @property
    def mean(self) -> float:
        """Exact mean of what was counted (nan when empty)."""
        n = self.count
        return self._sum / n if n else math.nan

    def snapshot(self) -> LogHistogram:
        out = LogHistogram()
        with self._lock:
            out._buckets = dict(self._buckets)
            out._zeros, out._sum = self._zeros, self._sum
        return out

    def merged(self, other: LogHistogram) -> LogHistogram:
        out = self.snapshot()
        o = other.snapshot()
        for i, n in o._buckets.items():
            out._buckets[i] = out._buckets.get(i, 0) + n
        out._zeros += o._zeros
        out._sum += o._sum
        return out

    def since(self, earlier: LogHistogram) -> LogHistogram:
        """What was counted after ``earlier`` (a snapshot of this sketch) was taken.

        A sketch that restarted since (its counts fell) is taken whole, as a restarted
        engine or source counts from zero again."""
        now, then = self.snapshot(), earlier.snapshot()
        if then._zeros > now._zeros or any(
            n > now._buckets.get(i, 0) for i, n in then._buckets.items()
        ):
            return now
        out = LogHistogram()
        out._buckets = {
            i: n - then._buckets.get(i, 0)
            for i, n in now._buckets.items()
            if n > then._buckets.get(i, 0)
        }
        out._zeros = now._zeros - then._zeros
        out._sum = max(now._sum - then._sum, 0.0)
        return out

    def quantile(self, q: float) -> float:
        """The ``q``-quantile (``0 <= q <= 1``), interpolated log-linearly inside its
        bucket; nan when empty."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile: q={q} must be in [0, 1]")
        with self._lock:
            items = sorted(self._buckets.items())
            zeros = self._zeros
        total = zeros + sum(n for _, n in items)
        if total == 0:
            return math.nan
        rank = q * total
        if rank <= zeros and zeros:
            return 0.0
        seen = float(zeros)
        for i, n in items:
            if seen + n >= rank:
                inside = (rank - seen) / n  # share of this bucket below the quantile
                return 2.0 ** ((i + inside) / BUCKETS_PER_OCTAVE)
            seen += n
        return 2.0 ** ((items[-1][0] + 1) / BUCKETS_PER_OCTAVE)

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            return {
                "buckets": {str(i): n for i, n in sorted(self._buckets.items())},
                "zeros": self._zeros,
                "sum": self._sum,
            }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LogHistogram:
        out = cls()
        try:
            out._buckets = {int(i): int(n) for i, n in data["buckets"].items()}
            out._zeros = int(data["zeros"])
            out._sum = float(data["sum"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"not a LogHistogram: {e}") from None
        if out._zeros < 0 or any(n < 0 for n in out._buckets.values()):
            raise ValueError("not a LogHistogram: negative counts")
        return out


class IterationLog:
    """An engine's iterations by active-sequence count (see the module docstring)."""

    __slots__ = ("_lock", "_rows")

    def __init__(self) -> None:
        self._rows: dict[int, list[float]] = {}  # active -> [iterations, seconds]
        self._lock = threading.Lock()

    def add(self, active: int, seconds: float) -> None:
        """One iteration that ran ``active`` sequences in ``seconds``."""
        with self._lock:
            row = self._rows.get(active)
            if row is None:
                self._rows[active] = [1, seconds]
            else:
                row[0] += 1
                row[1] += seconds

    @property
    def iterations(self) -> int:
        with self._lock:
            return int(sum(r[0] for r in self._rows.values()))

    def rows(self) -> dict[int, tuple[int, float]]:
        """``{active: (iterations, seconds)}``."""
        with self._lock:
            return {k: (int(r[0]), r[1]) for k, r in sorted(self._rows.items())}

    def snapshot(self) -> IterationLog:
        out = IterationLog()
        with self._lock:
            out._rows = {k: list(r) for k, r in self._rows.items()}
        return out

    def merged(self, other: IterationLog) -> IterationLog:
        out = self.snapshot()
        for k, (n, s) in other.rows().items():
            row = out._rows.setdefault(k, [0, 0.0])
            row[0] += n
            row[1] += s
        return out

    def since(self, earlier: IterationLog) -> IterationLog:
        """The iterations after ``earlier``; the whole log if it restarted since."""
        now, then = self.rows(), earlier.rows()
        if any(n > now.get(k, (0, 0.0))[0] for k, (n, _) in then.items()):
            return self.snapshot()
        out = IterationLog()
        for k, (n, s) in now.items():
            n0, s0 = then.get(k, (0, 0.0))
            if n > n0:
                out._rows[k] = [n - n0, max(s - s0, 0.0)]
        return out

    def fit_line(self) -> tuple[float, float] | None:
        """``(a, b)`` of ``seconds per iteration = a + b * active``, least squares over
        the per-count means weighted by their iterations; ``b`` is clamped at 0 (and
        ``a`` refitted as the mean). None when the active counts are too alike to
        separate ``a`` from ``b``: their spread (standard deviation, weighted by
        iterations) under :data:`MIN_SPREAD` of their mean."""
        rows = [(k, n, s) for k, (n, s) in self.rows().items() if n > 0]
        if not rows:
            return None
        w = sum(n for _, n, _ in rows)
        mean_x = sum(n * k for k, n, _ in rows) / w
        mean_y = sum(s for _, _, s in rows) / w
        sxx = sum(n * (k - mean_x) ** 2 for k, n, _ in rows)
        if len(rows) < 2 or math.sqrt(sxx / w) < MIN_SPREAD * mean_x:
            return None
        sxy = sum(n * (k - mean_x) * (s / n - mean_y) for k, n, s in rows)
        b = sxy / sxx
        if b < 0:
            return mean_y, 0.0
        return mean_y - b * mean_x, b

    def to_json(self) -> dict[str, list[float]]:
        return {str(k): [n, s] for k, (n, s) in self.rows().items()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> IterationLog:
        out = cls()
        try:
            out._rows = {int(k): [int(v[0]), float(v[1])] for k, v in data.items()}
        except (TypeError, ValueError, IndexError, AttributeError) as e:
            raise ValueError(f"not an IterationLog: {e}") from None
        if any(k < 0 or r[0] < 0 or r[1] < 0 for k, r in out._rows.items()):
            raise ValueError("not an IterationLog: negative counts or seconds")
        return out


@dataclass(frozen=True)
class EngineTimings:
    """One engine's iteration log, as its owner reports it.

    ``name`` tells engines apart across reads (a fleet member's URL; ``"local"`` for an
    in-process engine); ``max_active`` is how many sequences it decodes at most at once.
    """

    name: str
    max_active: int
    iterations: IterationLog

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "max_active": self.max_active,
            "iterations": self.iterations.to_json(),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EngineTimings:
        try:
            return cls(
                str(data["name"]),
                int(data["max_active"]),
                IterationLog.from_json(data["iterations"]),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"not an EngineTimings: {e}") from None


@runtime_checkable
class Timed(Protocol):
    """An engine that reports its iteration timings: one entry per engine it stands for
    (a fleet reports each member), cumulative since each engine started."""

    def timings(self) -> list[EngineTimings]: ...
