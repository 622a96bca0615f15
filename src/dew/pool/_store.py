"""Bounded all-to-all agreement rounds over a ``torch.distributed`` key-value store.

A collective (gloo, NCCL) blocks until every member arrives or its process-group
timeout fires, and a member that died leaves the rest waiting that long with an
error that names nobody. Before anything collective happens in a call, the pool
instead exchanges one short string per process through the rendezvous store, with a
deadline, so a missing or failed process is named on every process.

Invariants of one round (``Rounds.exchange``):

* every process writes its payload under ``<tag>/<n>/<rank>`` and increments
  ``<tag>/<n>/arrived``; rounds of one tag are numbered in call order, so every
  process must exchange the same tags in the same order (the pool's calls do);
* the round's outcome is one value, ``<tag>/<n>/decision``, written with
  compare-and-set, so the first writer wins and every process reads the same
  outcome: ``complete`` (all payloads present; each process then reads them all) or
  ``missing <ranks>`` (written by the first process whose deadline passed, naming
  the ranks that had not written);
* a process never waits past its own deadline (``time.monotonic()``): it waits on
  the decision key for the time left, then decides itself: ``missing`` if some
  payload is absent, ``complete`` if all are there (the last writer died between
  its write and the decision). A process that arrives after a ``missing`` decision
  finds it already made and fails with it;
* store errors (a lost store host) become :class:`StoreLost`, never a hang: every
  store operation is bounded by the store's own timeout.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

__all__ = ["Missing", "Rounds", "StoreLost"]

_COMPLETE = "complete"


class Missing(Exception):
    """Some ranks did not write their payload before the round's deadline."""

    def __init__(self, ranks: list[int], round_name: str) -> None:
        super().__init__(f"ranks {ranks} missing from {round_name}")
        self.ranks = ranks
        self.round_name = round_name


class StoreLost(Exception):
    """The rendezvous store could not be reached (its host process is gone)."""


class Rounds:
    """Numbered agreement rounds of ``world`` processes through ``store``."""

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store = store
        self.rank = rank
        self.world = world
        self._counters: dict[str, int] = {}

    def next_name(self, tag: str) -> str:
        """The name the next round of ``tag`` will have (for messages)."""
        return f"{tag}/{self._counters.get(tag, 0)}"

    def exchange(self, tag: str, payload: str, timeout: float) -> list[str]:
        """Every rank's payload of this round, by rank; raises Missing or StoreLost."""
        import torch.distributed as dist

        n = self._counters.get(tag, 0)
        self._counters[tag] = n + 1
        base = f"{tag}/{n}"
        deadline = time.monotonic() + timeout
        decision_key = f"{base}/decision"
        try:
            self.store.set(f"{base}/{self.rank}", payload)
            arrived = self.store.add(f"{base}/arrived", 1)
            if arrived >= self.world:
                decision = self._decide(decision_key, _COMPLETE)
            else:
                left = deadline - time.monotonic()
                try:
                    # Timeouts below a millisecond read as "use the store default".
                    self.store.wait([decision_key], timedelta(seconds=max(left, 0.001)))
                    decision = self.store.get(decision_key).decode()
                except dist.DistStoreError as exc:
                    if "timeout" not in str(exc).lower():
                        raise
                    missing = [
                        r for r in range(self.world) if not self.store.check([f"{base}/{r}"])
                    ]
                    # Every payload written but no decision: the last writer died (or
                    # stalled) between writing and deciding. The round itself is whole.
                    outcome = "missing " + json.dumps(missing) if missing else _COMPLETE
                    decision = self._decide(decision_key, outcome)
            if decision == _COMPLETE:
                return [self.store.get(f"{base}/{r}").decode() for r in range(self.world)]
        except (dist.DistError, RuntimeError) as exc:
            raise StoreLost(f"{type(exc).__name__}: {exc}") from exc
        ranks = json.loads(decision.split(" ", 1)[1])
        raise Missing(ranks, base)

    def _decide(self, key: str, outcome: str) -> str:
        # The first writer wins; everyone reads back what was written first.
        return self.store.compare_set(key, "", outcome).decode()
