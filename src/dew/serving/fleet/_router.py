"""sglang-router in front of a fleet: start one, and keep its worker list in step.

sglang-router (``pip install sglang-router``; the ``router`` extra) relays SGLang's
``/generate`` to its workers with its own policy (``cache_aware`` by default: requests
whose prompts share a prefix go where that prefix was computed). It does not relay
``/abort_request`` and knows nothing of weight versions, so a fleet behind it still
talks to each worker directly: it pushes weights to every worker, sends aborts to every
worker, and uses the router's worker API (``GET /workers``, ``POST /workers``,
``DELETE /workers/{id}``; each change is applied in the background, so both calls here
wait until the list shows it) to take a worker out of rotation and bring it back.

Threads: none. :class:`RouterAdmin` is called from the fleet's threads under its
publish lock or from a take-out; its httpx client is thread-safe.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import IO, Any

import httpx

from dew._watchdog import unwatch, watch
from dew.core import EngineError
from dew.serving.fleet._parts import terminate

POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")


class RouterAdmin:
    """The worker list of the sglang-router at ``url``."""

    def __init__(self, url: str, *, api_key: str | None, timeout: float) -> None:
        headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        self.url = url.rstrip("/")
        self._timeout = timeout
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def workers(self) -> dict[str, dict[str, Any]]:
        """Worker URL -> the router's record of it (``id``, ``is_healthy``, ...)."""
        try:
            response = self._client.get("/workers")
            response.raise_for_status()
            listed = response.json()["workers"]
            return {str(w["url"]).rstrip("/"): w for w in listed}
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise EngineError(f"{self.url}/workers: {exc!r}") from None

    def remove(self, url: str) -> None:
        """Take ``url`` off the router's list; returns once it is gone."""
        url = url.rstrip("/")
        record = self.workers().get(url)
        if record is None:
            return
        try:
            self._client.delete(f"/workers/{record['id']}").raise_for_status()
        except httpx.HTTPError as exc:
            raise EngineError(f"{self.url}: cannot remove {url}: {exc!r}") from None
        self._until(lambda listed: url not in listed, f"{url} to leave its list")

    def add(self, url: str) -> None:
        """Put ``url`` on the router's list; returns once the router finds it healthy."""
        url = url.rstrip("/")
        if url not in self.workers():
            try:
                self._client.post("/workers", json={"url": url}).raise_for_status()
            except httpx.HTTPError as exc:
                raise EngineError(f"{self.url}: cannot add {url}: {exc!r}") from None
        self._until(
            lambda listed: bool(listed.get(url, {}).get("is_healthy")), f"{url} to join healthy"
        )

    def _until(self, done: Any, what: str) -> None:
        deadline = time.monotonic() + self._timeout
        while not done(self.workers()):
            if time.monotonic() > deadline:
                raise EngineError(f"{self.url}: waited {self._timeout:g}s for {what}")
            time.sleep(0.05)

    def close(self) -> None:
        self._client.close()


class RouterProcess:
    """An sglang-router process on 127.0.0.1 started for a launched fleet."""

    def __init__(self, workers: Sequence[str], *, policy: str, args: Sequence[str] = ()) -> None:
        if policy not in POLICIES:
            raise ValueError(f"router policy must be one of {POLICIES}, got {policy!r}")
        self.workers = [w.rstrip("/") for w in workers]
        self.policy = policy
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self._log: IO[bytes] | None = None
        self._dog: subprocess.Popen[bytes] | None = None  # ends it if this process dies

    def start(self, deadline: float) -> str:
        """Start it on a free port; return its URL once every worker is listed healthy.
        (It takes no port 0, so a port is picked first; a port taken meanwhile makes it
        exit, and another is tried.)"""
        end = time.monotonic() + deadline
        for _ in range(3):
            port = _free_port()
            if self._log is not None:
                self._log.close()  # the last try's, whose process exited
            self._log = tempfile.TemporaryFile()
            argv = [sys.executable, "-m", "sglang_router.launch_router"]
            argv += ["--host", "127.0.0.1", "--port", str(port), "--policy", self.policy]
            argv += ["--worker-urls", *self.workers, "--log-level", "warn"]
            argv += ["--shutdown-grace-period-secs", "5", *self.args]
            self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)
            unwatch(self._dog)
            self._dog = watch(self.proc.pid, group=False)
            self.url = f"http://127.0.0.1:{port}"
            admin = RouterAdmin(self.url, api_key=None, timeout=5.0)
            try:
                while self.proc.poll() is None and time.monotonic() < end:
                    with contextlib.suppress(EngineError):
                        listed = admin.workers()
                        if all(listed.get(w, {}).get("is_healthy") for w in self.workers):
                            return self.url
                    time.sleep(0.1)
            finally:
                admin.close()
            if self.proc.poll() is None:  # still running: out of time
                break
        tail = self.tail()
        self.stop(0.0)
        raise EngineError(f"sglang-router did not come up with its workers: {tail}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self) -> str:
        if self._log is None or self._log.closed:
            return ""
        self._log.seek(0)
        return self._log.read()[-2000:].decode(errors="replace")

    def stop(self, grace: float) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; only this pid."""
        if self.proc is not None:
            terminate(self.proc, grace)
        unwatch(self._dog)
        self._dog = None
        if self._log is not None:
            self._log.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
