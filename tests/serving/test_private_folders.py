"""Weights folders of dead writers are swept; a watchdog ends a server whose launcher died."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dew.serving._folders import private_folder, release_folder, weights_root

WRITER = """
import sys, time
from dew.serving._folders import private_folder
print(private_folder("test-"), flush=True)
time.sleep(600)
"""


def _dead_writers_folder() -> Path:
    proc = subprocess.Popen([sys.executable, "-c", WRITER], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    folder = Path(proc.stdout.readline().strip())
    proc.stdout.close()
    assert folder.is_dir() and folder.parent == weights_root()
    (folder / "weights-v1.safetensors").write_bytes(b"x" * 10)
    mine = private_folder("test-")  # a live writer's folder is never swept
    try:
        assert folder.is_dir()
    finally:
        release_folder(mine)
    proc.send_signal(signal.SIGKILL)  # no cleanup runs
    proc.wait()
    return folder


@pytest.mark.timeout(60)
def test_the_folder_of_a_killed_writer_is_swept_by_the_next_one() -> None:
    folder = _dead_writers_folder()
    lock = folder.parent / f"{folder.name}.lock"
    assert folder.is_dir() and lock.is_file()
    # Its lock file is older than the sweep's age bound (set, not waited for).
    old = time.time() - 60
    os.utime(lock, (old, old))
    mine = private_folder("test-")
    try:
        assert not folder.exists() and not lock.exists()
    finally:
        release_folder(mine)
    assert not mine.exists() and not (mine.parent / f"{mine.name}.lock").exists()


@pytest.mark.timeout(60)
def test_a_young_folder_is_left_for_its_writer_to_lock() -> None:
    folder = _dead_writers_folder()  # killed within seconds of making it
    mine = private_folder("test-")
    try:
        assert folder.is_dir()  # younger than the bound: maybe still being made
    finally:
        release_folder(mine)
        release_folder(folder)


WATCHED = """
import subprocess, sys, time
from dew._watchdog import watch
server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
dog = watch(server.pid, group=False)
print(server.pid, dog.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(60)
def test_a_watchdog_ends_the_server_once_its_launcher_is_killed() -> None:
    launcher = subprocess.Popen([sys.executable, "-c", WATCHED], stdout=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout is not None
        server, dog = (int(x) for x in launcher.stdout.readline().split())
        launcher.stdout.close()
        assert Path(f"/proc/{server}").exists() and Path(f"/proc/{dog}").exists()
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 30
        while Path(f"/proc/{server}").exists() or Path(f"/proc/{dog}").exists():
            assert time.monotonic() < deadline, "the server outlived its launcher"
            time.sleep(0.05)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


@pytest.mark.timeout(60)
def test_a_script_that_exits_without_closing_leaves_no_folder() -> None:
    """An HTTPEngine (or fleet) the script never closed: its folder goes at exit."""
    script = "from dew.serving._folders import private_folder\nprint(private_folder('test-'))\n"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=True
    )
    folder = Path(done.stdout.strip())
    assert folder.parent == weights_root()
    assert not folder.exists() and not (folder.parent / f"{folder.name}.lock").exists()
