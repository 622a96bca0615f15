"""``dew train`` on a disk that fills up: one line saying how much room a run needs,
exit 2, no partial checkpoint left, and the run resumes once there is room; and both
commands on a read-only disk: one line, exit 2.

The disks are a small tmpfs and a read-only bind mount in a user namespace of the
test's own (``unshare``), so they fill and refuse for real, even to root; where the
machine allows no user namespaces the tests skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.job.test_train_cli import config, make_model_dir


def _namespaces_allowed() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
        capture_output=True,
        check=False,
    )
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_full_disk_is_one_line_leaves_no_partial_checkpoint_and_resumes(
    tmp_path: Path,
) -> None:
    if not _namespaces_allowed():
        pytest.skip("no user namespaces here (unshare -rm): cannot mount a small disk")
    model = make_model_dir(tmp_path / "model")
    path = config(
        tmp_path,
        model,
        **{
            "checkpoint_every = 3": "checkpoint_every = 1",
            "export_every = 2": "export_every = 100",
            "wandb = true": "wandb = false",
            "eval_every = 2": "eval_every = 100",
        },
    )
    # A checkpoint is the weights and Adam's two moments: about three model files. The
    # disk holds two and the export, not three: with keep = 2 the third save fails.
    checkpoint = 3 * (model / "model.safetensors").stat().st_size
    size_k = int(2.7 * checkpoint) // 1024
    run, out = tmp_path / "run", tmp_path / "out"
    run.mkdir()
    out.mkdir()
    train = f"{sys.executable} -m dew.cli train {path} --no-progress"
    script = f"""
mount -t tmpfs -o size={size_k}k tmpfs {run} || exit 99
{train} 2> {out}/err1; echo $? > {out}/rc1
cp -r {run} {out}/after-full
rm -r {run}/checkpoints/step-00000001
{train} --resume 2> {out}/err2; echo $? > {out}/rc2
cp -r {run} {out}/after-resume
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], env=env, timeout=280, check=False)
    assert done.returncode == 0
    err = (out / "err1").read_text().strip()
    assert (out / "rc1").read_text().strip() == "2", err
    line = err.splitlines()[-1]
    assert line.startswith("dew train: error: ") and "step-00000003: no space left" in line, err
    assert "room for keep + 1 = 3 checkpoints at once" in line and "Traceback" not in err
    full = out / "after-full" / "checkpoints"
    assert sorted(p.name for p in full.iterdir()) == ["step-00000001", "step-00000002"]
    records = (out / "after-full" / "records.jsonl").read_text().splitlines()
    assert len(records) == 3  # the step trained; its checkpoint did not fit
    resumed = out / "after-resume"
    assert (out / "rc2").read_text().strip() == "0", (out / "err2").read_text()[-3000:]
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == [
        "step-00000002",
        "step-00000003",
    ]
    assert (resumed / "export" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_read_only_run_folder_is_one_line_exit_2_for_both_commands(tmp_path: Path) -> None:
    if not _namespaces_allowed():
        pytest.skip("no user namespaces here (unshare -rm): cannot mount a read-only disk")
    path = config(tmp_path, make_model_dir(tmp_path / "model"))
    ro, out = tmp_path / "ro", tmp_path / "out"
    ro.mkdir()
    out.mkdir()
    dew = f"{sys.executable} -m dew.cli"
    script = f"""
mount --bind {ro} {ro} && mount -o remount,bind,ro {ro} || exit 99
{dew} train {path} --no-progress --output.run_dir {ro}/run 2> {out}/train; echo $? >> {out}/rc
{dew} demo --steps 1 --run-dir {ro}/demo 2> {out}/demo; echo $? >> {out}/rc
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], env=env, timeout=280, check=False)
    assert done.returncode == 0
    assert (out / "rc").read_text().split() == ["2", "2"]
    train, demo = (out / "train").read_text(), (out / "demo").read_text()
    assert train == f"dew train: error: output.run_dir: {ro}/run: Read-only file system\n"
    assert demo.splitlines()[-1].startswith(f"dew demo: error: {ro}/demo cannot be written")
    assert "Read-only file system" in demo and "Traceback" not in demo
    assert list(ro.iterdir()) == []
