"""dew._collector: the heap freezes are taken once and always undone."""

from __future__ import annotations

import gc

import pytest

from dew._collector import FreezeAfter, frozen, paused


def test_freeze_after_freezes_on_the_nth_step_and_release_undoes_it() -> None:
    assert gc.get_freeze_count() == 0
    warm = FreezeAfter(3)
    try:
        warm.step()
        warm.step()
        assert gc.get_freeze_count() == 0 and not warm.froze
        warm.step()
        assert gc.get_freeze_count() > 0 and warm.froze
        frozen_now = gc.get_freeze_count()
        fresh = [[] for _ in range(1000)]  # tracked and alive: a second freeze takes them
        warm.step()  # once only
        # The count may shrink: a frozen object another thread frees leaves it.
        assert gc.get_freeze_count() <= frozen_now
        del fresh
    finally:
        warm.release()
    assert gc.get_freeze_count() == 0 and not warm.froze
    warm.release()  # idempotent


def test_freeze_after_leaves_a_heap_the_caller_froze_alone() -> None:
    with frozen():
        mine = gc.get_freeze_count()
        warm = FreezeAfter(1)
        warm.step()
        # Not ours to freeze: the count does not grow (a freeze adds every tracked
        # object). It may shrink: a frozen object that another thread frees leaves it.
        assert not warm.froze and gc.get_freeze_count() <= mine
        warm.release()
        assert 0 < gc.get_freeze_count() <= mine  # still the caller's, not unfrozen
    assert gc.get_freeze_count() == 0


def test_freeze_after_refuses_a_count_below_one() -> None:
    with pytest.raises(ValueError, match="steps must be >= 1"):
        FreezeAfter(0)


def test_paused_restores_the_collector_state() -> None:
    assert gc.isenabled()
    with paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with paused():
            pass
        assert not gc.isenabled()  # it was off before: left off
    finally:
        gc.enable()
