"""RewardPool: reward functions run in worker processes, every call bounded.

A reward function is the user's code, and a thread cannot be stopped: one that hangs
would hold its thread (and the shutdown that waits on it) forever, and one that calls
``sys.exit`` or ``os._exit`` could end the trainer. So ``dew train`` runs each call in
a worker process of this pool, which can be killed.

Invariants:

* a call scores one task's completions and ends, by its function's ``timeout`` at the
  latest, with a result per completion (as :func:`dew.job.rewards.score_many` gives
  them, computed in the worker) or as a :class:`~dew.job.rewards.RewardError` for the
  whole call naming the function and what happened: it did not return in time (its
  process is killed), raised ``SystemExit``/``KeyboardInterrupt`` (its process is then
  replaced), or its process ended (exit code or signal);
* a worker serves one call at a time and the pool keeps no more workers than calls ran
  at once; a worker whose call did not end with a reply is killed and reaped by the
  caller, never reused;
* ``close()`` kills and reaps every worker, idle or busy, so calls in progress end at
  once with an error; nothing runs after it returns;
* a worker never outlives the trainer: it ends when the pool's lifeline pipe closes,
  which the kernel does when the trainer's process ends, however it ends. Workers
  ignore SIGINT: a Ctrl-C is the trainer's to handle.

Each worker imports the reward modules itself, with the trainer's ``sys.path`` and
working directory. Run as ``python -m dew.job._reward_pool`` it is a worker.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from dew.core import error_text
from dew.job.rewards import Reward, RewardError, load_reward, score_many

__all__ = ["START_TIMEOUT", "RewardPool"]

# Seconds a new worker may take to import the reward modules.
START_TIMEOUT = 120.0


class _Worker:
    """One worker process and the two pipes to it. Requests are written without
    blocking (a stopped worker that reads nothing cannot hold a large one forever), in
    the framing its :class:`~multiprocessing.connection.Connection` reads."""

    def __init__(self, proc: subprocess.Popen[bytes], requests: int, recv: Connection) -> None:
        self.proc = proc
        self.requests = requests  # the write end of its request pipe, non-blocking
        os.set_blocking(requests, False)
        self.recv = recv

    def send(self, message: Any, within: float) -> None:
        """Write ``message``; TimeoutError if the pipe takes it not all ``within`` s;
        pickling errors before anything is written."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(struct.pack("!i", len(data)) + data)
        deadline = time.monotonic() + within
        while view:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [self.requests], [], left)[1]:
                raise TimeoutError
            try:
                view = view[os.write(self.requests, view) :]
            except BlockingIOError:  # writable, but not for this much: wait again
                continue

    def kill(self) -> None:
        """SIGKILL (by its own pid) and reap; then close the pipes."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.requests >= 0:
            os.close(self.requests)
            self.requests = -1
        self.recv.close()

    def ended(self) -> str:
        """How the process ended, once it has (after its pipe closed)."""
        try:
            code = self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            return "its process stopped answering"
        if code < 0:
            try:
                return f"its process was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"its process was killed by signal {-code}"
        return f"its process exited with code {code}"


class RewardPool:
    """Worker processes that run ``rewards`` (see the module docstring)."""

    def __init__(self, rewards: Sequence[Reward]) -> None:
        self.rewards = tuple(rewards)
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()  # in a call, or starting
        self._closed = False
        # Workers read the read end; nobody writes, so it reads EOF once this process
        # (the only holder of the write end, which is not inherited) is gone or closed.
        # Made with the first worker: a pool that never ran holds nothing.
        self._lifeline: tuple[int, int] | None = None

    def score_many(self, index: int, *args: Any) -> list[float | RewardError | None]:
        """``rewards[index]``'s results for one task's completions (the arguments of
        :func:`dew.job.rewards.score_many` after the reward), run in a worker process."""
        reward = self.rewards[index]
        worker = self._take(reward)
        reply: tuple[str, Any] | None = None
        try:
            deadline = time.monotonic() + reward.timeout  # writing the call counts too
            try:
                worker.send((index, args), reward.timeout)
            except TimeoutError:
                raise _late(reward) from None
            except OSError:  # the worker died between calls
                raise self._lost(reward, worker) from None
            except Exception as exc:  # nothing was sent: the inputs did not pickle
                reply = ("error", f"reward {reward.name}: its inputs cannot be sent: {exc}")
                return _value(reply)
            if not worker.recv.poll(max(0.0, deadline - time.monotonic())):
                raise _late(reward)
            try:
                reply = worker.recv.recv()
            except (EOFError, OSError):
                raise self._lost(reward, worker) from None
            return _value(reply)
        finally:
            self._give_back(worker, reusable=reply is not None and reply[0] != "fatal")

    def close(self) -> None:
        """Kill every worker; calls in progress end with an error at once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle, busy = list(self._idle), list(self._busy)
            self._idle.clear()
            if self._lifeline is not None:  # no Popen is running: it holds the lock
                os.close(self._lifeline[0])
                os.close(self._lifeline[1])
        for worker in busy:  # their callers see the pipe end, then reap them
            worker.proc.kill()
        for worker in idle:
            worker.kill()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ workers

    def _take(self, reward: Reward) -> _Worker:
        with self._lock:
            if self._closed:
                raise _stopped(reward)
            if self._idle:
                worker = self._idle.pop()
                self._busy.add(worker)
                return worker
        return self._start(reward)

    def _give_back(self, worker: _Worker, *, reusable: bool) -> None:
        with self._lock:
            self._busy.discard(worker)
            if reusable and not self._closed:
                self._idle.append(worker)
                return
        worker.kill()

    def _lost(self, reward: Reward, worker: _Worker) -> RewardError:
        """Why ``worker``'s pipe ended."""
        if self._closed:
            return _stopped(reward)
        return RewardError(f"reward {reward.name}: {worker.ended()}")

    def _start(self, reward: Reward) -> _Worker:
        """A new worker with every reward loaded; RewardError if it cannot start."""
        requests, to_worker = os.pipe()
        from_worker, replies = os.pipe()
        try:
            with self._lock:  # close() cannot close the lifeline under a Popen
                if self._closed:
                    raise _stopped(reward)
                if self._lifeline is None:
                    self._lifeline = os.pipe()
                fds = (requests, replies, self._lifeline[0])
                proc = subprocess.Popen(
                    [sys.executable, "-m", __name__, *map(str, fds)],
                    pass_fds=fds,
                    stdin=subprocess.DEVNULL,
                )
                worker = _Worker(proc, to_worker, Connection(from_worker, writable=False))
                self._busy.add(worker)
        except BaseException:
            os.close(to_worker)
            os.close(from_worker)
            raise
        finally:  # the worker's ends: its own now, or nobody's
            os.close(requests)
            os.close(replies)
        try:
            specs = [(r.name, r.weight) for r in self.rewards]
            try:
                worker.send((list(sys.path), specs), START_TIMEOUT)
            except TimeoutError:
                raise RewardError(
                    f"reward {reward.name}: its worker process took no start"
                ) from None
            except OSError:
                raise self._lost(reward, worker) from None
            if not worker.recv.poll(START_TIMEOUT):
                raise RewardError(
                    f"reward {reward.name}: its worker process did not import the reward "
                    f"modules within {START_TIMEOUT:g} s"
                )
            try:
                kind, text = worker.recv.recv()
            except (EOFError, OSError):
                raise self._lost(reward, worker) from None
            if kind != "ready":
                raise RewardError(f"reward {reward.name}: in its worker process: {text}")
        except BaseException:
            self._give_back(worker, reusable=False)
            raise
        return worker


