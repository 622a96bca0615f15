"""bench/_stats.py: the median's distribution-free interval, and the load meter."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from ._tiny import bench_module

stats = bench_module("_stats")


def test_five_values_give_smallest_to_largest_at_their_exact_coverage() -> None:
    span = stats.median_interval([163, 129, 144, 150, 170])
    assert (span.median, span.low, span.high) == (150, 129, 170)
    assert span.coverage == pytest.approx(1 - 2 / 32)  # 93.75%: five values reach no more


def test_the_interval_narrows_once_it_still_covers_the_level() -> None:
    values = list(range(1, 21))  # 20 values
    span = stats.median_interval(values)
    # P(6 <= B <= 14), B ~ Binomial(20, 1/2), is 95.9%; P(7 <= B <= 13) only 88.5%
    assert (span.low, span.high) == (6, 15)
    below = sum(math.comb(20, i) for i in range(6)) / 2**20
    assert span.coverage == pytest.approx(1 - 2 * below)
    assert span.coverage >= 0.95
    assert stats.median_interval(values, level=0.8).low > span.low


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="no values"):
        stats.median_interval([])
    with pytest.raises(ValueError, match="level"):
        stats.median_interval([1.0], level=1.0)
    with pytest.raises(ValueError, match="no seed in common"):
        stats.paired_ratios({1: 2.0}, {2: 1.0})


def test_ratios_are_paired_by_seed() -> None:
    assert stats.paired_ratios({0: 12.0, 1: 13.0, 5: 9.0}, {1: 10.0, 0: 10.0}) == [1.2, 1.3]


@pytest.mark.timeout(60)
def test_a_process_outside_the_run_counts_as_load() -> None:
    # a busy process this block did not start or wait for: other work
    busy = subprocess.Popen(
        [sys.executable, "-c", "import sys\nsys.stdin.read(1)\nwhile True: pass"],
        stdin=subprocess.PIPE,
    )
    try:
        assert busy.stdin is not None
        busy.stdin.write(b"x")
        busy.stdin.flush()  # it spins from here on
        with stats.OtherLoad() as load:
            # the block's own work: a child it waits for, spinning about as long
            subprocess.run(
                [sys.executable, "-c", "import time\nt = time.monotonic()\n"
                 "while time.monotonic() - t < 1.5: pass"],
                check=True,
            )  # fmt: skip
        assert load.cores is not None
        # the spinning outsider took about a core; the waited child is not counted
        assert load.cores > 0.5
    finally:
        busy.kill()
        busy.wait()
        assert busy.stdin is not None
        busy.stdin.close()
