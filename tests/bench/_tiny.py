"""Runs a benchmark script with ``--tiny`` the way every bench smoke test does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run_tiny(script: str, timeout: float, *args: str) -> subprocess.CompletedProcess[str]:
    """``bench/<script> --tiny [args]``, which must exit 0 and leave bench/RESULTS.md as
    it was."""
    results = BENCH / "RESULTS.md"
    before = results.read_text() if results.exists() else None
    out = subprocess.run(
        [sys.executable, str(BENCH / script), "--tiny", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert (results.read_text() if results.exists() else None) == before, "--tiny wrote"
    return out
