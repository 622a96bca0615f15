"""bench/scheduler_overhead.py end to end on a tiny batch, so it does not rot between runs."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

from ._tiny import BENCH, run_tiny


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_scheduler_overhead", BENCH / "scheduler_overhead.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_scheduler_overhead_bench_tiny() -> None:
    out = run_tiny("scheduler_overhead.py", timeout=100)
    m = re.search(
        r"^per call: ([\d.]+) CPU s, ([\d.]+) wall s, ([\d.]+) us per rollout "
        r"\(64 tasks x 4 samples = 256 rollouts into \[(\d+), 4096\], padding [\d.]+%, "
        r"64 groups packed, 0 cut; median of 2 calls\)$",
        out.stdout,
        re.M,
    )
    assert m, out.stdout
    cpu, wall, per_rollout = (float(x) for x in m.groups()[:3])
    assert cpu > 0 and wall > 0
    # Both are printed rounded: CPU seconds to 3 decimals (at ~0.04 s that alone is
    # up to 1.2%), microseconds to 1; the tolerance is exactly those roundings.
    assert per_rollout == pytest.approx(cpu / 256 * 1e6, abs=0.0005 / 256 * 1e6 + 0.05)
    pack = re.search(
        r"^pack alone: ([\d.]+) CPU s; the rest .*: (-?[\d.]+) CPU s, ", out.stdout, re.M
    )
    assert pack, out.stdout
    assert float(pack.group(1)) > 0


def test_scheduler_overhead_write_section_keeps_other_sections(tmp_path: Path) -> None:
    bench = _load()
    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmark results\n\n## pack\n\nkept\n")
    bench.write_section("## scheduler overhead\n\nfirst\n", path)
    assert path.read_text() == (
        "# Benchmark results\n\n## pack\n\nkept\n\n## scheduler overhead\n\nfirst\n"
    )
    path.write_text(path.read_text() + "\n## engine\n\nalso kept\n")
    bench.write_section("## scheduler overhead\n\nsecond\n", path)
    assert path.read_text() == (
        "# Benchmark results\n\n## pack\n\nkept\n\n## scheduler overhead\n\nsecond\n\n"
        "## engine\n\nalso kept\n"
    )
