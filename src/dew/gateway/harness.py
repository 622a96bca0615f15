"""HarnessSource: one run of an unmodified agent harness per rollout, through the gateway.

A harness is either a Python callable ``harness(task, endpoint)`` (run on the
source's worker thread; ``endpoint`` gives the base URL, the session's key, the
model name, a ready ``openai.OpenAI`` client and a ``stop`` event) or a command
(``list[str]``) run as a subprocess in its own process group with
``OPENAI_BASE_URL`` (and the legacy ``OPENAI_API_BASE``), ``OPENAI_API_KEY``,
``DEW_MODEL``, ``DEW_TASK`` (the task as JSON, ``{"id": ..., "data": {...}}``,
when it is under 64 KiB) and ``DEW_TASK_FILE`` (a file holding the same JSON) set.
The subprocess's stdin is empty; its stdout and stderr are kept (their last
``max_output_bytes``) for the verifier and the error text.

The verifier, ``verifier(task, outcome) -> float | Mapping[str, float]``, decides
every score; a mapping is the reward's components and the reward is their sum.
How a run ends:

* cancelled (or the source closed): ``CANCELLED``, never scored;
* the gateway failed while serving it, the harness could not be launched, or it
  made no model call: ``INFRA_ERROR``;
* a session limit cut it (turns, token budget, context) or it ran past
  ``timeout``: ``TRUNCATED`` with that cause, scored;
* the harness raised or exited non-zero: ``AGENT_ERROR``, scored, error text kept;
* otherwise ``COMPLETED``, scored. A verifier that raises or returns something
  other than finite numbers turns any of the scored endings into ``INFRA_ERROR``.

Invariants: each run owns one gateway session (opened first, collected last) and
one watcher thread, joined before the run returns. The watcher sleeps on one event
that a cancel, the source's close or the harness's end sets, or until the timeout;
when it stops a harness it aborts the session (so in-flight generation stops and
further requests get 410), sets ``endpoint.stop``, and for a subprocess sends
SIGTERM to its process group, then SIGKILL after ``grace`` seconds. A callable
harness cannot be killed: it is expected to return once its requests fail, and the
run waits for it. With ``processes=N`` a callable harness runs in one of N harness
processes (:mod:`dew.gateway._workers`); the watcher's stop reaches it there as a
message that sets its ``endpoint.stop``, and the run waits for its answer, which a
process that dies gives too.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

from dew.core import (
    Call,
    Rollout,
    RolloutKey,
    Session,
    Status,
    Task,
    ThreadedSource,
    as_int,
    cancelled_rollout,
    error_text,
    parse_reward,
)
from dew.gateway._endpoint import Answer, HarnessEndpoint, ThreadClients, run_harness
from dew.gateway._workers import HarnessProcesses

if TYPE_CHECKING:
    from dew.gateway.recording import RecordingGateway

__all__ = ["Harness", "HarnessEndpoint", "HarnessOutcome", "HarnessSource", "HarnessVerifier"]

_TASK_ENV_LIMIT = 64 << 10


@dataclass(frozen=True)
class HarnessOutcome:
    """What the verifier sees of one harness run.

    ``value`` is what a callable harness returned; ``returncode``, ``stdout`` and
    ``stderr`` describe a subprocess. ``error`` is the harness's failure (exception
    or non-zero exit), ``truncation`` the limit that cut it, if any.
    """

    task: Task
    calls: tuple[Call, ...]
    value: Any = None
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    error: str | None = None
    truncation: str | None = None


Harness = Callable[[Task, HarnessEndpoint], Any] | Sequence[str]
HarnessVerifier = Callable[[Task, HarnessOutcome], float | Mapping[str, float]]


class _HarnessSession:
    """The worker session, whose ``cancel`` also wakes the run's watcher."""

    def __init__(self, inner: Session, wake: threading.Event) -> None:
        self._inner = inner
        self._wake = wake

    def cancel(self) -> None:
        self._inner.cancel()
        self._wake.set()

    def done(self) -> bool:
        return self._inner.done()

    def result(self, timeout: float | None = None) -> Rollout:
        return self._inner.result(timeout)

    def add_done_callback(self, fn: Callable[[Session], None]) -> None:
        self._inner.add_done_callback(lambda _s: fn(self))


@dataclass
class _Run:
    """State a run shares with its watcher (``lock`` guards ``halted`` and ``proc``)."""

    wake: threading.Event
    halt: threading.Event = field(default_factory=threading.Event)
    exited: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    halted: str | None = None  # why the watcher stopped the harness
    finished: bool = False
    proc: subprocess.Popen[bytes] | None = None
    remote: Callable[[], None] | None = None  # stops a run in a harness process


