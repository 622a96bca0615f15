"""bench/async_growth.py: the delayed-growth root, the growth fit, and its table."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ._tiny import BENCH, bench_module

growth = bench_module("async_growth")


def test_delayed_growth_by_hand() -> None:
    assert growth.delayed_growth(0.04, 0) == pytest.approx(1.04)  # no delay: g - 1 = r
    # one update late: g * (g - 1) = r, so g = (1 + sqrt(1 + 4r)) / 2
    assert growth.delayed_growth(0.04, 1) == pytest.approx((1 + math.sqrt(1.16)) / 2)
    g = growth.delayed_growth(0.0379, 3)
    assert g**3 * (g - 1) == pytest.approx(0.0379)
    assert 1 < g < growth.delayed_growth(0.0379, 2) < 1.0379  # the longer the delay, the slower
    with pytest.raises(ValueError, match="r > 0"):
        growth.delayed_growth(0.0, 1)


def test_growth_rate_reads_a_geometric_curve_inside_the_band_only() -> None:
    steps = np.arange(80)
    curve = 0.01 * 1.03**steps
    curve[50:] = 0.2  # a plateau above the band must not bend the fit
    assert growth.growth_rate(curve, 0.015, 0.06) == pytest.approx(1.03)
    with pytest.raises(ValueError, match="fewer than 3"):
        growth.growth_rate(curve, 0.5, 0.6)


def test_window_means_average_runs_then_steps() -> None:
    runs = [[0.0] * 12, [2.0] * 15]  # cut to the shorter run's 12 steps
    assert growth.window_means(runs).tolist() == pytest.approx([1.0, 1.0, 1.0])


@pytest.mark.timeout(60)
def test_the_table_from_the_saved_runs_matches_their_growth() -> None:
    saved = BENCH / "saved" / "async_steps_810_tail"
    out = subprocess.run(
        [sys.executable, str(BENCH / "async_growth.py"), "--task", "tail", "--async", "ahead 2",
         "--load", str(saved)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    (row,) = [line for line in out.stdout.splitlines() if line.startswith(f"| {Path(saved).name}")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "810-819"
    g_sync, g_measured, g_predicted, lag = (float(c) for c in cells[2:6])
    assert g_predicted == pytest.approx(growth.delayed_growth(g_sync - 1, lag), abs=1e-4)
    assert 1 < g_predicted < g_sync and 1.5 < lag < 2.5
    assert abs(g_measured - g_predicted) < 0.003  # these runs grew as the delay predicts
    alone = math.log(g_sync) / math.log(g_predicted)
    assert float(cells[6].rstrip("x")) == pytest.approx(alone, abs=2e-3)  # from rounded g


def test_first_steps_name_the_step_that_ends_the_first_window_at_a_level() -> None:
    means = np.array([0.01, 0.02, 0.04, 0.05])  # window i ends at step i + WINDOW
    assert growth.first_steps(means, [0.02, 0.045, 0.9]) == [
        1 + growth.WINDOW,
        3 + growth.WINDOW,
        None,
    ]


def test_step_split_parts_a_step_into_wait_and_work_after_the_first_steps() -> None:
    # steps of 2, 1, 1, 3 s (the clock at each step's end), waits of 1, 0.5, 0.25, 1 s
    took, waited, worked, first = growth.step_split([2, 3, 4, 7], [1, 0.5, 0.25, 1], skip=2)
    assert (took, waited, worked, first) == pytest.approx((2.0, 0.625, 1.375, 1.5))


@pytest.mark.timeout(60)
def test_detail_adds_a_row_per_run() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH / "async_growth.py"), "--task", "tail", "--detail",
         "--load", str(BENCH / "saved" / "async_steps_810_tail")],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    rows = [line for line in out.stdout.splitlines() if " | 810-819 | " in line]
    assert [r.split(" | ")[2] for r in rows[1:]] == ["sync", "ahead 3"]
    assert all(len(r.strip("|").split("|")) == 11 for r in rows[1:])
