"""Keeping Python's cyclic garbage collector out of the hot loops.

A trainer process holds a large, long-lived heap (the model, the optimizer, the data,
every imported library). A full pass of the cyclic collector walks all of it, and while
it runs no thread moves: measured in a simulated-engine scheduler run (dew.plan.sim), one pass held
every thread for up to 0.1 s. Two remedies, each undone on the way out:

* :func:`frozen` for a loop over a large set-up heap (the simulated scheduler run):
  what is alive when the loop starts is moved out of the collector's generations, so
  its passes walk only what the loop allocates. ``fit`` does not use it: no gain in
  ``fit`` has been measured yet.
* :func:`paused` for a bounded computation that makes no cycles worth collecting (a
  plan): the collector does not run at all until it returns.

Both are process-wide, as the collector is.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["frozen", "paused"]


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