def _late(reward: Reward) -> RewardError:
    return RewardError(
        f"reward {reward.name} did not return within {reward.timeout:g} s "
        "(stopped; raise the [[rewards]] table's timeout if it needs longer)"
    )


def _stopped(reward: Reward) -> RewardError:
    return RewardError(f"reward {reward.name}: stopped, the reward processes were closed")


def _value(reply: tuple[str, Any]) -> list[float | RewardError | None]:
    kind, value = reply
    if kind == "ok":
        return [RewardError(v[1]) if isinstance(v, tuple) else v for v in value]
    raise RewardError(value)


# ---------------------------------------------------------------------- the worker


def _serve(requests: Connection, replies: Connection) -> None:
    """Load the rewards, then answer calls until the trainer closes the pipe."""
    path, specs = requests.recv()
    sys.path[:] = path
    try:
        rewards = [load_reward(spec, weight) for spec, weight in specs]
    except BaseException as exc:  # told to the trainer, which raises it
        replies.send(("failed", str(exc) if isinstance(exc, RewardError) else repr(exc)))
        sys.exit(1)
    replies.send(("ready", None))
    while True:
        try:
            index, args = requests.recv()
        except EOFError:
            return
        reward = rewards[index]
        try:
            got = score_many(reward, *args)
            replies.send(
                ("ok", [("error", str(v)) if isinstance(v, RewardError) else v for v in got])
            )
        except BaseException as exc:
            # SystemExit, KeyboardInterrupt, ...: the call's failure, told to the
            # trainer; then this process ends (the pool starts another when needed).
            text = f"reward {reward.name} raised {error_text(exc)}"
            replies.send(("fatal", text))
            sys.exit(1)


def _watch(lifeline: int) -> None:
    """End this process once the trainer's is gone (its lifeline reads EOF)."""
    while os.read(lifeline, 1):
        pass
    os._exit(70)


def _main(argv: list[str]) -> None:
    requests, replies, lifeline = map(int, argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch, args=(lifeline,), name="dew-lifeline", daemon=True).start()
    _serve(Connection(requests, writable=False), Connection(replies, readable=False))


if __name__ == "__main__":
    _main(sys.argv[1:])
