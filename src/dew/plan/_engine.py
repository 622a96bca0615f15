"""The engine cost model shared by the planner and the simulated source.

One engine decodes up to ``max_active`` sequences at once; an iteration produces one
token for every active sequence and takes ``a + b * active`` seconds. Requests wait
in a FIFO queue for a free slot. Prefill is not modelled: prompts are short next to
RL completions, and the presets describe completion lengths only.

The model is *fluid*: between two events (an arrival, a cancel, a completion) the
active set is fixed, so every active sequence advances at ``1 / (a + b * n)`` tokens
per second. A single progress counter ``P`` (tokens per active sequence since the
engine started) then orders all completions: a sequence admitted at ``P0`` with
length ``L`` finishes when ``P`` reaches ``P0 + L``, which a heap finds in
``O(log n)``. Time only moves forward through :meth:`EngineModel.advance`.

Slots are filled lazily: an arrival, a cancel or a completion only marks the engine
for a fill, and the next read that depends on the active set (the next completion,
``active``, ``queued``, a change of ``served``) does it. Nothing happens between those
mutations (time stands still), so one fill gives exactly what one fill after each of
them would: queue order, progress and served version are the same. A plan's
completion cancels or starts several requests at once, and this fills once for all.

No threads, no clock: the planner jumps from event to event with it, and the
simulated source advances it to the scaled wall clock under its own lock.

:class:`FleetModel` stands for several such engines behind one front, routed the way
an ``EngineFleet`` routes: every request of one group goes to the engine its group's
first request went to, and that one is the engine with the least work (active plus
queued) at the time. Its clocks move together: it advances every engine to the
earliest next completion among them.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["EngineConfig", "EngineModel", "FleetModel"]


@dataclass(frozen=True)
class EngineConfig:
    """Iteration time ``a + b * active`` seconds, at most ``max_active`` sequences."""

    a: float = 4.5e-3
    b: float = 0.04e-3
    max_active: int = 256

    def __post_init__(self) -> None:
        if not self.a > 0:
            raise ValueError(f"a={self.a}: the fixed iteration time must be > 0 seconds")
        if not self.b >= 0:
            raise ValueError(f"b={self.b}: the per-sequence iteration time must be >= 0")
        if self.max_active < 1:
            raise ValueError(f"max_active={self.max_active}: must be >= 1")

    @property
    def full_throughput(self) -> float:
        """Tokens per second with every slot busy."""
        n = self.max_active
        return n / (self.a + self.b * n)


@dataclass(eq=False, slots=True)
class _Seq:
    key: Hashable
    length: int
    start_p: float = 0.0  # progress counter when admitted to a slot
    version: int | None = None  # served version at its first token
    live: bool = True  # False once cancelled: its heap entry is skipped


class EngineModel:
    """Fluid model of one continuous-batching engine (see the module docstring)."""

    def __init__(self, config: EngineConfig, now: float = 0.0) -> None:
        self.config = config
        self.now = now
        self._served = 0  # version of the weights being served
        self.progress = 0.0  # P: tokens generated per active sequence so far
        self.generated = 0.0  # tokens generated in total
        self._queue: deque[_Seq] = deque()
        self._queued: dict[Hashable, _Seq] = {}
        self._active: dict[Hashable, _Seq] = {}
        self._heap: list[tuple[float, int, _Seq]] = []  # (finish progress, tiebreak, seq)
        self._tiebreak = 0
        self._rate = 0.0  # tokens per second per active sequence; kept with _active
        self._unfilled = False  # a slot may be free for a queued request (see the docstring)
        self._a, self._b, self._cap = config.a, config.b, config.max_active  # read per event
        self._slowdown = 1.0  # iteration time multiplier (the trainer busy on shared cores)

    @property
    def served(self) -> int:
        """Version of the weights being served; a request gets it with its slot."""
        return self._served

    @served.setter
    def served(self, version: int) -> None:
        if self._unfilled:  # slots freed before the push go out at the old version
            self._fill()
        self._served = version

    @property
    def active(self) -> int:
        if self._unfilled:
            self._fill()
        return len(self._active)

    @property
    def queued(self) -> int:
        if self._unfilled:
            self._fill()
        return len(self._queued)

    def _fill(self) -> None:
        """Admit queued requests into free slots; always leaves ``_rate`` current."""
        self._unfilled = False
        queue, active, cap = self._queue, self._active, self._cap
        while queue and len(active) < cap:
            seq = queue.popleft()
            if self._queued.pop(seq.key, None) is None:
                continue  # cancelled while queued
            seq.start_p = self.progress
            seq.version = self._served
            active[seq.key] = seq
            self._tiebreak += 1
            heapq.heappush(self._heap, (seq.start_p + seq.length, self._tiebreak, seq))
        n = len(active)
        self._rate = 1.0 / ((self._a + self._b * n) * self._slowdown) if n else 0.0

    @property
    def slowdown(self) -> float:
        return self._slowdown

    @slowdown.setter
    def slowdown(self, factor: float) -> None:
        """Iterations from now on take ``factor`` times as long (time stands at ``now``:
        progress so far is kept)."""
        self._slowdown = factor
        self._fill()

    def _top(self) -> tuple[float, int, _Seq] | None:
        if self._unfilled:
            self._fill()
        heap = self._heap
        while heap and not heap[0][2].live:
            heapq.heappop(heap)  # cancelled
        return heap[0] if heap else None

    def add(self, key: Hashable, length: int) -> None:
        """Queue a request for ``length`` tokens at the current time."""
        if length < 1:
            raise ValueError(f"{key}: length must be >= 1, got {length}")
        if key in self._queued or key in self._active:
            raise ValueError(f"{key}: already in the engine")
        seq = _Seq(key, int(length))
        self._queue.append(seq)
        self._queued[key] = seq
        if len(self._active) < self._cap:  # else it waits its turn in the queue
            self._unfilled = True

    def cancel(self, key: Hashable) -> tuple[float, int | None] | None:
        """Drop a request; ``(tokens it had generated, its version)`` or None if unknown."""
        if self._queued.pop(key, None) is not None:
            return 0.0, None
        seq = self._active.pop(key, None)
        if seq is None:
            return None
        seq.live = False
        self._unfilled = True
        return min(self.progress - seq.start_p, seq.length), seq.version

    def next_completion(self) -> float | None:
        """Time of the next completion if nothing else happens, or None when idle."""
        top = self._top()
        if top is None:
            return None
        return self.now + (top[0] - self.progress) / self._rate

    def next_until(self, to: float) -> tuple[Hashable, float, int] | None:
        """The next completion as ``(key, time, version)`` if it comes by ``to``.

        Time moves to that completion, or to ``to`` (when finite) if none comes first.
        The planner's loop: one call per completion, instead of a look and a move.
        """
        top = self._top()
        if top is None:
            if to != math.inf:
                self.now = max(self.now, to)
            return None
        rate = self._rate
        finish = self.now + (top[0] - self.progress) / rate
        if finish > to:
            self.generated += len(self._active) * (to - self.now) * rate
            self.progress += (to - self.now) * rate
            self.now = max(self.now, to)
            return None
        return self._complete(top, finish)

    def _complete(self, top: tuple[float, int, _Seq], finish: float) -> tuple[Hashable, float, int]:
        heapq.heappop(self._heap)
        seq = top[2]
        self.generated += len(self._active) * (top[0] - self.progress)
        self.progress = top[0]
        self.now = max(self.now, finish)
        del self._active[seq.key]
        seq.live = False
        assert seq.version is not None
        self._unfilled = True
        return seq.key, self.now, seq.version

    def wait_until(self, to: float) -> None:
        """Move time to ``to``, which no completion comes strictly before (the caller
        knows: a fleet moving its other engines to one engine's completion). A sequence
        due exactly at ``to`` stays due, for the next read."""
        if self._unfilled:
            self._fill()
        if to <= self.now:
            return
        if self._active:
            step = (to - self.now) * self._rate
            self.generated += len(self._active) * step
            self.progress += step
        self.now = to

    def advance(self, to: float) -> list[tuple[Hashable, float, int]]:
        """Move time to ``to``; completions on the way as ``(key, time, version)``."""
        done: list[tuple[Hashable, float, int]] = []
        while (completion := self.next_until(to)) is not None:
            done.append(completion)
        return done


class FleetModel:
    """Several :class:`EngineModel` engines behind one front (see the module docstring).

    Keys are :class:`~dew.core.RolloutKey`-like: their ``group`` is the routing affinity.
    The interface is the one engine's that the planner uses.
    """

    def __init__(self, configs: list[EngineConfig], now: float = 0.0) -> None:
        if not configs:
            raise ValueError("a fleet model needs at least one engine")
        self.engines = [EngineModel(c, now) for c in configs]
        self._where: dict[Hashable, EngineModel] = {}
        self._affinity: dict[Hashable, EngineModel] = {}

    @property
    def now(self) -> float:
        return self.engines[0].now

    @property
    def served(self) -> int:
        return self.engines[0].served

    @served.setter
    def served(self, version: int) -> None:
        for e in self.engines:
            e.served = version

    @property
    def generated(self) -> float:
        return sum(e.generated for e in self.engines)

    @property
    def active(self) -> int:
        return sum(e.active for e in self.engines)

    @property
    def slowdown(self) -> float:
        return self.engines[0].slowdown

    @slowdown.setter
    def slowdown(self, factor: float) -> None:
        for e in self.engines:
            e.slowdown = factor

    def add(self, key: Hashable, length: int) -> None:
        group = getattr(key, "group", key)
        engine = self._affinity.get(group)
        if engine is None:
            engine = min(self.engines, key=lambda e: e.active + e.queued)
            self._affinity[group] = engine
        engine.add(key, length)
        self._where[key] = engine

    def cancel(self, key: Hashable) -> tuple[float, int | None] | None:
        engine = self._where.pop(key, None)
        return None if engine is None else engine.cancel(key)

    def _first(self) -> tuple[float, EngineModel | None]:
        best, first = math.inf, None
        for e in self.engines:
            t = e.next_completion()
            if t is not None and t < best:
                best, first = t, e
        return best, first

    def next_completion(self) -> float | None:
        best, first = self._first()
        return None if first is None else best

    def next_until(self, to: float) -> tuple[Hashable, float, int] | None:
        best, first = self._first()
        if first is None or best > to:
            for e in self.engines:
                e.next_until(to)  # none completes by ``to``: each only moves its clock
            return None
        for e in self.engines:
            if e is not first:
                e.wait_until(best)
        done = first.next_until(best)
        assert done is not None
        self._where.pop(done[0], None)
        return done

    def advance(self, to: float) -> list[tuple[Hashable, float, int]]:
        done: list[tuple[Hashable, float, int]] = []
        while (completion := self.next_until(to)) is not None:
            done.append(completion)
        return done
