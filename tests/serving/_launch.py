"""Start and stop real ``dew serve`` processes for tests (shared by server and client tests).

``launch(*args)`` runs ``python -m dew.serve ARGS --host 127.0.0.1 --port 0``,
reads the port from its one stdout line, waits on ``/health`` with a deadline and
returns a :class:`Served`; ``served.stop()`` (or leaving ``serve(...)``) sends SIGTERM
to that pid and SIGKILL after a grace period. Only the process started here is touched.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import httpx

START_DEADLINE = 120.0  # seconds: import torch + load a model on a busy machine
STOP_GRACE = 20.0
_PREFIX = "dew serve: listening on "


class Served:
    """One running ``dew serve`` process."""

    def __init__(
        self, proc: subprocess.Popen[str], url: str, api_key: str | None, stderr: IO[str]
    ) -> None:
        self.proc = proc
        self.url = url
        self.api_key = api_key
        self._stderr = stderr
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def headers(self) -> dict[str, str]:
        return {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers(), timeout=timeout)

    def stderr(self) -> str:
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read()

    def stop(self, grace: float = STOP_GRACE) -> int:
        """SIGTERM, then SIGKILL after ``grace`` seconds; returns the exit code."""
        if self.returncode is None:
            self.returncode = _stop(self.proc, grace)
            self._stderr.close()
        return self.returncode


def _stop(proc: subprocess.Popen[str], grace: float) -> int:
    if proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
    return proc.returncode


def command(*args: str) -> list[str]:
    """The argv of ``dew serve ARGS`` as a subprocess of this interpreter."""
    return [sys.executable, "-m", "dew.serve", *args]


def launch(
    *args: str,
    api_key: str | None = None,
    env: dict[str, str] | None = None,
    deadline: float = START_DEADLINE,
) -> Served:
    """Start ``dew serve ARGS`` on 127.0.0.1, port 0; return once ``/health`` answers."""
    full = [*args, "--host", "127.0.0.1", "--port", "0"]
    if api_key is not None:
        full += ["--api-key", api_key]
    environ = {k: v for k, v in os.environ.items() if k != "DEW_API_KEY"}
    environ.update(env or {})
    stderr = tempfile.TemporaryFile("w+")  # a file, so a chatty server never blocks on a pipe
    proc = subprocess.Popen(
        command(*full), stdout=subprocess.PIPE, stderr=stderr, text=True, env=environ
    )
    try:
        lines: queue.Queue[str] = queue.Queue()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)

        threading.Thread(target=pump, daemon=True).start()
        end = time.monotonic() + deadline
        url = None
        while url is None:
            if proc.poll() is not None and lines.empty():
                raise RuntimeError(f"dew serve exited with {proc.returncode}: {_tail(stderr)}")
            try:
                line = lines.get(timeout=max(0.0, min(0.5, end - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > end:
                    raise RuntimeError(
                        f"dew serve did not listen in time: {_tail(stderr)}"
                    ) from None
                continue
            if line.startswith(_PREFIX):
                url = line[len(_PREFIX) :].strip()
        served = Served(proc, url, api_key, stderr)
        with httpx.Client(base_url=url, timeout=5.0) as client:
            while True:
                try:
                    if client.get("/health").status_code == 200:
                        return served
                except httpx.TransportError:
                    pass
                if time.monotonic() > end:
                    raise RuntimeError(f"/health did not answer in time: {_tail(stderr)}")
                time.sleep(0.05)
    except BaseException:
        _stop(proc, STOP_GRACE)
        stderr.close()
        raise


def _tail(stderr: IO[str]) -> str:
    stderr.flush()
    stderr.seek(0)
    return stderr.read()[-4000:]


@contextmanager
def serve(*args: str, api_key: str | None = None, **kw: object) -> Iterator[Served]:
    """``launch`` in a ``with``: the process is stopped on the way out, however it ends."""
    served = launch(*args, api_key=api_key, **kw)  # type: ignore[arg-type]
    try:
        yield served
    finally:
        served.stop()


def run_once(args: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 120.0):
    """Run ``dew serve ARGS`` to its end (for refusals); returns the CompletedProcess."""
    environ = {k: v for k, v in os.environ.items() if k != "DEW_API_KEY"}
    environ.update(env or {})
    return subprocess.run(
        command(*args), capture_output=True, text=True, env=environ, timeout=timeout, check=False
    )


def rss_kib(pid: int) -> int:
    """The resident memory of process ``pid``, KiB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")
