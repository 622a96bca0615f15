"""The fleet's publish sequence: a push to every member in rotation, retried while
none is (see the package docstring)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

from dew.core import EngineError, as_int
from dew.serving.fleet._parts import UP, Member


class Publish:
    """Mixed into :class:`~dew.serving.fleet.EngineFleet`: ``load`` and its pushes."""

    _lock: threading.Lock
    _publish_lock: threading.Lock
    _stopping: threading.Event
    _members: list[Member]
    _pool: ThreadPoolExecutor
    _timeout: float
    _version: int
    _published: bool
    _files: list[tuple[int, Path]]
    _dir: Path
    _closed: bool
    _publishing: bool

    def _take_out(self, member: Member, gen: int, reason: str) -> None:
        raise NotImplementedError

    def _drain(self) -> None:
        raise NotImplementedError

    def load(self, variables: Any, version: int) -> None:
        """Serve ``variables`` as ``version`` on every member in rotation (see the
        module docstring). When no member takes them (all of them down, say), the push
        waits for members to come back (a launched one is restarted and brought to the
        fleet's version first) and is tried again, for ``timeout`` seconds in all; then
        ``EngineError``."""
        from dew.serving.weights import write_weights

        version = as_int(version, "version")
        deadline = time.monotonic() + self._timeout
        path: Path | None = None
        why = ""
        try:
            while True:
                self._await_member(deadline, why)
                with self._publish_lock:
                    if self._closed:
                        raise RuntimeError("EngineFleet is closed")
                    if self._published and version < self._version:
                        raise ValueError(
                            f"version {version} is older than the fleet's {self._version}"
                        )
                    if path is None:
                        path = write_weights(variables, self._dir, version)
                    with self._lock:
                        targets = [(m, m.gen) for m in self._members if m.state == UP]
                        # A call finishing at the new version before load returns would be
                        # "from the future" to the trainer: new calls wait for the push.
                        self._publishing = True
                    try:
                        why, refused = self._push(path, version, targets)
                    finally:
                        with self._lock:
                            self._publishing = False
                        self._drain()
                    if not why:
                        path = None  # the fleet's now
                        return
                if refused or time.monotonic() > deadline:  # refused: no retry takes them
                    raise EngineError(
                        f"no engine of the fleet took weights v{version} within "
                        f"{self._timeout:g}s: {why}"
                    )
        finally:
            if path is not None and not any(v == version for v, _ in self._files):
                path.unlink(missing_ok=True)

    def _await_member(self, deadline: float, why: str) -> None:
        """Return once a member is in rotation; EngineError past ``deadline``."""
        while not self._closed and not any(m.state == UP for m in self._members):
            if time.monotonic() > deadline:  # e.g. a fleet of one, restarting
                last = f" (last: {why})" if why else ""
                raise EngineError(
                    f"no engine of the fleet in rotation for {self._timeout:g}s{last}"
                )
            self._stopping.wait(0.05)

    def _push(
        self, path: Path, version: int, targets: list[tuple[Member, int]]
    ) -> tuple[str, bool]:
        """Push ``path`` to ``targets`` and take out who fails (publish lock held).
        Returns why none took it ("" once one did), and whether every member that
        answered refused the weights themselves (so that no retry could help)."""
        pushes = {m: self._pool.submit(m.engine.load_file, path, version) for m, _ in targets}
        failed: dict[Member, str] = {}
        refusals = 0
        pending = dict(pushes)
        while pending:  # until each push answers or its member was taken out
            wait_futures(list(pending.values()), timeout=0.05)
            for m, gen in targets:
                push = pending.get(m)
                if push is None:
                    continue
                if push.done():
                    del pending[m]
                    if push.exception() is not None:
                        failed[m] = f"weights v{version} not taken: {push.exception()}"
                        refusals += isinstance(push.exception(), ValueError)
                elif m.gen != gen:
                    del pending[m]
                    failed[m] = f"taken out during the push of v{version}"
        for m, gen in targets:
            if m in failed:
                self._take_out(m, gen, failed[m])
        took = [m for m, gen in targets if m not in failed]
        with self._lock:
            took = [m for m in took if m.state == UP]
            for m in took:
                m.confirmed = m.pushed = version
            if took:
                self._version = version
                self._published = True
        if not took:
            why = "; ".join(f"{m.engine.url}: {r}" for m, r in failed.items())
            return why or "none in rotation", 0 < refusals == len(failed)
        self._files = [(v, p) for v, p in self._files if v != version] + [(version, path)]
        for _, old in self._files[:-2]:
            old.unlink(missing_ok=True)
        self._files = self._files[-2:]
        return "", False
