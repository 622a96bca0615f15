"""A small HTTP/1.1 client for one server: the transport under :class:`HTTPEngine`.

Why not httpx: with a few hundred requests in flight to one host, httpcore's pool
rescans every connection for every request it places (O(connections x requests) per
request, each scan asking the socket whether it is readable); profiled under the demo,
the HTTP engines spent nearly all their CPU there and ran at a small fraction of the
in-process engine's speed (bench/RESULTS.md, "fleet: profile"). A request cancelled
while anyio was still opening its connection also left that connection's coroutine to
the garbage collector. This client does only what the engine needs: JSON bodies,
keep-alive connections to one host, h11 for the protocol itself.

Runs on one event loop (the engine's); not thread-safe.

Invariants:

* A connection is either idle in the pool or held by exactly one exchange. An exchange
  that does not end cleanly (an error, a timeout, a cancellation, an answer that leaves
  the connection unusable) closes its connection at once; only a connection whose
  request and response both completed goes back to the pool.
* At most ``limit`` exchanges hold a connection; more wait (within their timeout). A
  new connection is opened only when no idle one is left, so no more than ``limit``
  connections are ever open.
* Idle connections older than ``keepalive`` seconds, or that the server closed, are
  never used: reusing one the server is closing would fail a request that cannot
  safely be sent again.
* :meth:`Pool.aclose` closes every connection still open and waits (briefly) for the
  sockets to be released, so nothing is left to the collector.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import h11

__all__ = ["Broken", "NotConnected", "Pool", "Response", "TimedOut", "TransportError"]

_CHUNK = 1 << 16


class TransportError(Exception):
    """The exchange failed below HTTP: see the subclasses for what may have been sent."""


class NotConnected(TransportError):
    """No connection could be opened: nothing was sent, so sending again is safe."""


class TimedOut(TransportError):
    """No complete answer within the timeout (the request may have been sent)."""


class Broken(TransportError):
    """The connection failed or the server broke the protocol after the request may
    have been sent."""


@dataclass(frozen=True)
class Response:
    status: int
    reason: str
    body: bytes

    def json(self) -> Any:
        """The body as JSON, or ``None`` when it is not JSON."""
        try:
            return json.loads(self.body)
        except ValueError:  # UnicodeDecodeError included
            return None

    def error_message(self) -> str:
        """The server's error: dew's ``{"error": {"message", "param"}}`` as
        ``param: message`` (the message alone when it names its param first), else a
        ``message`` or ``detail`` field, else the raw text."""
        data = self.json()
        if data is None:
            return self.body[:500].decode("utf-8", "replace") or self.reason
        if isinstance(data, Mapping):
            error = data.get("error")
            if isinstance(error, Mapping) and "message" in error:
                param = error.get("param")
                message = str(error["message"])
                named = not param or message.startswith(f"{param}: ")  # said once, not twice
                return message if named else f"{param}: {message}"
            for key in ("message", "detail"):
                if key in data:
                    return str(data[key])
        return str(data)[:500]


@dataclass(eq=False)
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    h11: h11.Connection = field(default_factory=lambda: h11.Connection(our_role=h11.CLIENT))
    idle_since: float = 0.0

    def usable(self, now: float, keepalive: float) -> bool:
        return (
            now - self.idle_since < keepalive
            and not self.reader.at_eof()
            and not self.writer.is_closing()
        )

    def close(self) -> None:
        self.writer.close()  # sync: the socket is released on the loop's next turn


class Pool:
    """Keep-alive connections to the server at ``url`` (``http://`` or ``https://``).

    ``headers`` go with every request. ``limit``: exchanges at once; ``connect_timeout``:
    seconds to open one connection; ``keepalive``: seconds an idle connection is kept.
    """

    def __init__(
        self,
        url: str,
        *,
        headers: dict[str, str],
        limit: int,
        connect_timeout: float,
        keepalive: float,
    ) -> None:
        self.url = url
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must be an http(s) URL with a host, got {url!r}")
        self._host = parts.hostname
        self._tls = parts.scheme == "https"
        self._port = parts.port or (443 if self._tls else 80)
        self._prefix = parts.path.rstrip("/")
        default = 443 if self._tls else 80
        authority = self._host if ":" not in self._host else f"[{self._host}]"
        if self._port != default:
            authority = f"{authority}:{self._port}"
        self._headers = [("Host", authority), *headers.items()]
        self._connect_timeout = connect_timeout
        self._keepalive = keepalive
        self._slots = asyncio.Semaphore(limit)
        self._idle: deque[_Connection] = deque()  # oldest first: reuse from the end
        self._open: set[_Connection] = set()
        self._closed = False

    async def request(
        self, method: str, path: str, body: bytes | None, *, timeout: float
    ) -> Response:
        """One exchange, all of it (waiting for a slot included) within ``timeout``."""
        try:
            async with asyncio.timeout(timeout):
                async with self._slots:
                    return await self._exchange(method, path, body)
        except TimeoutError:
            raise TimedOut(f"no complete answer within {timeout:g}s") from None

    async def aclose(self) -> None:
        """Close every connection; exchanges still running fail with :class:`Broken`."""
        self._closed = True
        self._idle.clear()
        closing = list(self._open)
        self._open.clear()
        for conn in closing:
            conn.close()
        if closing:
            waits = [asyncio.ensure_future(_closed(c)) for c in closing]
            _, late = await asyncio.wait(waits, timeout=1.0)
            for task in late:  # a TLS goodbye that never came: stop waiting for it
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    async def _exchange(self, method: str, path: str, body: bytes | None) -> Response:
        conn = self._take()
        if conn is None:
            conn = await self._connect()
        try:
            response = await self._send(conn, method, path, body)
        except BaseException:  # any way out but a clean answer: the connection is spent
            self._drop(conn)
            raise
        self._release(conn)
        return response

    def _take(self) -> _Connection | None:
        if self._closed:
            raise Broken("the connection pool is closed")
        now = asyncio.get_running_loop().time()
        while self._idle:
            conn = self._idle.pop()
            if conn.usable(now, self._keepalive):
                return conn
            self._drop(conn)
        return None

    async def _connect(self) -> _Connection:
        context = ssl.create_default_context() if self._tls else None
        try:
            async with asyncio.timeout(self._connect_timeout):
                reader, writer = await asyncio.open_connection(
                    self._host, self._port, ssl=context, limit=_CHUNK
                )
        except TimeoutError:
            raise NotConnected(
                f"cannot connect to {self._host}:{self._port} within {self._connect_timeout:g}s"
            ) from None
        except OSError as exc:
            raise NotConnected(f"cannot connect to {self._host}:{self._port}: {exc}") from None
        conn = _Connection(reader, writer)
        if self._closed:  # closed while connecting
            conn.close()
            raise Broken("the connection pool is closed")
        self._open.add(conn)
        return conn

    async def _send(
        self, conn: _Connection, method: str, path: str, body: bytes | None
    ) -> Response:
        headers: list[tuple[str, str]] = list(self._headers)
        if body is not None:
            headers += [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        elif method != "GET":
            headers.append(("Content-Length", "0"))
        machine = conn.h11
        try:
            target = self._prefix + path
            out = machine.send(h11.Request(method=method, target=target, headers=headers))
            if body:
                out += machine.send(h11.Data(data=body))
            out += machine.send(h11.EndOfMessage())
            conn.writer.write(out)
            await conn.writer.drain()
            status, reason, parts = 0, "", []
            while True:
                event = machine.next_event()
                if event is h11.NEED_DATA:
                    machine.receive_data(await conn.reader.read(_CHUNK))
                elif isinstance(event, h11.Response):
                    status, reason = event.status_code, event.reason.decode("latin-1")
                elif isinstance(event, h11.Data):
                    parts.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    raise Broken("the server closed the connection before answering")
                # an InformationalResponse (100 Continue) needs nothing from us
        except (OSError, h11.ProtocolError) as exc:
            raise Broken(f"connection failed: {exc!r}") from None
        return Response(status, reason, b"".join(parts))

    def _release(self, conn: _Connection) -> None:
        machine = conn.h11
        if self._closed or machine.our_state is not h11.DONE or machine.their_state is not h11.DONE:
            self._drop(conn)  # the server asked to close, or the pool is shut
            return
        machine.start_next_cycle()
        now = asyncio.get_running_loop().time()
        conn.idle_since = now
        self._idle.append(conn)
        while self._idle and not self._idle[0].usable(now, self._keepalive):
            self._drop(self._idle.popleft())  # the oldest are the ones that expire

    def _drop(self, conn: _Connection) -> None:
        self._open.discard(conn)
        conn.close()


async def _closed(conn: _Connection) -> None:
    with contextlib.suppress(Exception):  # a reset on the way out changes nothing here
        await conn.writer.wait_closed()
