"""bench/gateway.py end to end at 4 sessions: it must not rot between measured runs."""

from __future__ import annotations

import re

import pytest

from ._tiny import run_tiny


@pytest.mark.timeout(240)
def test_gateway_bench_tiny() -> None:
    out = run_tiny("gateway.py", 220, "--processes", "1")
    sides = r"in process|gateway|gateway, 1 harness process"
    rows = {
        m[1]: [float(x) if x != "-" else None for x in m[2].split(" | ")]
        for m in re.finditer(rf"^\| 4 \| ({sides}) \| (.*) \|$", out.stdout, re.M)
    }
    assert set(rows) == {"in process", "gateway", "gateway, 1 harness process"}, out.stdout
    for side, cells in rows.items():
        p50, p99, per_s, call50, _, engine50 = cells[:6]
        assert 0 < p50 <= p99 and per_s > 0, (side, cells)
        assert call50 >= engine50 > 0, (side, cells)  # a call includes its engine time
        assert cells[-1] == 0, (side, cells)  # every episode completed
    for gateway in (rows["gateway"], rows["gateway, 1 harness process"]):
        assert gateway[7] > 0 and gateway[8] > 0, gateway  # both CPU figures were measured
    assert re.search(r"^- N=4: rollout p50 through the gateway [\d.]+x", out.stdout, re.M)
    assert re.search(
        r"^- N=4: rollout p50 through the gateway \(1 harness process\) [\d.]+x",
        out.stdout,
        re.M,
    )
