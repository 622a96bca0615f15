"""`torchrun ... -m dew.cli demo`: every process trains its own share of one sharded model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


def run_demo(n: int, out: Path, steps: int, timeout: float, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={n}", "-m", "dew.cli", "demo", "--no-progress"]
    cmd += ["--steps", str(steps), *args]
    with open(out / "log.txt", "a") as log:
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


def check(out: Path, n: int, steps: int, tensor: int = 1) -> None:
    run = out / "run"
    folders = [run] + [run / f"rank{r}" for r in range(1, n)]
    per_rank = [records(f) for f in folders]
    assert all([r["step"] for r in rs] == list(range(1, steps + 1)) for rs in per_rank)
    first_readers = per_rank[::tensor]
    for step in range(steps):
        tasks = [set(r[step]["tasks"]["trained"]) for r in first_readers]
        assert all(tasks), "every share trained its own groups"
        assert len(set().union(*tasks)) == sum(map(len, tasks)), "shares overlap"
        for share in range(n // tensor):  # the readers of a share train the same rows
            readers = per_rank[share * tensor : (share + 1) * tensor]
            assert len({r[step]["trained_tokens"] for r in readers}) == 1
    assert (run / "plot.png").exists()
    assert not any((run / f"rank{r}" / "plot.png").exists() for r in range(1, n))
    # One sharded checkpoint of the whole job: every process's shard and state in it.
    last = run / "checkpoints" / f"step-{steps:08d}"
    manifest = json.loads((last / "manifest.json").read_text())
    assert manifest["mesh"] == {"world": n, "data": n // tensor, "tensor": tensor}
    assert all(f"rank{r}/state.json" in manifest["files"] for r in range(n))
    assert all(f"__{r}_0.distcp" in manifest["files"] for r in range(n))


@pytest.mark.timeout(300)
def test_demo_under_torchrun_two_processes(tmp_path: Path) -> None:
    run_demo(2, tmp_path, 3, 240, "--run-dir", str(tmp_path / "run"))
    check(tmp_path, 2, 3)
    # Continued under torchrun from its sharded checkpoint.
    run_demo(2, tmp_path, 4, 240, "--resume", str(tmp_path / "run"))
    check(tmp_path, 2, 4)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_demo_under_torchrun_data_and_tensor_axes(tmp_path: Path) -> None:
    run_demo(4, tmp_path, 2, 360, "--run-dir", str(tmp_path / "run"), "--tensor", "2")
    check(tmp_path, 4, 2, tensor=2)
