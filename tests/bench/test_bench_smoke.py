"""Benchmarks run end to end on tiny inputs: they must not rot between measured runs."""

from __future__ import annotations

import importlib.util
import re

import pytest

from ._tiny import BENCH, run_tiny


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_pack_bench_tiny():
    out = run_tiny("pack.py", timeout=100)
    rates = re.findall(r"^([\w +-]+): ([\d,]+) tokens/s", out.stdout, re.M)
    forms = ["lists", "numpy arrays", "numpy arrays + top-20 support"]
    assert [form for form, _ in rates] == forms, out.stdout
    assert all(int(rate.replace(",", "")) > 0 for _, rate in rates)
    assert out.stdout.count(" 0 groups cut") == 3, out.stdout


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
