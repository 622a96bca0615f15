"""The fleet's records: members, calls, futures, local server processes, member kinds."""

from __future__ import annotations

import contextlib
import importlib
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from dew._watchdog import unwatch, watch
from dew.core import Call, EngineError, SamplingParams
from dew.serving._http_base import LoopEngine

PREFIX = "dew serve: listening on "
UP, OUT, RESTARTING, CLOSED = "up", "out", "restarting", "closed"
BACKOFF_MAX = 30.0


# The engine a member speaks through, by the kind of server it runs: (module, class).
ENGINES = {
    "dew": ("dew.serving.http_engine", "HTTPEngine"),
    "vllm": ("dew.serving.vllm", "VLLMEngine"),
}


def member_class(kind: str) -> Any:
    """The engine class of members of ``kind`` (a key of :data:`ENGINES`)."""
    module, name = ENGINES[kind]
    return getattr(importlib.import_module(module), name)


def local_processes(
    engine: str,
    count: int,
    *,
    demo: str | None,
    model: str | os.PathLike[str] | None,
    seed: int,
    args: Sequence[str],
    env: Mapping[str, str] | None,
    python: str | os.PathLike[str] | None,
    router: str | None,
    weights_dir: str | os.PathLike[str],
    devices: Sequence[str] | None = None,
    host: str = "127.0.0.1",
) -> list[Process]:
    """The ``count`` local servers :meth:`EngineFleet.launch` starts (its docstring),
    whose weight pushes read only ``weights_dir``, each on its own of ``devices``,
    listening on ``host``."""
    if devices is not None and (
        isinstance(devices, str)
        or len(devices) != count
        or not all(isinstance(d, str) and d for d in devices)
    ):
        raise ValueError(f"devices must name one device per engine ({count}), got {devices!r}")
    places: list[str | None] = [None] * count if devices is None else list(devices)
    if engine == "vllm":
        if model is None or router is not None:
            raise ValueError("engine='vllm' serves a model folder (model=), with no router")
        from dew.serving.vllm import VLLMProcess, vllm_python

        interpreter = vllm_python(python)
        vllm_args = [*args, "--seed", str(seed)]
        return [
            VLLMProcess(
                interpreter,
                model,
                weights_dir=weights_dir,
                args=vllm_args,
                env=_gpu(env, d),
                host=host,
            )
            for d in places
        ]
    what = ["--demo", str(demo)] if demo is not None else ["--model", str(model)]
    argv = [sys.executable, "-m", "dew.serve", *what, "--seed", str(seed)]
    argv += ["--weights-dir", str(weights_dir), *args, "--host", host, "--port", "0"]
    environ = None if env is None else {**os.environ, **env}
    return [Local([*argv, *(["--device", d] if d else [])], environ) for d in places]


def _gpu(env: Mapping[str, str] | None, device: str | None) -> Mapping[str, str] | None:
    """``env`` for a vLLM server on ``device``: vLLM takes the first GPU it sees, so a
    ``cuda:N`` is the only one it is shown (``cpu`` or a bare ``cuda``: as it is)."""
    kind, _, index = (device or "").partition(":")
    if kind != "cuda" or not index:
        return env
    return {**(env or {}), "CUDA_VISIBLE_DEVICES": index}


class Process(Protocol):
    """A server process the fleet supervises: ``dew serve`` (:class:`Local`), vLLM
    (:class:`dew.serving.vllm.VLLMProcess`), or either under a Ray actor
    (:class:`dew.serving.fleet._ray.RayProcess`)."""

    proc: subprocess.Popen[bytes] | None

    def alive(self) -> bool: ...

    def start(self, deadline: float, stopping: threading.Event) -> str: ...

    def stop(self, grace: float) -> None: ...

    def reset(self) -> None:
        """Clear what a process that died left behind, before ``start`` runs it again
        (a local one: stop it; one under a Ray actor: its server only, the actor stays)."""

    def tail(self) -> str: ...


