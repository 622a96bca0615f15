"""Keeping Python's cyclic garbage collector out of the hot loops.

A trainer process holds a large, long-lived heap (the model, the optimizer, the data,
every imported library). A full pass of the cyclic collector walks all of it, and while
it runs no thread moves: in a scheduler run or a training loop such passes show up as
stalls of every thread (measured in bench/RESULTS.md, "garbage collector"). Three
remedies, each undone on the way out:

* :func:`frozen` for a loop over a large set-up heap (the simulated scheduler run):
  what is alive when the loop starts is moved out of the collector's generations, so
  its passes walk only what the loop allocates.
* :class:`FreezeAfter` for ``fit(..., freeze_gc=True)``: the same, but only after a
  few training steps, because the long-lived heap still grows over the first steps
  (frozen at the very start, later passes still walk what those steps added). The
  price: cycles among objects alive at the freeze that become garbage later are only
  collected once ``fit`` returns. ``fit`` leaves it off unless asked.
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
