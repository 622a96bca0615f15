"""bench/engine.py end to end on a tiny model: it must not rot between measured runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.timeout(240)
def test_engine_bench_tiny() -> None:
    results = BENCH / "RESULTS.md"
    before = results.read_text() if results.exists() else None
    out = subprocess.run(
        [sys.executable, str(BENCH / "engine.py"), "--tiny"],
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    cell = r"([\d,]+) \(median [\d,]+, min [\d,]+\)"
    row = re.search(rf"^\| tiny \| {cell} \| {cell} \| ([\d.]+)x \|$", out.stdout, re.M)
    assert row, out.stdout
    assert int(row[1].replace(",", "")) > 0 and int(row[2].replace(",", "")) > 0
    latencies = re.findall(r"^\| [^|]+ \| (\d+\.\d+) \|$", out.stdout, re.M)
    assert len(latencies) == 3 and all(float(s) > 0 for s in latencies), out.stdout
    assert (results.read_text() if results.exists() else None) == before  # --tiny writes nothing
