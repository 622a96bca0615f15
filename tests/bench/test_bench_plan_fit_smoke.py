"""bench/plan_fit.py end to end on the tiny model: it must not rot between measured runs."""

from __future__ import annotations

import re

import pytest

from ._tiny import run_tiny


@pytest.mark.timeout(120)
def test_plan_fit_tiny() -> None:
    out = run_tiny("plan_fit.py", timeout=100)
    # Timings of a few tokens on a shared machine: the test checks the report and the
    # fit's arithmetic, not how fast this machine was (bench/RESULTS.md has the figures).
    number = r"(-?\d+\.\d+)"
    points = re.findall(
        rf"^active +(\d+): +{number} ms per iteration \(fit +{number}\)$", out.stdout, re.M
    )
    assert [int(n) for n, _, _ in points] == [1, 4], out.stdout
    line = re.search(
        r"^a = (\S+) s per iteration, b = (\S+) s per active sequence$", out.stdout, re.M
    )
    assert line, out.stdout
    a, b = float(line[1]), float(line[2])
    for n, ms, fit in points:  # two points: the line passes through both
        assert float(fit) == pytest.approx(float(ms), abs=2e-3)
        # a and b are printed to 3 significant digits: allow their rounding
        slack = 0.01 * (abs(a) + abs(b) * int(n)) * 1e3 + 2e-3
        assert abs(float(fit) - (a + b * int(n)) * 1e3) <= slack
    flags = re.search(r"^dew plan \.\.\. --a (\S+) --b (\S+)$", out.stdout, re.M)
    assert flags and (float(flags[1]), float(flags[2])) == (a, b), out.stdout
