"""bench/plan_fit.py end to end on the tiny model: it must not rot between measured runs."""

from __future__ import annotations

import re

import pytest

from ._tiny import run_tiny


@pytest.mark.timeout(120)
def test_plan_fit_tiny() -> None:
    out = run_tiny("plan_fit.py", timeout=100)
    points = re.findall(r"^active +(\d+): +([\d.]+) ms per iteration", out.stdout, re.M)
    assert [int(n) for n, _ in points] == [1, 4], out.stdout
    assert all(float(ms) > 0 for _, ms in points)
    flags = re.search(r"^dew plan \.\.\. --a (\S+) --b (\S+)$", out.stdout, re.M)
    assert flags, out.stdout
    assert float(flags[1]) > 0  # a fixed cost per iteration is always there
