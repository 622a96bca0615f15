"""bench/engine.py end to end on a tiny model: it must not rot between measured runs."""

from __future__ import annotations

import re

import pytest

from ._tiny import run_tiny


@pytest.mark.timeout(240)
def test_engine_bench_tiny() -> None:
    out = run_tiny("engine.py", timeout=220)
    cell = r"([\d,]+) \(median [\d,]+, min [\d,]+\)"
    row = re.search(rf"^\| tiny \| {cell} \| {cell} \| ([\d.]+)x \|$", out.stdout, re.M)
    assert row, out.stdout
    assert int(row[1].replace(",", "")) > 0 and int(row[2].replace(",", "")) > 0
    rows = re.findall(rf"^\| tiny \| {cell} \| {cell} \| ([\d.]+)x \|$", out.stdout, re.M)
    assert len(rows) == 2, out.stdout  # the fixed-length and the lognormal batch
    grpo = re.search(
        rf"^\| tiny \| {cell} \| {cell} \| {cell} \| [\d.]+x \| ([\d,]+) / ([\d,]+) \| "
        r"([\d,]+) / ([\d,]+) \|$",
        out.stdout,
        re.M,
    )
    assert grpo, out.stdout
    plain, served, shared, served_again = (int(grpo[i].replace(",", "")) for i in range(4, 8))
    assert plain == served == served_again > 0
    # --tiny: groups of 4 samples, each prompt computed exactly once: not less, which a
    # warm-up on the timed prompts would leave (the server keeps finished prefixes)
    assert shared * 4 == served, (shared, served)
    latencies = re.findall(r"^\| [^|]+ \| (\d+\.\d+) \|$", out.stdout, re.M)
    assert len(latencies) == 3 and all(float(s) > 0 for s in latencies), out.stdout
