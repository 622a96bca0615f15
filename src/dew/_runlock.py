"""One writer per run folder: a lock held for the run's life. Imports nothing of dew.

:func:`hold` takes an exclusive ``flock`` on the run folder itself, adding nothing to
it. A second process asking for the same folder is refused at once (:class:`RunInUse`)
rather than training the same steps again beside the first. Within one process the
lock is re-entrant: ``dew train`` takes it before it writes the folder's first file,
and :func:`dew.train.fit` takes it again. The kernel drops an ``flock`` however its
process ends, so a killed run never leaves a stale lock.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["RunInUse", "hold", "lock_file", "try_lock_file"]

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
    # The folder itself is locked (an flock on its descriptor), so nothing is added to it:
    # a run refused before it wrote anything leaves its folder as it found it.
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunInUse(
            f"{folder} is in use by another process; wait for it to end, or use another run folder"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def lock_file(path: Path) -> int:
    """An exclusive ``flock`` on ``path`` (made if missing), with this pid written in
    it: the open descriptor, whose closing releases it. :class:`RunInUse` (its message:
    the holder's pid) when another open of the file holds it, in any process."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunInUse(holder) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def try_lock_file(path: Path) -> int | None:
    """:func:`lock_file` of an existing file, or None when it is held (by any process,
    this one too) or gone."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd
