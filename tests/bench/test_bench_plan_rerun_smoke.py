"""bench/plan_rerun.py: a probe fitted, every policy of its grid run, the table rendered
again from the saved results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ._tiny import BENCH, run_tiny


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_plan_rerun_tiny_fits_a_probe_runs_its_grid_and_renders_from_saved(tmp_path: Path) -> None:
    out = run_tiny("plan_rerun.py", 380, "--out", str(tmp_path))
    saved = json.loads((tmp_path / "results.json").read_text())
    (result,) = saved["results"]
    assert result["workload"] == "copy" and result["default"] == "ahead 1"
    runs = result["runs"]
    assert "sync" in runs and result["recommended"] in runs  # the recommended one was run
    for name, r in runs.items():
        assert r["measured"]["step_time"] > 0 and r["planned"]["step_time"] > 0, name
    assert set(result["obstacles"]) >= {"as fitted", "separate devices", "none of these"}
    assert result["split"]["measured_busy"] > 0 and result["split"]["profile_cpu_ms"] > 0
    assert saved["counting"]["iteration_add_us"] > 0 and saved["counting"]["histogram_add_us"] > 0
    assert "`IterationLog.add`" in out.stdout and "The default's step, planned" in out.stdout
    assert "### copy (seed 0)" in out.stdout
    again = subprocess.run(
        [sys.executable, str(BENCH / "plan_rerun.py"), "--load", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    section = out.stdout[out.stdout.index("## plan from a run") :]
    assert again.stdout == section  # the same table from the saved results
