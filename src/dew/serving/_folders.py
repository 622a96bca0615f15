"""Where weights files go: the shared-memory folder, the user's weights root, and the
private folder each writer holds until it releases it (or its process is gone)."""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

from dew.serving.weights import WeightsError

__all__ = ["private_folder", "release_folder", "shared_memory", "weights_root"]


def shared_memory() -> Path | None:
    """``/dev/shm`` where this machine has one (its files live in memory)."""
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else None


def weights_root() -> Path:
    """The folder weights files go to, and the only one servers read, when none is
    named: ``dew-weights-<uid>`` in shared memory (``/dev/shm``) where there is one,
    else in the temp folder, private to this user (made ``0700``; one found there that
    is not this user's own folder is refused, never used)."""
    base = shared_memory() or Path(tempfile.gettempdir())
    root = base / f"dew-weights-{os.getuid()}"
    root.mkdir(mode=0o700, exist_ok=True)
    info = os.lstat(root)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise WeightsError(f"{root} is not a folder of this user's: name a weights folder")
    return root


# A private folder's lock file is swept only once older than this: its writer takes the
# lock within microseconds of making the file.
_SWEEP_AGE = 5.0
_private: dict[Path, tuple[Path, int]] = {}  # folder -> (its lock file, the held descriptor)


def private_folder(prefix: str) -> Path:
    """A new folder in :func:`weights_root` for one writer, held (``flock`` on ``NAME.lock``
    beside it) until :func:`release_folder` or the interpreter's exit. Folders of writers
    that died without releasing them (SIGKILL runs no cleanup) are removed first."""
    import secrets

    from dew import _runlock

    root = weights_root()
    _sweep(root)
    while True:
        name = f"{prefix}{secrets.token_hex(6)}"
        lock = root / f"{name}.lock"
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            continue
        break
    fd = _runlock.lock_file(lock)
    folder = root / name
    folder.mkdir(mode=0o700)
    _private[folder] = (lock, fd)
    return folder


@atexit.register  # a script that exits without closing its engine leaves nothing
def _release_all() -> None:
    for folder in list(_private):
        release_folder(folder)


def release_folder(folder: Path) -> None:
    """Remove ``folder`` and, if :func:`private_folder` made it, its lock."""
    shutil.rmtree(folder, ignore_errors=True)
    held = _private.pop(folder, None)
    if held is not None:
        lock, fd = held
        lock.unlink(missing_ok=True)
        os.close(fd)


def _sweep(root: Path) -> None:
    """Remove the private folders of ``root`` whose writers are gone."""
    from dew import _runlock

    now = time.time()
    for lock in root.glob("*.lock"):
        try:
            if now - lock.stat().st_mtime < _SWEEP_AGE:
                continue
        except FileNotFoundError:
            continue
        fd = _runlock.try_lock_file(lock)
        if fd is None:  # its writer lives (or another sweep took it)
            continue
        try:
            shutil.rmtree(root / lock.name.removesuffix(".lock"), ignore_errors=True)
            lock.unlink(missing_ok=True)
        finally:
            os.close(fd)
