"""bench/schedule.py end to end on one tiny cell, so it never rots."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest

from ._tiny import BENCH, run_tiny


# Slow step: a whole benchmark run, which make test's ten minutes cannot spare.
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_schedule_bench_tiny():
    out = run_tiny("schedule.py", timeout=170)
    rows = re.findall(
        r"^\| (sync|ahead [^|]*?) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", out.stdout, re.M
    )
    assert [r[0] for r in rows] == [
        "sync",
        "ahead 1",
        "ahead 2",
        "ahead 1 + os 25%",
        "ahead 1 + os 100%",
        "ahead 1 + admit 75%",
        "ahead 2 + os 25%",
    ], out.stdout
    assert all(float(v) > 0 for row in rows for v in row[1:])
    assert "real within 5% of the plan's fraction" in out.stdout


def test_schedule_bench_write_section_keeps_other_sections(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_schedule", BENCH / "schedule.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmark results\n\n## summary\n\ntop\n\n## pack\n\nkept\n")
    bench.write_section("## schedule\n\nfirst\n", path)
    bench.write_section("## schedule\n\nsecond\n", path)
    assert path.read_text() == (
        "# Benchmark results\n\n## summary\n\ntop\n\n## pack\n\nkept\n\n## schedule\n\nsecond\n"
    )
