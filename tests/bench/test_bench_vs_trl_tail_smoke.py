"""bench/vs_trl_tail.py end to end for two small steps of each run on both tasks.

Slow (six worker processes, each importing torch, transformers and TRL): the slow CI
step runs it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dew.demo.tail import Workload

from ._tiny import run_tiny


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vs_trl_tail_bench_tiny(tmp_path: Path) -> None:
    out = run_tiny("vs_trl_tail.py", 590, "--policy", "1,os=1", "--save", str(tmp_path))
    text = out.stdout
    # every run's result, and how they were made, for a later --load --write
    assert len(list(tmp_path.glob("tail*-0.json"))) == 8
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["command"].endswith("--tiny --policy 1,os=1 --save " + str(tmp_path))
    assert run["seconds"] > 0 and "torch" in run["machine"]
    # each system on its own faster thread count unless told otherwise, as recorded
    assert "(TRL 2 torch threads per run, dew 1)" in run["machine"]
    saved = [json.loads(p.read_text())["spec"] for p in tmp_path.glob("tail*-0.json")]
    assert {(s["system"], s["threads"]) for s in saved} == {("dew", 1), ("trl", 2)}
    assert Workload().describe() in text  # the workload's parameters beside the figures
    runs = (
        "dew \\(ahead 1, os 1\\)",
        "dew \\(ahead 1, os 1, 2 engine processes\\)",
        "dew sync \\(ahead 0\\)",
        "TRL GRPOTrainer",
    )
    for task in ("tail", "tail-turns"):
        section = text.split(f"### {task} ")[1].split("### ")[0]
        for run in runs:
            row = re.search(
                rf"^\| {run} \| 0 \| not reached in 2 steps \| 2 \| ([\d,]+) \| (\d+\.\d+) "
                rf"\| (\d+)% \| (\d+\.\d\d) \| ([\d,]+) MB \|$",
                section,
                re.M,
            )
            assert row, section
            assert int(row[1].replace(",", "")) > 0 and float(row[2]) > 0
            assert 0 < int(row[3]) <= 100  # an untrained first step always waits a while
            assert float(row[4]) >= 0  # cores other work took during the run
            assert 100 < int(row[5].replace(",", "")) < 20_000  # MB: a real process's peak
        assert re.search(
            r"^- TRL GRPOTrainer seconds to reward [\d.]+ / dew \(ahead 1, os 1\)'s \(medians\): "
            r".+; completions/s, dew \(ahead 1, os 1\) / TRL GRPOTrainer: \d+\.\d+x$",
            section,
            re.M,
        ), section
    for task, target in (("tail", "3"), ("tail-turns", "3")):
        assert re.search(
            rf"^vs TRL, {task}: time to reward [\d.]+: .+; target >= {target}x: ", text, re.M
        ), text
