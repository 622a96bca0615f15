"""The machinery every engine over one HTTP server shares: an owned event loop, two
connection pools, request bookkeeping, stop watching and shutdown.

:class:`LoopEngine` is the :class:`~dew.core.Engine` side of a client of one server
process; a subclass speaks that server's dialect: how a generation request is written
(:meth:`LoopEngine._generation`), how its answer becomes a :class:`~dew.core.Call`
(:meth:`LoopEngine._outcome`), how a request is aborted (:meth:`LoopEngine._abort_request`)
and how weights are pushed (``load_file``). :class:`~dew.serving.http_engine.HTTPEngine`
speaks ``dew serve``'s (SGLang's native API); :class:`~dew.serving.vllm.VLLMEngine`
speaks vLLM's.

Threads: the engine owns one thread running one asyncio event loop; every HTTP
exchange, every future resolution and all request bookkeeping happen on it. Two
connection pools (:mod:`dew.serving._http_client`) live there: one for generations
(``max_connections``; a request beyond that waits for a free connection, within
``timeout``) and a small one for control requests (aborts, health, model info, weight
pushes), so an abort never queues behind the generations it is meant to stop. Other
threads reach the loop only through ``call_soon_threadsafe`` /
``run_coroutine_threadsafe``, under one lock that also guards ``closed``; ``close()``
joins the thread. Done-callbacks of ``submit`` futures run on the loop thread: keep
them short (``generate``, ``health`` and ``load`` are refused there, as they would
wait on the thread they block).

Invariants:

* Every future ``submit`` returns resolves exactly once: to a :class:`~dew.core.Call`,
  to :class:`~dew.core.Aborted` (its ``stop`` event set, or :meth:`LoopEngine.abort`),
  to :class:`~dew.core.EngineError` (the request was lost to an infrastructure fault:
  the server refused the connection, reset or closed it, did not answer within
  ``timeout``, answered 5xx or answered something malformed; the scheduler resubmits
  the rollout), to ``ValueError`` (the server refused the input with a 4xx: its message,
  naming the field), or to ``RuntimeError`` (the engine was closed first). The future
  is marked running before ``submit`` returns, so ``Future.cancel()`` cannot take it;
  only the loop resolves it (or ``submit`` itself, for a stop already set).
* Stopping: each request carries an id. One watcher task polls the ``stop`` events of
  the requests in flight every ``poll`` seconds; a stopped or aborted request gets the
  dialect's abort (sent again every 0.2 s until its generation answers, in case the
  abort overtook the request), and the server answers the generation with what it made
  so far: ``Aborted(tokens=n)``.
* Retries only where a retry cannot run anything twice: any request whose connection
  could not be made (nothing was sent) and, for idempotent requests (aborts, health,
  model info), broken connections and 5xx too. A generation or a weight push that may
  have reached the server is never re-sent (the scheduler decides what runs again), and
  no timeout is retried (it waited its whole budget). The rules are
  :mod:`dew.serving._http_exchange`'s.
* ``version`` is the server's: set when the engine reads it and by every push, and
  raised (never lowered) by the version of every answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import Coroutine, Hashable, Mapping, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from dew.core import Aborted, Call, Engine, EngineError, EngineTimings, SamplingParams, as_int
from dew.serving._folders import private_folder, release_folder
from dew.serving._http_client import Pool, Response
from dew.serving._http_exchange import exchange, read_ok
from dew.serving._requests import Request, make_request

__all__ = [
    "CONNECT_TIMEOUT",
    "FLEET_CONNECT_TIMEOUT",
    "REQUEST_TIMEOUT",
    "STARTUP_TIMEOUT",
    "LoopEngine",
    "Pending",
]

T = TypeVar("T")

_RESEND = 0.2  # seconds between two aborts of one request still in flight
_CONTROL_CONNECTIONS = 8
# Idle connections are dropped before the server would: uvicorn's default keep-alive (the
# one SGLang's and vLLM's servers run with) is 5 s, dew serve's 120 s. Sending on a
# connection the server is just closing would fail a generation that cannot safely be
# sent again.
_KEEPALIVE = 4.0

# The defaults of every engine over one server (HTTPEngine, VLLMEngine, EngineFleet):
# seconds a request may take (a generation, or waiting for a free connection to send it).
REQUEST_TIMEOUT = 120.0
# Seconds to open a connection, and the whole budget of a request that does no work
# (health, abort, model info). A lone engine has no other server to turn to, so it gives
# a busy server's accept queue time before calling the server unreachable.
CONNECT_TIMEOUT = 5.0
# A fleet's, shorter on purpose: its health thread pings every member with it each
# round, and the fleet has other members to route to, so a member that stopped
# answering should fail its checks (and leave the rotation) within seconds.
FLEET_CONNECT_TIMEOUT = 2.0
# Seconds an engine's constructor waits for its server to answer.
STARTUP_TIMEOUT = 10.0


class _CallFuture(Future[Call]):
    """The future ``submit`` returns; carries its request id so ``abort`` finds it."""

    def __init__(self, owner: LoopEngine, rid: str) -> None:
        super().__init__()
        self.owner = owner
        self.rid = rid

    def result(self, timeout: float | None = None) -> Call:
        if not self.done():  # waiting on the loop thread would wait forever
            self.owner._check_not_loop("a wait on a submit future (say, generate())")
        return super().result(timeout)


@dataclass(eq=False)
class Pending:
    """One request in flight; owned by the loop thread once registered."""

    rid: str
    body: dict[str, Any]
    prompt: list[int]
    keeps_support: bool
    stop: threading.Event | None
    future: _CallFuture
    affinity: Hashable | None = None  # the caller's group, where a dialect batches by it
    stopping: bool = False  # the caller asked for the request to end
    abort_sent: float = float("-inf")  # loop time of the last abort

    @property
    def stopped(self) -> bool:
        return self.stopping or (self.stop is not None and self.stop.is_set())


class LoopEngine(Engine):
    """An :class:`~dew.core.Engine` over one server; subclasses speak its dialect.

    The constructor checks the arguments every such engine shares (see
    :class:`~dew.serving.http_engine.HTTPEngine` for their meaning), starts the loop
    thread and opens the pools; the subclass then reads the server's model
    (:meth:`_describe`) and sets ``_max_len``, ``_vocab`` and ``_eos``.
    """

    _generate_path = "/generate"
    _kind = "HTTPEngine"

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None,
        weights_dir: str | Path | None,
        timeout: float,
        connect_timeout: float,
        max_connections: int,
        startup_timeout: float,
        poll: float,
        abort_urls: Sequence[str] = (),
        run: str | None = None,
        takeover: bool = False,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http(s) URL, got {url!r}")
        if run is not None and (not isinstance(run, str) or not run):
            raise ValueError(f"run must be a non-empty string, got {run!r}")
        if not isinstance(takeover, bool):
            raise ValueError(f"takeover must be a bool, got {takeover!r}")
        # The trainer run this engine pushes for (see dew.serving._claim): one of its
        # own unless given; its first push starts the run's version sequence.
        self.run = run if run is not None else uuid.uuid4().hex
        self._takeover = takeover
        self._pushed = False
        if isinstance(abort_urls, str) or not all(
            isinstance(u, str) and u.startswith(("http://", "https://")) for u in abort_urls
        ):
            raise ValueError(f"abort_urls must be a sequence of http(s) URLs, got {abort_urls!r}")
        numbers = {"timeout": timeout, "connect_timeout": connect_timeout, "poll": poll}
        for name, value in {**numbers, "startup_timeout": startup_timeout}.items():
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        max_connections = as_int(max_connections, "max_connections")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self._url = url.rstrip("/")
        self._headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        self._timeout = float(timeout)
        self._connect_timeout = float(connect_timeout)
        self._poll = float(poll)
        self._weights_dir = None if weights_dir is None else Path(weights_dir)
        self._own_dir: Path | None = None  # the private weights folder, made on first load
        self._lock = threading.Lock()  # guards _closed, _version and scheduling onto the loop
        self._closed = False
        self._version = 0
        self._held_by: str | None = None  # the run holding the server, where it says
        self._max_len = self._vocab = 0
        self._eos: tuple[int, ...] = ()
        self._inflight: dict[str, Pending] = {}  # loop thread only
        self._watcher: asyncio.Task[None] | None = None  # loop thread only
        self._spawned: set[asyncio.Task[Any]] = set()  # loop thread only: strong refs
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._run_loop, name=f"{self._kind}({self._url})", daemon=True
        )
        self._thread.start()
        self._gen = self._block(self._pool(max_connections))
        self._ctl = self._block(self._pool(_CONTROL_CONNECTIONS))
        self._abort_to = [self._block(self._pool(2, u.rstrip("/"))) for u in abort_urls]
        try:
            self._describe(float(startup_timeout))
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ the dialect

    def _describe(self, within: float) -> None:
        """Read the served model (and version) from the server, waiting up to ``within``
        seconds for it to answer; sets ``_max_len``, ``_vocab``, ``_eos``."""
        raise NotImplementedError

    def _generation(self, request: Request, params: SamplingParams, rid: str) -> dict[str, Any]:
        """The JSON body of the generation request ``rid`` (sent to ``_generate_path``)."""
        raise NotImplementedError

    def _outcome(self, p: Pending, data: Mapping[str, Any]) -> Call | BaseException:
        """What the answer ``data`` to ``p`` resolves its future to."""
        raise NotImplementedError

    async def _abort_request(self, rid: str, pool: Pool | None) -> None:
        """Ask the server (or ``pool``'s) to drop request ``rid``; may raise."""
        raise NotImplementedError

    def load_file(self, path: str | Path, version: int) -> None:
        """Ask the server to load the weights file ``path`` and serve it as ``version``."""
        raise NotImplementedError

    def timings(self) -> list[EngineTimings]:
        """The server's iterations by active-sequence count (:class:`dew.core.Timed`),
        each entry named by :attr:`url`; :class:`~dew.core.EngineError` naming the URL
        when the server does not answer within the connect timeout."""
        raise NotImplementedError

    # ------------------------------------------------------------------ properties

    @property
    def url(self) -> str:
        return self._url

    @property
    def version(self) -> int:
        with self._lock:
            return self._version

    @property
    def held_by(self) -> str | None:
        """The trainer run holding the server, as last read (at construction, by a
        health check or a push); None when no run does, or the server does not say."""
        return self._held_by

    @property
    def max_len(self) -> int:
        """The longest prompt + completion a request may ask for (the server's)."""
        return self._max_len

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The served model's end-of-sequence ids (``stop_ids=None`` stops at these)."""
        return self._eos

    @property
    def in_flight(self) -> int:
        """Requests sent and not yet resolved (a snapshot, from any thread)."""
        return len(self._inflight)

    # ------------------------------------------------------------------ Engine

    def submit(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        stop: threading.Event | None = None,
        affinity: Hashable | None = None,
    ) -> Future[Call]:
        """Send a completion request for ``prompt``; returns its future at once.

        Same rules as :meth:`dew.serving.RolloutServer.submit`: invalid arguments raise
        ``ValueError`` here, a closed engine ``RuntimeError``; ``affinity`` means nothing
        to one engine (a dialect may send a group's requests together).
        """
        request = make_request(
            prompt, params, stop, vocab=self._vocab, max_len=self._max_len, eos=self._eos
        )
        rid = uuid.uuid4().hex
        body = self._generation(request, params, rid)
        future = _CallFuture(self, rid)
        future.set_running_or_notify_cancel()  # only the engine resolves it from now on
        pending = Pending(rid, body, request.prompt, request.keeps_support, stop, future, affinity)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._kind}({self._url}) is closed")
            if stop is not None and stop.is_set():
                future.set_exception(Aborted("generation stopped before it started"))
                return future
            self._loop.call_soon_threadsafe(self._start, pending)
        return future

    def abort(self, future: Future[Call]) -> None:
        """Ask the server to drop the request behind ``future``; returns at once.

        The future then resolves to :class:`~dew.core.Aborted` (or to the call, if it
        finished first). A resolved future, or one another engine made, is left alone.
        """
        if not isinstance(future, _CallFuture) or future.owner is not self or future.done():
            return
        with self._lock:
            if not self._closed:
                self._loop.call_soon_threadsafe(self._stop_request, future.rid)

    # ------------------------------------------------------------------ Publisher

    def load(self, variables: Any, version: int) -> None:
        """Publish ``variables`` (an ``nn.Module`` or a state dict) as ``version``.

        Writes one weights file (:func:`dew.serving.weights.write_weights`) into
        ``weights_dir``, asks the server to load it (:meth:`load_file`), and removes the
        file once the server answered. A refusal (a version not newer than the served
        one, names or shapes that do not match) raises ``ValueError`` with the server's
        message; the server keeps its old weights then.
        """
        from dew.serving.weights import write_weights

        self._check_not_loop("load()")
        version = as_int(version, "version")
        path = write_weights(variables, self._folder(), version)
        try:
            self.load_file(path, version)
        finally:
            Path(path).unlink(missing_ok=True)

    # ------------------------------------------------------------------ lifetime

    def _took(self) -> None:
        """A push of this engine's went through: its run holds the server."""
        self._pushed = True
        self._held_by = self.run

    async def _release(self) -> None:
        """Tell the server this engine's run lets it go (the dialect's request)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the server if this engine pushed to it (another run may then push
        without taking it over), fail every request still in flight with
        ``RuntimeError`` (and ask the server to drop them), close the connection pools
        and join the loop thread."""
        if self._pushed and not self._closed and threading.current_thread() is not self._thread:
            self._pushed = False
            with contextlib.suppress(EngineError, ValueError, RuntimeError):
                self._block(self._release())  # a server gone or closing holds nothing
        with self._lock:
            if self._closed:
                return
            self._closed = True
            done = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        if threading.current_thread() is not self._thread:
            done.result()
            self._thread.join()
        if self._own_dir is not None:
            release_folder(self._own_dir)

    def __enter__(self) -> LoopEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{self._kind}({self._url!r}, version={self._version})"

    def _check_not_loop(self, name: str) -> None:
        if threading.current_thread() is self._thread:
            raise RuntimeError(
                f"{self._kind}: {name} was called on the engine's loop thread (from a submit "
                "future's done-callback); it would wait forever. Use submit() there."
            )

    def _block(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for it (its own deadlines bound the wait)."""
        with self._lock:
            if self._closed:
                coro.close()
                raise RuntimeError(f"{self._kind}({self._url}) is closed")
            done = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return done.result()
        except CancelledError:  # close() cancelled it
            raise RuntimeError(f"{self._kind}({self._url}) was closed meanwhile") from None

    def _folder(self) -> Path:
        if self._weights_dir is not None:
            self._weights_dir.mkdir(parents=True, exist_ok=True)
            return self._weights_dir
        with self._lock:
            if self._own_dir is None:  # where a server on this machine reads by default
                self._own_dir = private_folder("run-")
            return self._own_dir

    def _set_version(self, value: object, *, exact: bool) -> None:
        try:
            value = as_int(value, "version")
        except ValueError:
            return  # an SGLang server's version is a label, not dew's number
        with self._lock:
            self._version = value if exact else max(self._version, value)

    # ------------------------------------------------------------------ loop thread

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _pool(self, limit: int, url: str | None = None) -> Pool:  # on the loop, as
        return Pool(  # its semaphore must be
            url or self._url,
            headers=self._headers,
            limit=limit,
            connect_timeout=self._connect_timeout,
            keepalive=_KEEPALIVE,
        )

    async def _answering(self, method: str, path: str, within: float) -> dict[str, Any]:
        """``path``'s answer, asked again every 0.1 s while the server cannot be reached
        (it may still be starting), for up to ``within`` seconds."""
        deadline = self._loop.time() + within
        while True:
            try:
                return await self._request(method, path, None, short=True)
            except EngineError as exc:
                if self._loop.time() + 0.1 > deadline:
                    raise EngineError(
                        f"{self._url}{path} did not answer within {within:g}s: {exc}"
                    ) from None
                await asyncio.sleep(0.1)

    async def _read(self, path: str) -> Response:
        """``GET path`` answered 200 within the connect timeout (:func:`read_ok`)."""
        return await read_ok(self._ctl, path, self._connect_timeout)

    async def _request(
        self,
        method: str,
        path: str,
        body: Any,
        *,
        retry: bool = False,
        short: bool = False,
        pool: Pool | None = None,
        many: bool = False,
    ) -> Any:
        """One exchange (:func:`exchange`) on this engine's pools: the generation pool
        for the generate path, else the control pool. ``short``: the answer is due
        within the connect timeout (requests that do no work); ``pool``: another
        server's (an abort sent to a worker behind a router)."""
        if pool is None:
            pool = self._gen if path == self._generate_path else self._ctl
        timeout = self._connect_timeout if short else self._timeout
        return await exchange(pool, method, path, body, timeout=timeout, retry=retry, many=many)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = self._loop.create_task(coro)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)
        return task

    def _start(self, p: Pending) -> None:
        self._inflight[p.rid] = p
        self._spawn(self._generate(p))
        if self._watcher is None:
            self._watcher = self._spawn(self._watch())

    def _stop_request(self, rid: str) -> None:
        p = self._inflight.get(rid)
        if p is not None and not p.stopping:
            p.stopping = True
            self._send_abort(p)

    def _send_abort(self, p: Pending) -> None:  # sent again after _RESEND (see _watch)
        p.abort_sent = self._loop.time()
        self._spawn(self._abort_quietly(p.rid))

    async def _abort_quietly(self, rid: str) -> None:
        async def one(pool: Pool | None) -> None:
            with contextlib.suppress(EngineError, ValueError):
                await self._abort_request(rid, pool)

        await asyncio.gather(*(one(p) for p in self._abort_to or [None]))

    async def _watch(self) -> None:
        """Turn set ``stop`` events into aborts; runs while requests are in flight."""
        try:
            while self._inflight:
                now = self._loop.time()
                for p in list(self._inflight.values()):
                    if not p.stopping and p.stop is not None and p.stop.is_set():
                        p.stopping = True
                    if p.stopping and now - p.abort_sent >= _RESEND:
                        self._send_abort(p)
                await asyncio.sleep(self._poll)
        finally:
            self._watcher = None

    async def _generate(self, p: Pending) -> None:
        outcome: Call | BaseException
        where = f"{self._url}{self._generate_path}"
        if p.stopped:
            outcome = Aborted("generation stopped before it was sent")
        else:
            try:
                answer = await self._request("POST", self._generate_path, p.body)
                outcome = self._outcome(p, answer)
            except (EngineError, ValueError) as exc:
                outcome = exc
            except asyncio.CancelledError:
                raise  # close() cancelled it; _shutdown resolves the future
            except Exception as exc:  # a bug of ours: the request is lost
                outcome = EngineError(f"{where}: {exc!r}")
        self._inflight.pop(p.rid, None)
        _settle(p.future, outcome)

    async def _shutdown(self) -> None:
        """Fail what is in flight, ask the server to drop it, close the pools, stop."""
        pending = list(self._inflight.values())
        self._inflight.clear()
        error = RuntimeError(f"{self._kind}({self._url}) was closed before this request finished")
        for p in pending:
            _settle(p.future, error)
        aborts = [self._spawn(self._abort_quietly(p.rid)) for p in pending]
        if aborts:
            await asyncio.wait(aborts, timeout=min(1.0, self._connect_timeout))
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()  # open generation exchanges disconnect: the server drops them
        await asyncio.gather(*others, return_exceptions=True)
        await self._gen.aclose()
        await self._ctl.aclose()
        for pool in self._abort_to:
            await pool.aclose()
        self._loop.call_soon(self._loop.stop)


def _settle(future: Future[Call], outcome: Call | BaseException) -> None:
    if not future.done():
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
