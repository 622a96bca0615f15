"""What the HTTP servers dew starts (``dew serve``, the recording gateway) share: binding
a listening socket, uvicorn's settings and server. Imports nothing of dew; uvicorn loads
only inside the functions that need it, so importing this module stays cheap.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections.abc import Callable
from typing import Any

__all__ = [
    "API_KEY_ENV",
    "bind",
    "http_with_read_timeout",
    "is_loopback",
    "uvicorn_config",
    "uvicorn_server",
]

API_KEY_ENV = "DEW_API_KEY"  # where servers and clients find the API key when not given


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (``localhost`` counts; other names do not,
    since a name may resolve anywhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int, backlog: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: a free port) and listening; the caller
    owns it. Bound here rather than by uvicorn so that the real port is known."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


# What a client that sends too slowly gets before the connection closes.
_TOO_SLOW_BODY = b"the request did not arrive in time: closed"
_TOO_SLOW_HEADERS = [
    (b"content-type", b"text/plain; charset=utf-8"),
    (b"content-length", str(len(_TOO_SLOW_BODY)).encode()),
    (b"connection", b"close"),
]


def http_with_read_timeout(seconds: float) -> type:
    """uvicorn's httptools protocol where each request must arrive whole within ``seconds``.

    httptools parses in C; uvicorn's h11 protocol, pure Python, was a large share of a
    gateway call's time on the event loop (bench/RESULTS.md, "gateway: profile").
    uvicorn bounds only the idle time between two requests; a client that connects and
    sends nothing, or trickles its headers or body a byte at a time, would hold its
    connection for good. Here a deadline starts when the connection opens and with the
    first bytes of each later request, and ends once the request is complete (the
    handler's own time is not bounded); a client that misses it gets a 408 and the
    connection closes. Invariant: at most one deadline is armed per connection, and it
    is cancelled when the connection is lost.
    """
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    if not seconds > 0:
        raise ValueError(f"read_timeout={seconds!r} must be > 0 seconds")

    class ReadDeadlineHttp(HttpToolsProtocol):  # type: ignore[misc]
        _deadline: Any = None
        _receiving = False  # from a request's first parsed byte to its last
        _headers_in = False  # the current request's headers are complete

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._deadline is None and not self._receiving:
                self._arm()  # the first bytes of the next request on this connection
            super().data_received(data)

        def on_message_begin(self) -> None:
            self._receiving, self._headers_in = True, False
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._headers_in = True
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._receiving = False
            self._disarm()  # the request is in
            super().on_message_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            answer = True
            if self._receiving and self._headers_in:  # a handler may wait on the body
                self.cycle.disconnected = True  # it must not answer: we do, and close
                answer = not self.cycle.response_started
            if answer:
                head = b"".join(b"%s: %s\r\n" % kv for kv in _TOO_SLOW_HEADERS)
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\n" + head + b"\r\n")
                self.transport.write(_TOO_SLOW_BODY)
            self.transport.close()

    return ReadDeadlineHttp


def uvicorn_config(
    app: Any,
    *,
    read_timeout: float,
    max_connections: int,
    graceful_shutdown: float,
    keep_alive: float | None = None,
) -> Any:
    """The ``uvicorn.Config`` of one of dew's servers, serving ``app`` (an ASGI app with
    no lifespan and no websockets) on a socket the caller binds.

    A slow client (headers or body trickled) gets a 408 after ``read_timeout`` seconds
    rather than holding its connection (:func:`http_with_read_timeout`); past
    ``max_connections`` open connections a request gets a 503. ``graceful_shutdown``:
    seconds the requests under way get once the server stops. ``keep_alive``: seconds
    an idle connection stays open (``None``: uvicorn's default, 5 s).
    """
    import uvicorn

    extra: dict[str, Any] = {} if keep_alive is None else {"timeout_keep_alive": keep_alive}
    return uvicorn.Config(
        app,
        log_config=None,
        access_log=False,
        lifespan="off",
        http=http_with_read_timeout(read_timeout),
        limit_concurrency=max_connections + 1,  # uvicorn counts the new one
        ws="none",
        loop="asyncio",
        timeout_graceful_shutdown=graceful_shutdown,
        **extra,
    )


def uvicorn_server(
    config: Any,
    *,
    ready: threading.Event | None = None,
    on_listening: Callable[[], None] | None = None,
    on_shutdown: Callable[[], None] | None = None,
) -> Any:
    """A ``uvicorn.Server`` for ``config``: ``on_listening`` runs once it listens;
    ``ready`` is set once its startup is over, listening or failed (what a thread
    waiting for it waits on); ``on_shutdown`` runs when it begins to shut down, before
    uvicorn waits for the requests under way."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            try:
                await super().startup(sockets)
                if self.started and on_listening is not None:
                    on_listening()
            finally:
                if ready is not None:
                    ready.set()

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            if on_shutdown is not None:
                on_shutdown()
            await super().shutdown(sockets)

    return Server(config)
