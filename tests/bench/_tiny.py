"""Runs a benchmark script with ``--tiny`` the way every bench smoke test does, and
imports one for tests of its functions."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

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


def bench_module(name: str) -> ModuleType:
    """``bench/<name>.py`` imported as ``bench_<name>`` (registered in ``sys.modules``,
    where its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
