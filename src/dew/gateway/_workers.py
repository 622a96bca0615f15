"""Long-lived processes that run a callable harness, for ``HarnessSource(processes=N)``.

A harness's own work (the ``openai`` client building, sending and parsing each
request) costs a millisecond or two of CPU per call. Run on the source's worker
threads, it holds the interpreter lock that the engine thread, the gateway and the
trainer need too; in processes of their own, it runs beside them. Each process is
started once (``spawn``: never a fork of a process with threads) and runs any number
of harness runs at once, each on a thread of its own that keeps its HTTP connection
from one run to the next.

Messages (pickled over one pipe per process): the parent sends ``("run", rid, task,
base_url, api_key, model)``, ``("stop", rid)`` and ``("close",)``; a process answers
``("done", rid, kind, payload)`` once per run, ``(kind, payload)`` being the run's
:data:`~dew.gateway._endpoint.Answer` (a value that cannot be pickled back is
``"raised"``). A
process first sends ``("ready",)`` once its imports are done and the harness is
unpickled; the constructor waits for every process to say so (or to die: then it
raises, since the harness cannot be run there).

Invariants:

* every run :meth:`HarnessProcesses.submit` returns resolves exactly once: to the
  process's answer, or to ``("died", text)`` when its process exits first, also
  when :meth:`close` stops it (the reader thread sees the pipe close);
* one reader thread per process owns its pipe's receiving end; it fails the runs its
  process still owed once the pipe closes. :meth:`close` stops the processes
  (``close`` message, then SIGKILL after ``grace`` seconds), joins them and every
  reader not yet ended; a process that died is started again by the next
  :meth:`submit` that picks its slot;
* a process whose parent is gone (its pipe closes) stops its runs and exits.
"""

from __future__ import annotations

import multiprocessing
import pickle
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from dew.core import Task
from dew.gateway._endpoint import Answer, HarnessEndpoint, ThreadClients, run_harness

__all__ = ["HarnessProcesses", "RemoteRun"]


@dataclass(eq=False)
class _Proc:
    """One started process: its pipe, its reader and the runs it owes an answer."""

    proc: Any  # multiprocessing.Process
    conn: Connection
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    runs: dict[int, Future[Answer]] = field(default_factory=dict)
    reader: threading.Thread | None = None
    ready: threading.Event = field(default_factory=threading.Event)  # imports done there

    def send(self, message: tuple[Any, ...]) -> bool:
        try:
            with self.send_lock:
                self.conn.send(message)
        except (OSError, ValueError):  # it is gone: its reader fails its runs
            return False
        return True


@dataclass(frozen=True)
class RemoteRun:
    """One run in a harness process: its answer, and how to ask it to stop."""

    future: Future[Answer]
    proc: _Proc
    rid: int

    def stop(self) -> None:
        """Have the process set the run's ``endpoint.stop`` (nothing once it is gone)."""
        self.proc.send(("stop", self.rid))


