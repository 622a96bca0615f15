"""bench/serve_exit.py end to end, one run each way: it must not rot between runs."""

from __future__ import annotations

import re

import pytest

from ._tiny import run_tiny


@pytest.mark.timeout(180)
def test_serve_exit_bench_tiny() -> None:
    out = run_tiny("serve_exit.py", 160)
    rows = re.findall(
        r"^\| (ends its process|interpreter teardown)[^|]* \| ([\d,]+) \|", out.stdout, re.M
    )
    assert [name for name, _ in rows] == ["ends its process", "interpreter teardown"], out.stdout
    assert all(int(ms.replace(",", "")) > 0 for _, ms in rows)
