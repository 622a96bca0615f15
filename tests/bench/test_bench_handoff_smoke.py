"""bench/handoff.py: two runs of the copy example by two trees, rendered again from the
saved results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ._tiny import BENCH, run_tiny


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_handoff_tiny_runs_both_trees_and_renders_from_saved(tmp_path: Path) -> None:
    out = run_tiny("handoff.py", 280, "--out", str(tmp_path))
    saved = json.loads((tmp_path / "results.json").read_text())
    (row,) = saved["results"]
    for side in ("before", "after"):
        assert row[side]["step"] > 0 and row[side]["waited"] >= 0
        assert (Path(row[side]["run"]) / "records.jsonl").exists()
    assert "| 0 |" in out.stdout and "after over before" in out.stdout
    again = subprocess.run(
        [sys.executable, str(BENCH / "handoff.py"), "--load", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert again.stdout == out.stdout[out.stdout.index("## scheduler hand-off") :]
