"""Benchmarks run end to end on tiny inputs: they must not rot between measured runs."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_pack_bench_tiny():
    results = BENCH / "RESULTS.md"
    before = results.read_text() if results.exists() else None
    out = subprocess.run(
        [sys.executable, str(BENCH / "pack.py"), "--tiny"],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    rates = re.findall(r"^([\w +-]+): ([\d,]+) tokens/s", out.stdout, re.M)
    forms = ["lists", "numpy arrays", "numpy arrays + top-20 support"]
    assert [form for form, _ in rates] == forms, out.stdout
    assert all(int(rate.replace(",", "")) > 0 for _, rate in rates)
    assert out.stdout.count(" 0 groups cut") == 3, out.stdout
    after = results.read_text() if results.exists() else None
    assert after == before  # --tiny never writes


def test_pack_bench_write_section_keeps_other_sections(tmp_path):
    bench = _load("pack")
    path = tmp_path / "RESULTS.md"
    bench.write_section("## pack\n\nfirst\n", path)
    assert path.read_text() == "# Benchmark results\n\n## pack\n\nfirst\n"
    path.write_text(path.read_text() + "\n## engine\n\nkept\n")
    bench.write_section("## pack\n\nsecond\n", path)
    assert path.read_text() == "# Benchmark results\n\n## pack\n\nsecond\n\n## engine\n\nkept\n"
    path.write_text("# Benchmark results\n\n## engine\n\nkept\n")
    bench.write_section("## pack\n\nthird\n", path)
    assert path.read_text() == "# Benchmark results\n\n## engine\n\nkept\n\n## pack\n\nthird\n"
