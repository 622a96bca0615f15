"""bench/fleet.py end to end on a tiny model: it must not rot between measured runs.

Starts real ``dew serve`` processes (one per push model, and the fleets), so it is slow
on a small machine.
"""

from __future__ import annotations

import re

import pytest

from ._tiny import run_tiny


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fleet_bench_tiny() -> None:
    out = run_tiny("fleet.py", timeout=560)
    paths = ("file: HTTPEngine.load", "file: write", "file: server load", "broadcast \\(gloo\\)")
    for path in paths:
        cells = r"([\d,]+) \| ([\d,]+) \| ([\d.]+)"
        row = re.search(rf"^\| ~0\.1M [^|]+ \| {path} \| {cells} \|$", out.stdout, re.M)
        assert row, (path, out.stdout)
    names = r"in-process RolloutServer|EngineFleet of \d|HTTPEngine"
    engines = re.findall(rf"^\| ({names}) \| ([\d.]+) ", out.stdout, re.M)
    assert engines and engines[0][0] == "in-process RolloutServer", out.stdout
    assert len(engines) in (2, 3) and all(float(rate) > 0 for _, rate in engines), out.stdout
