"""The fleet's health thread and supervisor: taking members out, bringing them back."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

from dew.core import Aborted, EngineError
from dew.serving._http_base import LoopEngine
from dew.serving.fleet._parts import (
    BACKOFF_MAX,
    OUT,
    RESTARTING,
    UP,
    FleetCall,
    Member,
    Process,
    settle,
    stopped,
)

log = logging.getLogger("dew.serving.fleet")


class Care:
    """Mixed into :class:`~dew.serving.fleet.EngineFleet`: its two threads' work."""

    _lock: threading.Lock
    _publish_lock: threading.Lock
    _stopping: threading.Event
    _members: list[Member]
    _pool: ThreadPoolExecutor
    _interval: float
    _max_failures: int
    _timeout: float
    _startup: float
    _engine_kw: dict[str, Any]
    _make: Any  # the members' engine class
    _version: int
    _files: list[tuple[int, Path]]
    _waiting: deque[FleetCall]
    _closed: bool

    def _take_out(self, member: Member, gen: int, reason: str) -> None:
        raise NotImplementedError

    def _join(self, member: Member, gen: int, version: int) -> bool:
        raise NotImplementedError

    def _check_model(self, engine: LoopEngine) -> None:
        raise NotImplementedError

    def _recheck(self, member: Member, gen: int, engine: LoopEngine, error: str) -> None:
        """A request failed on ``member``: out if ``/health`` fails too, else trusted
        with new calls again. A launched member whose process is gone is out at once."""
        if self._stopping.is_set():
            return
        if member.local is not None and not member.local.alive():
            self._take_out(member, gen, f"a request failed ({error}): the process is gone")
        elif not engine.health():
            self._take_out(member, gen, f"a request failed ({error}) and so did /health")
        else:
            with self._lock:
                if member.gen == gen:
                    member.suspect = False

    def _bring_up(self, member: Member, gen: int) -> bool:
        """Push the newest weights to an out member and rejoin it; False if it could
        not (it stays out, tried again after a backoff) or the publish lock is busy."""
        if not self._publish_lock.acquire(timeout=0.1):
            return False
        try:
            with self._lock:
                if member.gen != gen or member.state != OUT:
                    return member.state == UP
            version, engine = self._version, member.engine
            newest = self._files[-1] if self._files else None
            try:
                if newest is not None and newest[0] == version:
                    try:
                        engine.load_file(newest[1], version)
                    except ValueError:
                        # Not newer: it kept the weights this fleet pushed and confirmed
                        # (a server without the same-checksum no-op rule).
                        if not (engine.health() and engine.version == version == member.pushed):
                            raise
                elif not (engine.health() and engine.version == version):
                    raise ValueError(f"serves version {engine.version}, not {version}")
            except (EngineError, ValueError, RuntimeError) as exc:
                with self._lock:
                    if member.gen == gen:
                        member.reason = f"cannot be brought to version {version}: {exc}"
                        member.backoff = min(BACKOFF_MAX, member.backoff * 2)
                        member.retry_at = time.monotonic() + member.backoff
                return False
            return self._join(member, gen, version)
        finally:
            self._publish_lock.release()

    def _health_loop(self) -> None:
        while not self._stopping.wait(self._interval):
            self._expire_waiting()
            now = time.monotonic()
            with self._lock:
                todo = [
                    (m, m.gen, m.state, m.engine)
                    for m in self._members
                    if (m.state == UP or (m.state == OUT and now >= m.retry_at))
                    and (m.local is None or m.local.alive())
                ]
            checks = [self._pool.submit(e.health) for _, _, _, e in todo]
            wait_futures(checks)
            for (m, gen, state, _), check in zip(todo, checks, strict=True):
                ok = check.exception() is None and bool(check.result())
                if self._stopping.is_set():
                    return
                if state == OUT:
                    if ok:
                        self._bring_up(m, gen)
                    continue
                with self._lock:
                    if m.gen != gen:
                        continue
                    m.failures = 0 if ok else m.failures + 1
                    out = m.failures >= self._max_failures
                if out:
                    self._take_out(m, gen, f"{self._max_failures} health checks failed")

    def _expire_waiting(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [c for c in self._waiting if c.deadline <= now or stopped(c)]
            for c in late:
                self._waiting.remove(c)
        for c in late:
            if stopped(c):
                settle(c.outer, Aborted("generation stopped before it was sent"))
            else:
                settle(c.outer, EngineError(f"no engine in rotation for {self._timeout:g}s"))

    def _supervise(self) -> None:
        while not self._stopping.wait(0.2):
            for m in self._members:
                if self._stopping.is_set():
                    return
                local = m.local
                if local is None or local.alive() or time.monotonic() < m.retry_at:
                    continue
                with self._lock:
                    gen = m.gen
                code = None if local.proc is None else local.proc.returncode
                self._take_out(m, gen, f"process exited ({code})")
                self._restart(m, local)

    def _restart(self, member: Member, local: Process) -> None:
        with self._lock:
            if self._closed:
                return
            member.state, member.gen = RESTARTING, member.gen + 1
            old, gen = member.engine, member.gen
        old.close()
        local.reset()
        try:
            url = local.start(self._startup, self._stopping)
            engine = self._make(url, **self._engine_kw)
        except (EngineError, OSError, ValueError) as exc:
            with self._lock:
                member.state, member.reason = OUT, f"restart failed: {exc}"
                member.backoff = min(BACKOFF_MAX, member.backoff * 2)
                member.retry_at = time.monotonic() + member.backoff
            local.reset()
            return
        with self._lock:
            if self._closed:
                engine.close()
                return
            member.engine, member.restarts = engine, member.restarts + 1
            member.confirmed = member.pushed = -1
            member.state, member.reason = OUT, "restarted; not yet at the fleet's version"
        log.warning("fleet: restarted %s (pid %s)", url, local.proc and local.proc.pid)
        try:
            self._check_model(engine)
        except ValueError as exc:
            with self._lock:
                member.reason = str(exc)
                member.retry_at = float("inf")
            return
        member.retry_at = 0.0
        self._bring_up(member, gen)  # else the health thread tries again, with a backoff
