"""EngineFleet: routing, the publish sequence and the lifetime (see the package docstring)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

from dew.core import Aborted, Call, Engine, EngineError, EngineTimings, SamplingParams, as_int
from dew.serving._folders import private_folder, release_folder
from dew.serving._http_base import FLEET_CONNECT_TIMEOUT, REQUEST_TIMEOUT, LoopEngine
from dew.serving._requests import make_request
from dew.serving.fleet._care import Care
from dew.serving.fleet._launch import STARTUP_TIMEOUT, Launch
from dew.serving.fleet._parts import (
    BACKOFF_MAX,
    CLOSED,
    ENGINES,
    OUT,
    UP,
    FleetCall,
    FleetFuture,
    Member,
    MemberInfo,
    Process,
    member_class,
    settle,
)
from dew.serving.fleet._publish import Publish
from dew.serving.fleet._router import RouterAdmin, RouterProcess
from dew.serving.http_engine import HTTPEngine

log = logging.getLogger("dew.serving.fleet")


class EngineFleet(Care, Publish, Launch, Engine):
    """Many ``dew serve`` engines as one :class:`~dew.core.Engine` and Publisher.

    ``engines``: engines of servers (:class:`HTTPEngine` s, :class:`VLLMEngine` s) or
    URLs, which are made into engines of the kind ``engine`` names (``"dew"``: ``dew
    serve``, ``"vllm"``: vLLM servers) with ``api_key``, ``timeout``,
    ``connect_timeout`` and ``engine_options`` (say, ``{"on_load": "keep"}`` for vLLM);
    the fleet owns and closes all of them (on a construction error only the ones it
    made). They must serve one model: equal
    ``max_len``, ``vocab_size`` and ``eos_token_ids``, else ``ValueError``.
    ``weights_dir``: where :meth:`load` writes weights files (readable by every member;
    default a private folder in ``/dev/shm``, removed by :meth:`close`).
    ``health_interval``: seconds between health rounds; ``max_failures``: failed checks
    in a row that take a member out. ``timeout``: how long a call may wait for a member
    to join the rotation. ``affinity_size``: entries of the affinity table.
    ``router``: the URL of an sglang-router whose workers are exactly ``engines``; calls
    then go through it (its policy routes them, ``affinity`` is not used), while weights,
    aborts and health checks go to each worker directly, and a worker out of rotation is
    also taken off the router's list (the package docstring says when to choose which).
    """

    def __init__(
        self,
        engines: Sequence[LoopEngine | str],
        *,
        api_key: str | None = None,
        weights_dir: str | Path | None = None,
        health_interval: float = 1.0,
        max_failures: int = 3,
        timeout: float = REQUEST_TIMEOUT,
        connect_timeout: float = FLEET_CONNECT_TIMEOUT,
        affinity_size: int = 4096,
        startup_timeout: float = STARTUP_TIMEOUT,
        router: str | None = None,
        engine: str = "dew",
        engine_options: Mapping[str, Any] | None = None,
        _locals: Sequence[Process] | None = None,
        _router_process: RouterProcess | None = None,
        _own_dir: bool = False,
    ) -> None:
        for name, value in (("health_interval", health_interval), ("timeout", timeout)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        self._max_failures = as_int(max_failures, "max_failures")
        self._affinity_size = as_int(affinity_size, "affinity_size")
        if self._max_failures < 1 or self._affinity_size < 1:
            raise ValueError("max_failures and affinity_size must be >= 1")
        if not engines:
            raise ValueError("an EngineFleet needs at least one engine")
        self._interval = float(health_interval)
        self._timeout = float(timeout)
        self._startup = float(startup_timeout)
        if engine not in ENGINES:
            raise ValueError(f"engine={engine!r} is not one of {sorted(ENGINES)}")
        if router is not None and engine != "dew":
            raise ValueError("router= fronts dew serve engines only (engine='dew')")
        self._make = member_class(engine)
        self._engine_kw: dict[str, Any] = {
            **(engine_options or {}),
            "api_key": api_key,
            "timeout": timeout,
            "connect_timeout": connect_timeout,
        }
        locals_ = list(_locals) if _locals is not None else [None] * len(engines)
        made: list[LoopEngine] = []
        try:
            members = []
            for item, local in zip(engines, locals_, strict=True):
                if isinstance(item, str):
                    item = self._make(item, **self._engine_kw)
                    made.append(item)
                elif not isinstance(item, LoopEngine):
                    raise ValueError(f"engines must be engines of servers or URLs, got {item!r}")
                members.append(Member(item, local))
            first = members[0].engine
            self._model = (first.max_len, first.vocab_size, first.eos_token_ids)
            for m in members[1:]:
                self._check_model(m.engine)
            self._front: Member | None = None  # the router, in router mode
            self._admin: RouterAdmin | None = None
            if router is not None:
                workers = [m.engine.url for m in members]
                front = HTTPEngine(router, abort_urls=workers, **self._engine_kw)
                made.append(front)
                self._check_model(front)
                self._front = Member(front, None)
                self._admin = RouterAdmin(router, api_key=api_key, timeout=self._timeout)
        except BaseException:
            for e in made:
                e.close()
            raise
        self._router_process = _router_process
        self._disconnect: Callable[[], None] | None = None  # a Ray fleet's connection
        self._members = members
        self._version = max(m.engine.version for m in members)
        # Until the first publish the members serve another run's weights (or their
        # own initial ones): the fleet's first version may be any.
        self._published = False
        for m in members:
            m.pushed = m.engine.version
            if m.engine.version == self._version:
                m.confirmed = self._version
            else:
                m.state, m.reason = OUT, f"serves version {m.engine.version}, behind"
                if self._admin is not None:
                    self._admin.remove(m.engine.url)
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()
        # Orders edits of the router's list: a take-out holds it from the state change
        # until the router dropped the member, so a push that saw the member go out
        # (and takes it too, in _take_out) returns only once the list is right.
        self._router_lock = threading.Lock()
        self._closed = False
        self._publishing = False  # a push is under way: new calls wait for its end
        self._affinity: OrderedDict[Hashable, Member] = OrderedDict()
        # The member a call of this affinity last failed on: its resubmission goes
        # elsewhere while any other member is up, so one crash costs it one attempt.
        self._failed_on: OrderedDict[Hashable, Member] = OrderedDict()
        self._waiting: deque[FleetCall] = deque()
        self._files: list[tuple[int, Path]] = []  # (version, path), oldest first
        self._own_dir = weights_dir is None or _own_dir
        self._dir = private_folder("fleet-") if weights_dir is None else Path(weights_dir)
        workers = 4 * len(members) + 4
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fleet")
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._health_loop, name="fleet-health")]
        if any(m.local is not None for m in members):
            self._threads.append(threading.Thread(target=self._supervise, name="fleet-supervisor"))
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ properties

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_len(self) -> int:
        return self._model[0]

    @property
    def vocab_size(self) -> int:
        return self._model[1]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._model[2]

    @property
    def in_flight(self) -> int:
        """Calls submitted and not yet resolved (waiting ones included)."""
        with self._lock:
            front = 0 if self._front is None else len(self._front.calls)
            return len(self._waiting) + front + sum(len(m.calls) for m in self._members)

    def members(self) -> list[MemberInfo]:
        """A snapshot of every member, in construction order."""
        with self._lock:
            return [
                MemberInfo(
                    url=m.engine.url,
                    state=m.state,
                    version=m.confirmed,
                    in_flight=len(m.calls),
                    dispatched=m.dispatched,
                    pid=_pid(m.local),
                    restarts=m.restarts,
                    reason=m.reason,
                    suspect=m.suspect,
                    held_by=m.engine.held_by,
                    node=getattr(m.local, "node", None),
                    actor=getattr(m.local, "name", None),
                )
                for m in self._members
            ]

    def timings(self) -> list[EngineTimings]:
        """Every member's iteration log (:class:`dew.core.Timed`), in construction
        order, each entry named by the member's URL, read concurrently within the
        members' connect timeout. A member that does not answer (down, restarting, a
        fault) is left out of this read; :class:`~dew.core.EngineError` when none
        answers. Each log counts from its server's start: a restarted member's counts
        start over."""
        with self._lock:
            if self._closed:
                raise RuntimeError("EngineFleet is closed")
            engines = [m.engine for m in self._members]
        reads = [self._pool.submit(e.timings) for e in engines]
        out: list[EngineTimings] = []
        faults: list[str] = []
        answered = 0
        for engine, read in zip(engines, reads, strict=True):
            try:
                out.extend(read.result())
                answered += 1
            except (EngineError, RuntimeError, ValueError) as exc:  # left out of this read
                faults.append(f"{engine.url}: {exc}" if engine.url not in str(exc) else str(exc))
        if not answered:
            raise EngineError(f"no fleet member answered its timings: {'; '.join(faults)}")
        return out

    # ------------------------------------------------------------------ Engine

    def submit(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        stop: threading.Event | None = None,
        affinity: Hashable | None = None,
    ) -> Future[Call]:
        """Route a completion to a member; returns the fleet's future at once."""
        max_len, vocab, eos = self._model
        request = make_request(prompt, params, stop, vocab=vocab, max_len=max_len, eos=eos)
        future = FleetFuture(self)
        future.set_running_or_notify_cancel()  # only the fleet resolves it
        deadline = time.monotonic() + self._timeout
        call = FleetCall(request.prompt, params, stop, affinity, future, deadline)
        future.call = call
        if self._closed:
            raise RuntimeError("EngineFleet is closed")
        self._dispatch(call)
        return future

    def abort(self, future: Future[Call]) -> None:
        """Ask the member behind ``future`` to drop it; returns at once."""
        if not isinstance(future, FleetFuture) or future.owner is not self or future.done():
            return
        call = future.call
        assert call is not None
        with self._lock:
            call.abort = True
            waiting = call in self._waiting
            if waiting:
                self._waiting.remove(call)
            member, inner = call.member, call.inner
        if waiting:
            settle(future, Aborted("generation stopped before it was sent"))
        elif member is not None and inner is not None:
            member.engine.abort(inner)

    def _check_model(self, engine: LoopEngine) -> None:
        have = (engine.max_len, engine.vocab_size, engine.eos_token_ids)
        if have != self._model:
            raise ValueError(
                "the fleet's engines serve different models: (max_len, vocab_size, "
                f"eos_token_ids) = {self._model} but {engine.url} has {have}"
            )

    def _pick(self, affinity: Hashable | None) -> Member | None:
        """The member for a call (lock held): the affinity's while up, else least work;
        in router mode the router, while any worker is up."""
        if self._front is not None:
            return self._front if any(m.state == UP for m in self._members) else None
        failed = None if affinity is None else self._failed_on.get(affinity)
        up = [m for m in self._members if m.state == UP]
        # Neither a suspect nor the one this affinity failed on, while another will do.
        fit = [m for m in up if not m.suspect and m is not failed]
        up = fit or [m for m in up if m is not failed] or up
        if not up:
            return None
        if affinity is not None:
            member = self._affinity.get(affinity)
            if member is not None and member in up:
                self._affinity.move_to_end(affinity)
                return member
        member = min(up, key=lambda m: (len(m.calls), m.dispatched))
        if affinity is not None:
            self._affinity[affinity] = member
            self._affinity.move_to_end(affinity)
            while len(self._affinity) > self._affinity_size:
                self._affinity.popitem(last=False)
        return member

    def _dispatch(self, call: FleetCall) -> None:
        """Send ``call`` to a member, or park it until one joins."""
        while True:
            with self._lock:
                if call.outer.done() or call.abort:
                    return
                closed = self._closed
                member = None if closed or self._publishing else self._pick(call.affinity)
                if member is not None:
                    member.calls[call] = None
                    member.dispatched += 1
                    call.member, gen, engine = member, member.gen, member.engine
                elif not closed:
                    self._waiting.append(call)
                    return
            if member is None:
                settle(call.outer, RuntimeError("EngineFleet is closed"))
                return
            try:
                # The affinity goes on: a member may send a group's requests together.
                inner = engine.submit(
                    call.prompt, call.params, stop=call.stop, affinity=call.affinity
                )
            except RuntimeError as exc:  # the member was closed under us: try another
                if not self._release(call, member):
                    return  # the fleet resolved it meanwhile
                self._take_out(member, gen, f"closed: {exc}")
                continue
            except ValueError as exc:
                if self._release(call, member):
                    settle(call.outer, exc)
                return
            with self._lock:
                call.inner = inner
                aborted = call.abort
                fenced = call not in member.calls
            if fenced or aborted:
                engine.abort(inner)
            inner.add_done_callback(lambda f, c=call, m=member: self._finished(c, m, f))
            return

    def _release(self, call: FleetCall, member: Member) -> bool:
        with self._lock:
            return member.calls.pop(call, 0) is None

    def _finished(self, call: FleetCall, member: Member, inner: Future[Call]) -> None:
        """A member answered (on its loop thread): resolve the fleet future once."""
        if not self._release(call, member):
            return  # taken out, or closed: the fleet resolved it already
        error = inner.exception()
        if isinstance(error, RuntimeError):  # the member, not the fleet, was closed
            error = EngineError(f"{member.engine.url}: {error}")
        if isinstance(error, EngineError) and member is not self._front:  # out if a health
            # check confirms it (the router's errors are its workers': their checks decide);
            # meanwhile no new call goes there, least of all this call's resubmission
            with self._lock:
                gen, engine = member.gen, member.engine
                member.suspect = True
                if call.affinity is not None:
                    self._failed_on[call.affinity] = member
                    self._failed_on.move_to_end(call.affinity)
                    while len(self._failed_on) > self._affinity_size:
                        self._failed_on.popitem(last=False)
            with contextlib.suppress(RuntimeError):  # the pool is shut: closing
                self._pool.submit(self._recheck, member, gen, engine, str(error))
        settle(call.outer, inner.result() if error is None else error)

    def _take_out(self, member: Member, gen: int, reason: str) -> None:
        """Out of rotation; fail its calls with EngineError and abort them there."""
        with self._router_lock:
            with self._lock:
                if member.gen != gen or member.state not in (UP, OUT):
                    return
                was = member.state
                member.state, member.reason, member.gen = OUT, reason, gen + 1
                member.failures, member.confirmed = 0, -1
                member.retry_at = time.monotonic() + member.backoff
                calls = list(member.calls)
                member.calls.clear()
            if was == UP:
                log.warning("fleet: %s taken out: %s", member.engine.url, reason)
                if self._admin is not None and member is not self._front:
                    try:
                        self._admin.remove(member.engine.url)
                    except EngineError as exc:  # the router then finds it unhealthy itself
                        log.warning(
                            "fleet: %s stays on the router's list: %s", member.engine.url, exc
                        )
        error = EngineError(f"{member.engine.url} was taken out of the fleet: {reason}")
        dead = member.local is not None and not member.local.alive()
        for call in calls:
            settle(call.outer, error)
            if call.inner is not None and not dead:  # a dead process has nothing to drop
                member.engine.abort(call.inner)

    def _join(self, member: Member, gen: int, version: int) -> bool:
        """Put a member brought to ``version`` back in rotation (publish lock held)."""
        with self._router_lock:
            with self._lock:  # taken out (or closed) since: it must not reach the list
                if member.gen != gen or self._closed:
                    return False
            if self._admin is not None:
                try:
                    self._admin.add(member.engine.url)
                except EngineError as exc:
                    with self._lock:
                        member.reason = f"the router did not take it back: {exc}"
                        member.backoff = min(BACKOFF_MAX, member.backoff * 2)
                        member.retry_at = time.monotonic() + member.backoff
                    return False
            with self._lock:
                if member.gen != gen or self._closed:
                    return False
                member.state, member.reason, member.suspect = UP, "", False
                member.confirmed = member.pushed = version
                member.failures, member.backoff = 0, 0.5
        log.warning("fleet: %s in rotation at version %d", member.engine.url, version)
        self._drain()
        return True

    def _drain(self) -> None:
        """Dispatch the calls that waited for a member or for a push to end."""
        with self._lock:
            waiting = list(self._waiting)
            self._waiting.clear()
        for call in waiting:
            self._dispatch(call)

    # ------------------------------------------------------------------ lifetime

    def close(self, grace: float = 10.0) -> None:
        """Stop the threads, fail what is in flight with ``RuntimeError``, close the
        members and stop the local processes (SIGTERM, SIGKILL after ``grace``)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            everyone = self._members + ([] if self._front is None else [self._front])
            calls = list(self._waiting) + [c for m in everyone for c in m.calls]
            self._waiting.clear()
            for m in everyone:
                m.calls.clear()
                m.gen += 1
        self._stopping.set()
        error = RuntimeError("EngineFleet was closed before this request finished")
        for call in calls:
            settle(call.outer, error)
        for m in everyone:
            m.engine.close()  # also unblocks a push or ping a thread waits on
        for t in self._threads:
            t.join()
        if self._admin is not None:
            self._admin.close()
        if self._router_process is not None:
            self._router_process.stop(grace)
        stops = [self._pool.submit(m.engine.close) for m in self._members]
        stops += [
            self._pool.submit(m.local.stop, grace) for m in self._members if m.local is not None
        ]
        wait_futures(stops)
        with self._lock:
            for m in self._members:
                m.state = CLOSED
        self._pool.shutdown(wait=True)
        if self._own_dir:
            release_folder(self._dir)
        if self._disconnect is not None:
            self._disconnect()

    def __enter__(self) -> EngineFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        up = sum(m.state == UP for m in self._members)
        return f"EngineFleet({up}/{len(self._members)} in rotation, version={self._version})"


def _pid(local: Process | None) -> int | None:
    if local is None:
        return None
    if local.proc is not None:
        return local.proc.pid
    return getattr(local, "server_pid", None)  # a server under a Ray actor
