"""`torchrun ... -m dew.cli demo`: every process trains its own share; weights stay equal."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


def run_demo(n: int, out: Path, steps: int, timeout: float) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={n}", "-m", "dew.cli", "demo", "--no-progress"]
    cmd += ["--steps", str(steps), "--run-dir", str(out / "run")]
    with open(out / "log.txt", "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=out
        )
        try:
            code = proc.wait(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # nothing of the job outlives the test
            except ProcessLookupError:
                pass
            proc.wait()
    assert code == 0, (out / "log.txt").read_text()[-4000:]


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "records.jsonl").read_text().splitlines()]


def check(out: Path, n: int, steps: int) -> None:
    run = out / "run"
    folders = [run] + [run / f"rank{r}" for r in range(1, n)]
    per_rank = [records(f) for f in folders]
    assert all(len(r) == steps for r in per_rank)
    for step in range(steps):
        tasks = [set(r[step]["tasks"]["trained"]) for r in per_rank]
        assert all(tasks), "every process trained its own groups"
        assert len(set().union(*tasks)) == sum(map(len, tasks)), "shares overlap"
    assert (run / "plot.png").exists()
    assert not any((run / f"rank{r}" / "plot.png").exists() for r in range(1, n))
    # Every process's final checkpoint holds the same weights, byte for byte.
    last = f"checkpoints/step-{steps:08d}/model.safetensors"
    digests = {hashlib.sha256((f / last).read_bytes()).hexdigest() for f in folders}
    assert len(digests) == 1


@pytest.mark.timeout(300)
def test_demo_under_torchrun_two_processes(tmp_path: Path) -> None:
    run_demo(2, tmp_path, steps=3, timeout=240)
    check(tmp_path, 2, 3)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_demo_under_torchrun_four_processes(tmp_path: Path) -> None:
    run_demo(4, tmp_path, steps=2, timeout=360)
    check(tmp_path, 4, 2)