class HarnessProcesses:
    """``processes`` harness processes; runs go to the one with the fewest in flight."""

    def __init__(
        self,
        harness: Callable[..., Any],
        processes: int,
        *,
        grace: float,
        start_timeout: float = 120.0,
    ) -> None:
        try:
            self._harness = pickle.dumps(harness)
        except Exception as exc:
            raise ValueError(
                f"harness: with processes={processes} it must be picklable (a function "
                f"defined at module level, or an instance of such a class): {exc}"
            ) from None
        self._ctx = multiprocessing.get_context("spawn")
        self._grace = grace
        self._lock = threading.Lock()  # guards the slots, every runs table and _closed
        self._closed = False
        self._next = 0
        self._readers: list[threading.Thread] = []
        with self._lock:
            self._slots = [self._start(i) for i in range(processes)]
        try:
            self._wait_ready(start_timeout)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> None:
        """Until every process has its imports done and the harness unpickled, so that
        the first runs do not wait for a start-up (seconds on a busy machine)."""
        deadline = time.monotonic() + timeout
        for p in self._slots:
            while not p.ready.wait(0.05):
                if not p.proc.is_alive():
                    raise RuntimeError(
                        f"harness process {p.proc.pid} exited (code {p.proc.exitcode}) while "
                        "starting: could it import the harness? (its traceback is on stderr)"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(f"harness process {p.proc.pid} not ready in {timeout:g} s")

    def _start(self, index: int) -> _Proc:
        """Start one process and its reader (lock held)."""
        ours, theirs = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=_process_main, args=(theirs, self._harness), name=f"dew-harness-{index}"
        )
        proc.start()
        theirs.close()  # the child holds its end: EOF here once it exits
        p = _Proc(proc, ours)
        p.reader = threading.Thread(target=self._read, args=(p,), name=f"dew-harness-read-{index}")
        p.reader.start()
        # close() joins the readers not yet ended (an ended one needs no join).
        self._readers = [t for t in self._readers if t.is_alive()] + [p.reader]
        return p

    def pids(self) -> list[int]:
        """The pids of the processes running now."""
        with self._lock:
            return [p.proc.pid for p in self._slots if p.proc.is_alive()]

    def submit(self, task: Task, base_url: str, api_key: str, model: str) -> RemoteRun:
        """Send one run to a process; ``RuntimeError`` once closed."""
        future: Future[Answer] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the harness processes are closed")
            i = min(range(len(self._slots)), key=lambda j: len(self._slots[j].runs))
            if not self._slots[i].proc.is_alive():  # died: its reader fails its runs
                self._slots[i] = self._start(i)
            p = self._slots[i]
            self._next += 1
            rid = self._next
            p.runs[rid] = future
        if not p.send(("run", rid, task, base_url, api_key, model)):
            self._resolve(p, rid, ("died", "the harness process could not be reached"))
        return RemoteRun(future, p, rid)

    def _resolve(self, p: _Proc, rid: int, answer: Answer) -> None:
        with self._lock:
            future = p.runs.pop(rid, None)
        if future is not None:
            future.set_result(answer)

    def _read(self, p: _Proc) -> None:
        while True:
            try:
                message = p.conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "ready":
                p.ready.set()
            else:
                _, rid, kind, payload = message
                self._resolve(p, rid, (kind, payload))
        p.conn.close()
        p.proc.join()  # before the runs are failed: submit then sees it dead
        with self._lock:
            runs = list(p.runs.values())
            p.runs.clear()
        text = f"harness process {p.proc.pid} exited (code {p.proc.exitcode}) during this run"
        for f in runs:
            f.set_result(("died", text))

    def close(self) -> None:
        """Stop every process (``close``, SIGKILL after ``grace``) and join it and every
        reader; runs still in flight resolve to ``("died", ...)``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            procs = list(self._slots)
        for p in procs:
            p.send(("close",))
        for p in procs:
            p.proc.join(self._grace)
            if p.proc.is_alive():
                p.proc.kill()
                p.proc.join()
        for reader in self._readers:
            reader.join()


# ---------------------------------------------------------------------- the process


def _process_main(conn: Connection, harness_bytes: bytes) -> None:
    harness = pickle.loads(harness_bytes)
    import openai  # noqa: F401  (once here, not under the first runs' import lock)

    conn.send(("ready",))

    clients = ThreadClients()
    lock = threading.Lock()  # guards stops
    send_lock = threading.Lock()  # one message at a time on the pipe
    stops: dict[int, threading.Event] = {}

    def send(message: tuple[Any, ...]) -> None:
        with send_lock:
            conn.send(message)

    def one(rid: int, task: Task, base_url: str, api_key: str, model: str) -> None:
        with lock:
            stop = stops[rid]
        answer = run_harness(
            harness, task, HarnessEndpoint(base_url, api_key, model, stop, clients.get())
        )
        with lock:
            stops.pop(rid, None)
        try:
            try:
                send(("done", rid, *answer))  # pickled whole before a byte is written
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                text = f"the harness returned a value that cannot be sent back: {exc}"
                send(("done", rid, "raised", text))
        except (OSError, ValueError):
            pass  # the parent is gone

    pool = ThreadPoolExecutor(max_workers=4096, thread_name_prefix="dew-harness-run")
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break  # the parent is gone
            if message[0] == "run":
                with lock:
                    stops[message[1]] = threading.Event()
                pool.submit(one, *message[1:])
            elif message[0] == "stop":
                with lock:
                    event = stops.get(message[1])
                if event is not None:
                    event.set()
            else:  # close
                break
    finally:
        with lock:
            for event in stops.values():
                event.set()
        pool.shutdown(wait=True)
        clients.shutdown()
        conn.close()
