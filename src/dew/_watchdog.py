"""A server process that outlives the trainer that launched it is a leak: this ends it.

``python -m dew._watchdog PARENT PID [--group]`` watches process ``PARENT`` (the trainer)
and process ``PID`` (a server it launched). When the trainer is gone, however it ended
(a SIGKILL runs no cleanup of its own), the server gets SIGTERM, and SIGKILL after a
grace period: its process group with ``--group`` (a vLLM server and its engine
processes), else the pid alone. The watchdog exits once the server is gone, whoever
ended it. The trainer starts one per server and stops it with the server
(:func:`watch`, :func:`unwatch`). Imports nothing of dew, so it starts fast.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

__all__ = ["unwatch", "watch"]

POLL = 0.2  # seconds between looks at both processes
GRACE = 10.0  # seconds between SIGTERM and SIGKILL


def watch(pid: int, *, group: bool) -> subprocess.Popen[bytes]:
    """Start a watchdog of server ``pid`` for this process; the caller owns it."""
    argv = [sys.executable, "-m", "dew._watchdog", str(os.getpid()), str(pid)]
    if group:
        argv.append("--group")
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


def unwatch(dog: subprocess.Popen[bytes] | None) -> None:
    """Stop a watchdog (the server is being stopped by its owner)."""
    if dog is None:
        return
    if dog.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            dog.kill()
    dog.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal(pid: int, group: bool, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def main(argv: list[str]) -> int:
    parent, pid = int(argv[0]), int(argv[1])
    group = "--group" in argv[2:]
    # A parent that dies re-parents this process: getppid() then no longer names it.
    while os.getppid() == parent and _alive(pid):
        time.sleep(POLL)
    if not _alive(pid):
        return 0
    _signal(pid, group, signal.SIGTERM)
    _signal(pid, group, signal.SIGCONT)  # a stopped server must be able to take it
    deadline = time.monotonic() + GRACE
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(POLL)
    _signal(pid, group, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
