"""The README's example runs as written, so the front page never drifts from the code."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.timeout(300)
def test_readme_example_trains_and_records(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "the README has no python example"
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-4000:]
    records = [
        json.loads(line)
        for line in (tmp_path / "runs" / "mine" / "records.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == list(range(1, 101))
    rewards = [r["scheduler"]["metrics"]["reward/mean"] for r in records]
    # np.mean, as the example does: a plain sum adds in another order, and its last bit
    # can round the printed third decimal the other way.
    first, last = float(np.mean(rewards[:10])), float(np.mean(rewards[-10:]))
    # It learns: an untrained model gets ~1/100 of the digits; 100 steps lift that several
    # times over (measured: see the README's sentence above the example).
    assert last > 3 * first and last > first + 0.05, (first, last)
    printed = f"mean reward: first 10 steps {first:.3f}, last 10 steps {last:.3f}"
    assert printed in out.stdout, out.stdout
