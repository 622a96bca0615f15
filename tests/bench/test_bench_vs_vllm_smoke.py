"""bench/vs_vllm.py end to end for a few steps: it must not rot between measured runs.

Starts a ``dew serve`` process and a vLLM server (the vLLM environment of ``make
vllm-env``), so it runs in the slow step.
"""

from __future__ import annotations

import re

import pytest

from ..serving._vllm import python
from ._tiny import run_tiny


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vllm_bench_tiny() -> None:
    out = run_tiny("vs_vllm.py", 560, "--vllm-python", str(python()))
    for engine in ("own, in process", "own, 1 dew serve", "vLLM, 1 server"):
        # steps to reward are "-" in a few steps; s/step, completions/s and the step's
        # costs are measured
        cells = r"[^|]+ \| [^|]+ \| ([\d.]+) \| ([\d,]+) \| 0/1 \| [\d.]+ "
        cells += r"\| ([\d.]+) \| ([\d.]+) \|"
        row = re.search(rf"^\| {re.escape(engine)} \| {cells}$", out.stdout, re.M)
        assert row, (engine, out.stdout)
        assert all(float(x.replace(",", "")) > 0 for x in row.groups()), row.group(0)
    assert "NotImplementedError" in out.stdout
