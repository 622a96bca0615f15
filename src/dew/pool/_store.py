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
* with a ``hung`` callback (the pool's heartbeat), a round that waits for a rank
  known hung or gone is decided ``hung <ranks>``: at once if it was known when the
  round began, else by the heartbeat's thread (:meth:`Rounds.interrupt`, with its
  own store client), which ends the wait. A peer that is only slow is waited for
  until the deadline;
* store errors (a lost store host) become :class:`StoreLost`, never a hang: every
  store operation is bounded by the store's own timeout.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["Missing", "Rounds", "StoreLost"]

_COMPLETE = "complete"


class Missing(Exception):
    """Some ranks did not write their payload before the round's deadline, or were
    found hung or gone (``hung``: their causes by rank) while the round waited."""

    def __init__(
        self, ranks: list[int], round_name: str, hung: dict[int, str] | None = None
    ) -> None:
        super().__init__(f"ranks {ranks} missing from {round_name}")
        self.ranks = ranks
        self.round_name = round_name
        self.hung = hung or {}


class StoreLost(Exception):
    """The rendezvous store could not be reached (its host process is gone)."""


class Rounds:
    """Numbered agreement rounds of ``world`` processes through ``store``."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world: int,
        *,
        hung: Callable[[], dict[int, str]] | None = None,
    ) -> None:
        self.store = store
        self.rank = rank
        self.world = world
        self.hung = hung  # ranks known hung or gone -> why (the heartbeat's view)
        self._counters: dict[str, int] = {}
        self._lock = threading.Lock()  # guards _waiting, read by the heartbeat's thread
        self._waiting: str | None = None  # the round this process waits in

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
                decision = self._await(base, deadline)
            if decision == _COMPLETE:
                return [self.store.get(f"{base}/{r}").decode() for r in range(self.world)]
        except (dist.DistError, RuntimeError) as exc:
            raise StoreLost(f"{type(exc).__name__}: {exc}") from exc
        kind, detail = decision.split(" ", 1)
        if kind == "hung":
            causes = {int(r): why for r, why in json.loads(detail).items()}
            raise Missing(sorted(causes), base, causes)
        raise Missing(json.loads(detail), base)

    def _await(self, base: str, deadline: float) -> str:
        """Wait for the round's decision until ``deadline``, then make it."""
        import torch.distributed as dist

        decision_key = f"{base}/decision"
        with self._lock:
            self._waiting = base
        try:
            # A rank found hung before this round began: decide now. One found while
            # it waits: the heartbeat's thread decides (interrupt), ending the wait.
            early = self._judge(self.store, base, final=False)
            if early is not None:
                return self._decide(decision_key, early)
            try:
                # Timeouts below a millisecond read as "use the store default".
                left = max(deadline - time.monotonic(), 0.001)
                self.store.wait([decision_key], timedelta(seconds=left))
                return self.store.get(decision_key).decode()
            except dist.DistStoreError as exc:
                if "timeout" not in str(exc).lower():
                    raise
            outcome = self._judge(self.store, base, final=True)
            assert outcome is not None
            return self._decide(decision_key, outcome)
        finally:
            with self._lock:
                self._waiting = None

    def interrupt(self, store: Any) -> None:
        """Decide the round this process waits in, if a rank it waits for is known
        hung or gone. Called from the heartbeat's thread with its own ``store`` client;
        a round that already has a decision keeps it."""
        with self._lock:
            base = self._waiting
        if base is None:
            return
        outcome = self._judge(store, base, final=False)
        if outcome is not None:
            store.compare_set(f"{base}/decision", "", outcome)

    def _judge(self, store: Any, base: str, *, final: bool) -> str | None:
        """The round's outcome as far as it can be told now (None: keep waiting).

        Every payload written: ``complete`` (a last writer that stopped or died
        between writing and counting itself in leaves the round whole). A missing
        rank known hung or gone: ``hung``. At the deadline: ``missing``.
        """
        gone = self.hung() if self.hung is not None else {}
        if not gone and not final:
            return None  # nobody to name yet: no store reads while all is well
        missing = [r for r in range(self.world) if not store.check([f"{base}/{r}"])]
        if not missing:
            return _COMPLETE
        named = {str(r): gone[r] for r in missing if r in gone}
        if named:
            return "hung " + json.dumps(named)
        return "missing " + json.dumps(missing) if final else None

    def _decide(self, key: str, outcome: str) -> str:
        # The first writer wins; everyone reads back what was written first.
        return self.store.compare_set(key, "", outcome).decode()