@dataclass(frozen=True)
class MemberInfo:
    """A snapshot of one member: ``state`` is ``up`` (in rotation), ``out``,
    ``restarting`` or ``closed``; ``version`` the version the fleet confirmed it serves
    (-1: none yet); ``reason`` why it is out; ``suspect``: a call just failed there and
    a health check is deciding whether it is out (no new call goes there meanwhile,
    while another member is up); ``held_by`` the trainer run its server says holds it
    (None: none, or the server does not say); ``pid`` the server's pid (on ``node``,
    for a fleet placed by Ray)."""

    url: str
    state: str
    version: int
    in_flight: int
    dispatched: int
    pid: int | None
    restarts: int
    reason: str
    suspect: bool
    held_by: str | None = None
    node: str | None = None  # the Ray node its server runs on (None: this machine's)
    actor: str | None = None  # its Ray actor's name, in the namespace "dew"


class Local:
    """One ``dew serve`` process started by the fleet (same argv on every restart)."""

    def __init__(self, argv: list[str], env: dict[str, str] | None) -> None:
        self.argv = argv
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.stderr: IO[bytes] | None = None
        self.dog: subprocess.Popen[bytes] | None = None  # ends it if this process dies

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, deadline: float, stopping: threading.Event) -> str:
        """Start the process and return its URL once it printed the listening line."""
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=self.stderr, env=self.env
        )
        unwatch(self.dog)
        self.dog = watch(self.proc.pid, group=False)
        assert self.proc.stdout is not None
        buffer = b""
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            end = time.monotonic() + deadline
            prefix = PREFIX.encode()
            while prefix not in buffer or b"\n" not in buffer.split(prefix, 1)[1]:
                if stopping.is_set() or time.monotonic() > end:
                    said = self.tail()  # before stop() lets the file go
                    self.stop(0.0)
                    raise EngineError(f"dew serve did not listen in time: {said}")
                if sel.select(0.2):
                    chunk = os.read(self.proc.stdout.fileno(), 4096)
                    if not chunk:
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            self.proc.wait(5.0)  # its last words are in the file once it ends
                        said = self.tail()
                        self.stop(0.0)
                        raise EngineError(f"dew serve exited: {said.strip()}")
                    buffer += chunk
        line = buffer.decode().split(PREFIX, 1)[1]
        return line.splitlines()[0].strip()

    def tail(self) -> str:
        if self.stderr is None or self.stderr.closed:
            return ""
        self.stderr.seek(0)
        return self.stderr.read()[-2000:].decode(errors="replace")

    def reset(self) -> None:
        self.stop(0.0)

    def stop(self, grace: float) -> None:
        """SIGTERM (and SIGCONT, so a stopped process can take it), SIGKILL after
        ``grace`` seconds; only this pid."""
        proc = self.proc
        if proc is not None:
            terminate(proc, grace)
            if proc.stdout is not None:
                proc.stdout.close()
        unwatch(self.dog)
        self.dog = None
        if self.stderr is not None:
            self.stderr.close()


def terminate(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM (and SIGCONT, so a stopped process can take it) to ``proc``'s pid, then
    SIGKILL after ``grace`` seconds; returns once it exited."""
    if proc.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGCONT):
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


@dataclass(eq=False)
class Member:
    engine: LoopEngine
    local: Process | None
    state: str = UP
    calls: dict[FleetCall, None] = field(default_factory=dict)
    dispatched: int = 0
    restarts: int = 0
    failures: int = 0  # consecutive failed health checks
    confirmed: int = -1  # the version the fleet knows it serves (-1 while out)
    pushed: int = -1  # the newest version this process took from the fleet (or had)
    reason: str = ""
    gen: int = 0  # bumped on every take-out and restart: fences stale work
    retry_at: float = 0.0  # monotonic time of the next bring-up or restart attempt
    backoff: float = 0.5
    # A request failed on it: no new call goes to it while another member is up, until
    # a health check clears it (or takes it out).
    suspect: bool = False


@dataclass(eq=False)
class FleetCall:
    prompt: list[int]
    params: SamplingParams
    stop: threading.Event | None
    affinity: Hashable | None
    outer: FleetFuture
    deadline: float
    member: Member | None = None
    inner: Future[Call] | None = None
    abort: bool = False


class FleetFuture(Future[Call]):
    def __init__(self, owner: object) -> None:
        super().__init__()
        self.owner = owner
        self.call: FleetCall | None = None


def stopped(call: FleetCall) -> bool:
    return call.abort or (call.stop is not None and call.stop.is_set())


def settle(future: Future[Call], outcome: Call | BaseException) -> None:
    with contextlib.suppress(Exception):  # InvalidStateError: someone resolved it first
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
