"""The HTTP transport under a callable harness's ``openai`` client: one write a request.

httpx's default transport (httpcore) writes a request's head and body in two ``send``
calls and parses the answer with h11 in Python. On loopback each ``send`` delivers its
segment to the gateway inside the call, so the gateway's event loop also wakes twice.
Profiled under ``bench/gateway.py``, that was a sizeable share of the harness's CPU per
call and of the gateway's (bench/RESULTS.md: "Figures moved out of code comments", and
"gateway: profile" for the CPU per call before and after). This transport writes each
request whole and parses the answer with httptools (C). It speaks plain HTTP/1.1 to one
host, as the gateway does.

Thread-safe: a harness may call from threads of its own. Each exchange holds its own
connection.

Invariants:

* A connection is either idle in the pool or held by exactly one exchange. Only a
  connection whose request and response both completed, and that the server did not
  ask to close, goes back to the pool; any other ending closes it at once.
* An idle connection older than ``keepalive`` seconds, or readable while idle (the
  server closed it, or sent what nobody asked for), is closed, never reused: a request
  sent on a connection the server is closing could fail after the server acted on it.
* :meth:`LoopbackTransport.close` closes every idle connection and marks the transport
  closed; an exchange still holding one closes it when it ends.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httptools
import httpx

__all__ = ["LoopbackTransport"]

_FINISH_WAIT = 0.5  # seconds a stream's unread end may take to arrive at close
_CHUNK = 1 << 16


class _Answer:
    """httptools' callbacks: the head and the body chunks parsed so far."""

    __slots__ = ("chunks", "complete", "headers", "headers_done", "keep_alive", "parser")

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.headers_done = False
        self.keep_alive = False
        self.complete = False
        self.parser: Any = None

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.headers_done = True
        # Asked now: once the message is complete the parser has reset and says False.
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(bytes(body))

    def on_message_complete(self) -> None:
        self.complete = True


class _Exchange(httpx.SyncByteStream):
    """One request on one connection; its iterator is the response body as it arrives."""

    def __init__(
        self, transport: LoopbackTransport, sock: socket.socket, request: httpx.Request
    ) -> None:
        self.transport = transport
        self.sock: socket.socket | None = sock
        self.request = request
        self.answer = _Answer()
        self.parser = self.answer.parser = httptools.HttpResponseParser(self.answer)

    def read_more(self) -> None:
        assert self.sock is not None
        try:
            data = self.sock.recv(_CHUNK)
        except TimeoutError:
            self.close()
            raise httpx.ReadTimeout("no answer within the timeout", request=self.request) from None
        except OSError as exc:
            self.close()
            raise httpx.ReadError(str(exc), request=self.request) from exc
        if not data:
            self.close()
            raise httpx.RemoteProtocolError(
                "the server closed the connection before its answer was complete",
                request=self.request,
            )
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.close()
            raise httpx.RemoteProtocolError(
                f"malformed answer: {exc}", request=self.request
            ) from exc

    def __iter__(self) -> Iterator[bytes]:
        answer = self.answer
        while True:
            while answer.chunks:
                yield answer.chunks.pop(0)
            if answer.complete:
                break
            self.read_more()
        self.close()

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is None:
            return
        if not self.answer.complete:
            # A reader that stops at the last event of a stream (the openai client stops
            # at "[DONE]") leaves the body's end unread: in the socket already, or just
            # behind it (a busy server writes it a moment later).
            self._finish_from(sock)
        if self.answer.complete and self.answer.keep_alive:
            self.transport._release(sock)
        else:
            sock.close()

    def _finish_from(self, sock: socket.socket) -> None:
        """Parse the rest of the answer if it arrives within ``_FINISH_WAIT`` seconds (a
        reader that left a long answer early does not wait longer than that)."""
        deadline = time.monotonic() + _FINISH_WAIT
        try:
            while not self.answer.complete:
                if _quiet(sock, max(0.0, deadline - time.monotonic())):
                    return  # nothing more in time: the caller closes it
                data = sock.recv(_CHUNK)  # something is there: this returns at once
                if not data:
                    return  # closed by the server
                self.parser.feed_data(data)
        except (OSError, httptools.HttpParserError):  # unusable: the caller closes it
            return


def _quiet(sock: socket.socket, within: float = 0.0) -> bool:
    """Whether a connection has nothing to read (waiting up to ``within`` seconds): not
    closed by the server, and no bytes that no request asked for. Asked with poll, which
    has no descriptor limit and leaves the socket's timeout mode alone (a peeking recv on
    a socket with a timeout read b"" from an open connection here)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLPRI)
    return not poller.poll(int(within * 1000))


class LoopbackTransport(httpx.BaseTransport):
    """Keep-alive HTTP/1.1 connections to the one host of the requests sent through it."""

    def __init__(self, *, keepalive: float = 4.0) -> None:
        self.keepalive = keepalive  # under uvicorn's 5 s: never reuse what it is closing
        self._lock = threading.Lock()
        self._idle: list[tuple[socket.socket, float]] = []
        self._closed = False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(
                f"this transport speaks plain HTTP to the gateway, not {url.scheme!r}",
                request=request,
            )
        timeouts: dict[str, Any] = request.extensions.get("timeout", {})
        body = request.read()
        head = [b"%s %s HTTP/1.1\r\n" % (request.method.encode("ascii"), url.raw_path)]
        for name, value in request.headers.raw:
            if name.lower() not in (b"content-length", b"transfer-encoding"):
                head.append(b"%s: %s\r\n" % (name, value))
        head.append(b"content-length: %d\r\n\r\n" % len(body))
        sock = self._take() or self._connect(url, timeouts.get("connect"), request)
        exchange = _Exchange(self, sock, request)
        try:
            sock.settimeout(timeouts.get("write"))
            sock.sendall(b"".join(head) + body)
        except OSError as exc:
            exchange.close()
            raise httpx.WriteError(str(exc), request=request) from exc
        sock.settimeout(timeouts.get("read"))
        while not exchange.answer.headers_done:
            exchange.read_more()
        return httpx.Response(
            exchange.parser.get_status_code(),
            headers=exchange.answer.headers,
            stream=exchange,
            extensions={"http_version": b"HTTP/1.1"},
            request=request,
        )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock, _ in idle:
            sock.close()

    def _connect(self, url: httpx.URL, timeout: float | None, request: httpx.Request) -> Any:
        try:
            sock = socket.create_connection((url.host, url.port or 80), timeout=timeout)
        except OSError as exc:
            raise httpx.ConnectError(str(exc), request=request) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _take(self) -> socket.socket | None:
        """An idle connection that is safe to reuse, or None."""
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._idle:
                    return None
                sock, since = self._idle.pop()
            if now - since < self.keepalive and _quiet(sock):
                return sock
            sock.close()

    def _release(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append((sock, time.monotonic()))
                return
        sock.close()