def _tail(f: IO[bytes], limit: int) -> str:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(0, size - limit))
    data = f.read()
    text = data.decode("utf-8", errors="replace")
    return text if size <= limit else f"[... {size - limit} bytes cut]\n{text}"


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def _outcome(task: Task, answer: Answer) -> tuple[HarnessOutcome, bool]:
    """The outcome (without calls) of a callable harness's run, and whether it ran."""
    kind, payload = answer
    if kind == "value":
        return HarnessOutcome(task, (), value=payload), True
    if kind == "exit":
        code, shown = payload
        error = None if code == 0 else f"harness exited with status {shown}"
        return HarnessOutcome(task, (), returncode=code, error=error), True
    if kind == "raised":
        return HarnessOutcome(task, (), error=f"harness raised {payload}"), True
    return HarnessOutcome(task, (), error=payload), False  # its process died: infrastructure


class HarnessSource(ThreadedSource):
    """Rollouts from an agent harness talking to a :class:`RecordingGateway`.

    ``harness``: a callable ``harness(task, endpoint)`` or a command (``list[str]``).
    ``verifier(task, outcome)`` scores each run. ``tasks``, when given, maps a task
    id to the full task the harness and verifier see (the scheduler's tasks carry
    only ids); an id it lacks raises ``ValueError``. ``timeout`` bounds one run's wall
    clock (then it is stopped and TRUNCATED with ``"wall_clock"``); ``grace`` is how
    long a stopped subprocess has between SIGTERM and SIGKILL. ``env`` adds
    variables to a subprocess's environment, ``cwd`` sets its directory.
    ``processes``: run a callable harness in that many long-lived processes of its
    own instead of on the source's threads (0, the default), so that the ``openai``
    client's CPU does not share this process's interpreter lock with the engine, the
    gateway and the trainer; the harness and what it returns must then be picklable,
    and a process that dies turns its runs into ``INFRA_ERROR`` (it is started again
    for the next run).
    """

    def __init__(
        self,
        gateway: RecordingGateway,
        harness: Harness,
        verifier: HarnessVerifier,
        *,
        tasks: Mapping[str, Task] | None = None,
        workers: int = 8,
        grace: float = 5.0,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        max_output_bytes: int = 1 << 20,
        processes: int = 0,
    ) -> None:
        processes = as_int(processes, "processes", minimum=0)
        if processes and not callable(harness):
            raise ValueError(
                f"processes={processes}: only a callable harness runs in harness processes "
                "(a command already runs in a process of its own)"
            )
        if not callable(harness):
            if isinstance(harness, (str, bytes)) or not isinstance(harness, Sequence):
                raise ValueError(
                    f"harness must be a callable or a command list[str], got {harness!r}"
                )
            if not harness or not all(isinstance(a, str) for a in harness):
                raise ValueError(
                    f"harness command must be a non-empty list of str, got {harness!r}"
                )
        if not callable(verifier):
            raise ValueError(f"verifier must be callable, got {verifier!r}")
        if not (grace >= 0 and math.isfinite(grace)):
            raise ValueError(f"grace must be >= 0 and finite, got {grace}")
        if timeout is not None and not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"timeout must be positive and finite or None, got {timeout}")
        if max_output_bytes < 0:
            raise ValueError(f"max_output_bytes must be >= 0, got {max_output_bytes}")
        if callable(harness) and not processes:
            # A callable harness talks through ``openai``: import it now, once, rather
            # than in the first rollouts, where every worker would wait on the import
            # lock for the second it takes.
            import openai  # noqa: F401
        self._procs = HarnessProcesses(harness, processes, grace=grace) if processes else None
        try:
            super().__init__(workers=workers)
        except BaseException:
            if self._procs is not None:
                self._procs.close()
            raise
        self.gateway = gateway
        self.harness = harness if callable(harness) else list(harness)
        self.verifier = verifier
        self.grace = grace
        self.timeout = timeout
        self.env = dict(env or {})
        self.cwd = cwd
        self.max_output_bytes = max_output_bytes
        self.tasks = tasks
        # One HTTP client per worker thread, built on its first callable run and shut
        # down by close(): no lock or connection pool is shared by the sessions.
        self._http = ThreadClients()
        self._wake_lock = threading.Lock()
        self._wakes: dict[int, tuple[threading.Event, threading.Event]] = {}
        self._closing = False

    # ------------------------------------------------------------------ waking

    def _wake_for(self, stop: threading.Event) -> threading.Event:
        # Keyed by the stop event's id; the entry holds the event, so the id stays unique.
        with self._wake_lock:
            entry = self._wakes.get(id(stop))
            if entry is None:
                entry = self._wakes[id(stop)] = (stop, threading.Event())
                if self._closing:
                    entry[1].set()
            return entry[1]

    def _drop_wake(self, stop: threading.Event) -> None:
        with self._wake_lock:
            self._wakes.pop(id(stop), None)

    def start(self, task: Task, key: RolloutKey) -> Session:
        inner = super().start(task, key)
        stop = inner.stop  # type: ignore[attr-defined]
        wake = self._wake_for(stop)
        inner.add_done_callback(lambda _s: self._drop_wake(stop))
        return _HarnessSession(inner, wake)

    def close(self) -> None:
        """Stop every running harness, then close the worker pool (the gateway stays up)."""
        with self._wake_lock:
            self._closing = True
            wakes = [w for _, w in self._wakes.values()]
        for w in wakes:
            w.set()
        super().close()
        if self._procs is not None:  # after the runs: none is waiting on a process
            self._procs.close()
        self._http.shutdown()

    def _http_client(self) -> Any:
        """This worker thread's HTTP client (``None`` when the harness runs elsewhere)."""
        if not callable(self.harness) or self._procs is not None:
            return None
        return self._http.get()

    def _resolve(self, task: Task, key: RolloutKey) -> Task:
        if self.tasks is None:
            return task
        try:
            return self.tasks[task.id]
        except KeyError:
            raise ValueError(f"{key}: task id {task.id!r} is not in this source's tasks") from None

    # ------------------------------------------------------------------ one run

    def run(self, task: Task, key: RolloutKey, stop: threading.Event) -> Rollout:
        state = _Run(self._wake_for(stop))
        task = self._resolve(task, key)  # same id; the data the harness needs
        try:
            token = self.gateway.open(task, key)
            endpoint = HarnessEndpoint(
                self.gateway.base_url,
                token,
                self.gateway.model_name,
                state.halt,
                self._http_client(),
            )
        except Exception as exc:  # the gateway is down or closed: nothing ran
            return Rollout(
                key,
                task,
                Status.INFRA_ERROR,
                error=f"cannot open a gateway session: {error_text(exc)}",
            )
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        watcher = threading.Thread(
            target=self._watch,
            args=(state, stop, token, deadline),
            name=f"dew-harness-watch-{key.group}-{key.sample}",
        )
        watcher.start()
        try:
            outcome, launched = self._launch(task, endpoint, state)
        finally:
            with state.lock:
                state.finished = True
            state.wake.set()
            watcher.join()
        recording = self.gateway.close_session(token)
        return self._conclude(
            key,
            task,
            stop,
            state,
            recording.calls,
            recording.truncation,
            recording.error,
            outcome,
            launched,
        )

    def _watch(
        self, state: _Run, stop: threading.Event, token: str, deadline: float | None
    ) -> None:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        woken = state.wake.wait(remaining)
        with state.lock:
            if state.finished:
                return
            state.halted = (
                "cancelled" if (stop.is_set() or self._closing or woken) else "wall_clock"
            )
            proc, remote = state.proc, state.remote
        state.halt.set()
        if remote is not None:
            remote()  # the harness process sets the run's endpoint.stop
        try:
            self.gateway.abort(token)
        except ValueError:
            pass  # the session is already gone
        if proc is not None:
            _signal_group(proc, signal.SIGTERM)
            if not state.exited.wait(self.grace):
                _signal_group(proc, signal.SIGKILL)

    def _launch(
        self, task: Task, endpoint: HarnessEndpoint, state: _Run
    ) -> tuple[HarnessOutcome | None, bool]:
        """Run the harness; returns (outcome without calls, whether it ever started)."""
        if self._procs is not None:
            return self._remote(task, endpoint, state)
        if callable(self.harness):
            return self._call(task, endpoint, state)
        return self._spawn(task, endpoint, state)

    def _remote(
        self, task: Task, endpoint: HarnessEndpoint, state: _Run
    ) -> tuple[HarnessOutcome | None, bool]:
        assert self._procs is not None
        with state.lock:
            if state.halted:
                return None, False
            try:
                run = self._procs.submit(task, endpoint.base_url, endpoint.api_key, endpoint.model)
            except RuntimeError:  # closed: the source is closing
                return None, False
            state.remote = run.stop
        # Like a callable on this thread, a run is waited for until it returns; a stop
        # reaches it through the watcher, and a process that dies answers "died".
        return _outcome(task, run.future.result())

    def _call(
        self, task: Task, endpoint: HarnessEndpoint, state: _Run
    ) -> tuple[HarnessOutcome | None, bool]:
        with state.lock:
            if state.halted:
                return None, False
        assert callable(self.harness)
        return _outcome(task, run_harness(self.harness, task, endpoint))

    def _environment(self, task: Task, endpoint: HarnessEndpoint, task_file: str) -> dict[str, str]:
        env = {**os.environ, **self.env}
        payload = json.dumps({"id": task.id, "data": dict(task.data)})
        env.update(
            {
                "OPENAI_BASE_URL": endpoint.base_url,
                "OPENAI_API_BASE": endpoint.base_url,
                "OPENAI_API_KEY": endpoint.api_key,
                "DEW_MODEL": endpoint.model,
                "DEW_TASK_FILE": task_file,
            }
        )
        if len(payload) <= _TASK_ENV_LIMIT:
            env["DEW_TASK"] = payload
        else:
            env.pop("DEW_TASK", None)
        return env

    def _spawn(
        self, task: Task, endpoint: HarnessEndpoint, state: _Run
    ) -> tuple[HarnessOutcome | None, bool]:
        assert not callable(self.harness)
        with (
            tempfile.TemporaryDirectory(prefix="dew-harness-") as tmp,
            open(os.path.join(tmp, "stdout"), "w+b") as out,
            open(os.path.join(tmp, "stderr"), "w+b") as err,
        ):
            task_file = os.path.join(tmp, "task.json")
            try:
                with open(task_file, "w") as f:
                    json.dump({"id": task.id, "data": dict(task.data)}, f)
                env = self._environment(task, endpoint, task_file)
            except (TypeError, ValueError) as exc:
                return HarnessOutcome(task, (), error=f"task is not JSON: {exc}"), False
            with state.lock:
                if state.halted:
                    return None, False
                try:
                    state.proc = subprocess.Popen(
                        self.harness,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=err,
                        env=env,
                        cwd=self.cwd,
                        start_new_session=True,
                    )
                except OSError as exc:
                    return HarnessOutcome(
                        task, (), error=f"cannot launch {self.harness[0]!r}: {exc}"
                    ), False
            proc = state.proc
            try:
                # Wait for the exit without reaping: while the harness is a zombie its
                # pid (= its process group id) cannot be reused, so the group kill
                # below reaches only what the harness left behind.
                try:
                    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
                except ChildProcessError:
                    pass
                _signal_group(proc, signal.SIGKILL)
            finally:
                code = proc.wait()
                state.exited.set()
            stdout = _tail(out, self.max_output_bytes)
            stderr = _tail(err, self.max_output_bytes)
        error = None
        if code != 0:
            how = f"signal {-code}" if code < 0 else f"status {code}"
            error = f"harness exited with {how}: {stderr[-2000:]}"
        return HarnessOutcome(
            task, (), returncode=code, stdout=stdout, stderr=stderr, error=error
        ), True

    # ------------------------------------------------------------------ verdict

    def _conclude(
        self,
        key: RolloutKey,
        task: Task,
        stop: threading.Event,
        state: _Run,
        calls: tuple[Call, ...],
        truncation: str | None,
        gateway_error: str | None,
        outcome: HarnessOutcome | None,
        launched: bool,
    ) -> Rollout:
        harness_error = outcome.error if outcome is not None else None
        if stop.is_set() or self._closing or state.halted == "cancelled":
            return cancelled_rollout(task, key, calls)
        if gateway_error is not None:
            return Rollout(key, task, Status.INFRA_ERROR, calls, error=f"gateway: {gateway_error}")
        if not launched or outcome is None:
            return Rollout(
                key, task, Status.INFRA_ERROR, calls, error=harness_error or "the harness never ran"
            )
        if not calls:
            detail = f": {harness_error}" if harness_error else ""
            return Rollout(
                key, task, Status.INFRA_ERROR, error=f"the harness made no model call{detail}"
            )
        if state.halted == "wall_clock":
            truncation = truncation or "wall_clock"
        full = HarnessOutcome(
            task,
            calls,
            outcome.value,
            outcome.returncode,
            outcome.stdout,
            outcome.stderr,
            harness_error,
            truncation,
        )
        try:
            score = self.verifier(task, full)
            reward, components = parse_reward(score)
        except Exception as exc:
            return Rollout(
                key,
                task,
                Status.INFRA_ERROR,
                calls,
                error=f"verifier failed: {error_text(exc)}",
            )
        status = (
            Status.TRUNCATED
            if truncation
            else Status.AGENT_ERROR
            if harness_error
            else Status.COMPLETED
        )
        return Rollout(
            key,
            task,
            status,
            calls,
            reward=reward,
            components=components,
            truncation=truncation,
            error=harness_error,
        )
