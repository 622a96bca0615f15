"""dew._runlock: one process per run folder, re-entrant within it, dropped however it ends."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dew._runlock import RunInUse, hold

HOLDER = """
import sys, time
from dew._runlock import hold
with hold(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def _holder(run: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


@pytest.mark.timeout(60)
def test_a_second_process_is_refused_until_the_first_is_killed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _holder(run)
    try:
        with pytest.raises(RunInUse, match="in use by another process"):
            with hold(run):
                pass
        proc.send_signal(signal.SIGKILL)  # no cleanup runs: the kernel drops the lock
        proc.wait(timeout=30)
        with hold(run):
            assert list(run.iterdir()) == []  # the lock adds nothing to the folder
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_the_lock_is_reentrant_in_one_process_and_released_at_the_end(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with hold(run), hold(run):  # dew train's hold, then fit's
        pass
    code = f"from dew._runlock import hold\nwith hold({str(run)!r}): pass"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)  # free again
