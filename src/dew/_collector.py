"""Keeping Python's cyclic garbage collector out of the hot loops.

A trainer process holds a large, long-lived heap (the model, the optimizer, the data,
every imported library). A full pass of the cyclic collector walks all of it, and while
it runs no thread moves: measured in a simulated-engine scheduler run (dew.plan.sim), one
pass held every thread for up to 0.1 s; in bench/vs_trl.py's dew run, 24 passes of about
0.155 s each took a quarter of a 200-step run. Three remedies, each undone on the way out:

* :func:`frozen` for a loop over a large set-up heap (the simulated scheduler run):
  what is alive when the loop starts is moved out of the collector's generations, so
  its passes walk only what the loop allocates.
* :class:`FreezeAfter` for ``fit``: the same, but only after a few training steps,
  because the long-lived heap still grows over the first steps (the passes there grew
  from 0.013 to 0.15 s). Frozen at the start of ``fit``, several passes still took
  0.08-0.15 s; frozen after step 10, they took 0-2 ms, and the run went from 66.3 to
  49.1 ms per step. The price: cycles among objects alive at the freeze that become
  garbage later are only collected once ``fit`` returns.
* :func:`paused` for a bounded computation that makes no cycles worth collecting (a
  plan): the collector does not run at all until it returns.

All are process-wide, as the collector is; none touches a heap the caller froze.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["FreezeAfter", "frozen", "paused"]


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """Freeze the objects alive now for the duration of the block."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Disable the collector for the block; re-enable it only if it was running."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class FreezeAfter:
    """Freeze the heap once, after ``steps`` calls of :meth:`step`; :meth:`release`
    unfreezes it again (only what this object froze).

    The freeze runs one full collection first, so no garbage is frozen with the heap.
    Nothing happens when the caller has frozen objects of its own.
    """

    def __init__(self, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self._left = steps
        self._froze = False

    @property
    def froze(self) -> bool:
        return self._froze

    def step(self) -> None:
        if self._left <= 0:
            return
        self._left -= 1
        if self._left == 0 and gc.get_freeze_count() == 0:
            gc.collect()
            gc.freeze()
            self._froze = True

    def release(self) -> None:
        if self._froze:
            gc.unfreeze()
            self._froze = False
