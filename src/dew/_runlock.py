"""One writer per run folder: a lock held for the run's life. Imports nothing of dew.

:func:`hold` takes an exclusive ``flock`` on ``RUN/.lock`` and writes the holder's pid
into it. A second process asking for the same folder is refused at once
(:class:`RunInUse`, naming that pid) rather than training the same steps again beside
the first. Within one process the lock is re-entrant: ``dew train`` takes it before it
writes the folder's first file, and :func:`dew.train.fit` takes it again. The kernel
drops an ``flock`` however its process ends, so a killed run never leaves a stale lock.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["RunInUse", "hold"]

LOCK_NAME = ".lock"

_held: dict[Path, tuple[int, int]] = {}  # folder -> (file descriptor, depth)
_guard = threading.Lock()


class RunInUse(ValueError):
    """Another process holds the run folder."""


@contextmanager
def hold(run: str | os.PathLike[str]) -> Iterator[None]:
    """Hold ``run``'s lock (the folder is made if missing) for the ``with`` block."""
    folder = Path(run).resolve()
    with _guard:
        if folder in _held:
            fd, depth = _held[folder]
            _held[folder] = (fd, depth + 1)
        else:
            folder.mkdir(parents=True, exist_ok=True)
            _held[folder] = (_take(folder), 1)
    try:
        yield
    finally:
        with _guard:
            fd, depth = _held[folder]
            if depth > 1:
                _held[folder] = (fd, depth - 1)
            else:
                del _held[folder]
                os.close(fd)  # drops the flock


def _take(folder: Path) -> int:
    path = folder / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunInUse(
            f"{folder} is in use by another process (pid {holder}); wait for it to end, "
            "or use another run folder"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
