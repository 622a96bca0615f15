"""The HTTP/1.1 pool under HTTPEngine, against scripted servers on 127.0.0.1.

Each server here is a real asyncio TCP server the test scripts byte by byte, so the
faults (a connection closed mid-answer, an idle connection the server drops, a server
that never answers) happen exactly where the test puts them.
"""

from __future__ import annotations

import asyncio
import gc
import json
import warnings
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from dew.serving._http_client import Broken, NotConnected, Pool, TimedOut

pytestmark = pytest.mark.timeout(60)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def ok(body: dict[str, Any], *, close: bool = False) -> bytes:
    data = json.dumps(body).encode()
    head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n"
    if close:
        head += "connection: close\r\n"
    return head.encode() + b"\r\n" + data


async def read_request(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes]:
    """One request off the wire (request line, headers, a content-length body)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return lines[0], headers, body


class Server:
    """A TCP server on 127.0.0.1 running ``handler`` per connection; counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            await self.handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self.tasks.discard(task)


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers every request on the connection with its request line and body."""
    while True:
        line, headers, body = await read_request(reader)
        writer.write(ok({"line": line, "body": body.decode(), "host": headers["host"]}))
        await writer.drain()


def pool(url: str, **kw: Any) -> Pool:
    args: dict[str, Any] = {"headers": {}, "limit": 4, "connect_timeout": 2.0, "keepalive": 30.0}
    return Pool(url, **(args | kw))


def run(coro: Awaitable[None]) -> None:
    """Run one test's coroutine; unclosed sockets or transports fail the test."""

    async def main() -> None:
        await coro

    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        asyncio.run(main())
        gc.collect()


def test_requests_reuse_one_kept_alive_connection() -> None:
    async def body() -> None:
        async with Server(echo) as server:
            p = pool(server.url + "/v1", headers={"Authorization": "Bearer k"})
            for i in range(5):
                r = await p.request("POST", "/generate", b'{"i": %d}' % i, timeout=5)
                got = json.loads(r.body)
                assert r.status == 200
                assert got["line"] == "POST /v1/generate HTTP/1.1"
                assert json.loads(got["body"]) == {"i": i}
                assert got["host"] == server.url.removeprefix("http://")
            r = await p.request("GET", "/health", None, timeout=5)
            assert json.loads(r.body)["line"] == "GET /v1/health HTTP/1.1"
            assert server.connections == 1
            await p.aclose()

    run(body())


def test_no_more_connections_than_the_limit() -> None:
    release = asyncio.Event()
    peak = [0, 0]  # open now, most open at once

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peak[0] += 1
        peak[1] = max(peak)
        try:
            while True:
                await read_request(reader)
                await release.wait()
                writer.write(ok({}))
                await writer.drain()
        finally:
            peak[0] -= 1

    async def body() -> None:
        async with Server(slow) as server:
            p = pool(server.url, limit=3)
            calls = [
                asyncio.ensure_future(p.request("GET", "/", None, timeout=10)) for _ in range(9)
            ]
            while server.connections < 3:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)  # a fourth connection would have been opened by now
            assert server.connections == 3
            release.set()
            assert [r.status for r in await asyncio.gather(*calls)] == [200] * 9
            assert server.connections == 3 and peak[1] == 3
            await p.aclose()

    run(body())


def test_an_idle_connection_the_server_closed_is_not_reused() -> None:
    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(ok({"n": 1}))  # keep-alive answer, then the server drops it anyway
        await writer.drain()

    async def body() -> None:
        async with Server(once) as server:
            p = pool(server.url)
            assert (await p.request("GET", "/", None, timeout=5)).status == 200
            await asyncio.sleep(0.1)  # the close reaches the idle connection
            assert (await p.request("GET", "/", None, timeout=5)).status == 200
            assert server.connections == 2
            await p.aclose()

    run(body())


def test_keepalive_drops_connections_idle_too_long() -> None:
    async def body() -> None:
        async with Server(echo) as server:
            p = pool(server.url, keepalive=0.2)
            await p.request("GET", "/", None, timeout=5)
            await p.request("GET", "/", None, timeout=5)
            assert server.connections == 1
            await asyncio.sleep(0.3)
            await p.request("GET", "/", None, timeout=5)
            assert server.connections == 2
            await p.aclose()

    run(body())


def test_connection_close_is_honoured() -> None:
    async def closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(ok({}, close=True))
        await writer.drain()
        await reader.read()  # the client closes its end

    async def body() -> None:
        async with Server(closing) as server:
            p = pool(server.url)
            for _ in range(3):
                assert (await p.request("GET", "/", None, timeout=5)).status == 200
            assert server.connections == 3
            await p.aclose()

    run(body())


def test_a_chunked_answer_is_read_whole() -> None:
    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\ntransfer-encoding: chunked\r\n\r\n")
        for part in (b'{"detail": ', b'"boom"}'):
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def body() -> None:
        async with Server(chunked) as server:
            p = pool(server.url)
            r = await p.request("POST", "/x", b"{}", timeout=5)
            assert (r.status, r.reason, json.loads(r.body)) == (
                500,
                "Internal Server Error",
                {"detail": "boom"},
            )
            await p.aclose()

    run(body())


def test_a_refused_connection_is_not_connected() -> None:
    async def body() -> None:
        async with Server(echo) as server:
            url = server.url
        p = pool(url)  # the server is gone: its port refuses
        with pytest.raises(NotConnected, match=r"cannot connect to 127\.0\.0\.1"):
            await p.request("GET", "/", None, timeout=5)
        await p.aclose()

    run(body())


def test_a_connection_broken_mid_answer_is_broken() -> None:
    async def half(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{"partial')
        await writer.drain()

    async def body() -> None:
        async with Server(half) as server:
            p = pool(server.url)
            with pytest.raises(Broken):
                await p.request("POST", "/generate", b"{}", timeout=5)
            await p.aclose()

    run(body())


def test_garbage_from_the_server_is_broken() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"this is not http\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def body() -> None:
        async with Server(garbage) as server:
            p = pool(server.url)
            with pytest.raises(Broken, match="connection failed"):
                await p.request("GET", "/", None, timeout=5)
            await p.aclose()

    run(body())


def test_a_server_that_never_answers_times_out_and_its_connection_is_closed() -> None:
    closed = asyncio.Event()

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()  # returns when the client closes its end
        closed.set()

    async def body() -> None:
        async with Server(mute) as server:
            p = pool(server.url)
            with pytest.raises(TimedOut, match=r"within 0\.2s"):
                await p.request("GET", "/", None, timeout=0.2)
            await asyncio.wait_for(closed.wait(), 5)
            await p.aclose()

    run(body())


def test_a_cancelled_request_closes_its_connection() -> None:
    closed = asyncio.Event()
    received = asyncio.Event()

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        received.set()
        await reader.read()
        closed.set()

    async def body() -> None:
        async with Server(mute) as server:
            p = pool(server.url)
            call = asyncio.ensure_future(p.request("GET", "/", None, timeout=30))
            await asyncio.wait_for(received.wait(), 5)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            await asyncio.wait_for(closed.wait(), 5)  # the server saw the disconnect
            await p.aclose()

    run(body())


def test_aclose_closes_connections_in_use_and_refuses_more() -> None:
    received = asyncio.Event()

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        received.set()
        await reader.read()

    async def body() -> None:
        async with Server(mute) as server:
            p = pool(server.url)
            call = asyncio.ensure_future(p.request("GET", "/", None, timeout=30))
            await asyncio.wait_for(received.wait(), 5)
            await p.aclose()
            with pytest.raises(Broken):
                await call
            with pytest.raises(Broken, match="closed"):
                await p.request("GET", "/", None, timeout=5)

    run(body())


def test_waiting_for_a_free_connection_counts_against_the_timeout() -> None:
    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()

    async def body() -> None:
        async with Server(mute) as server:
            p = pool(server.url, limit=1)
            first = asyncio.ensure_future(p.request("GET", "/", None, timeout=30))
            await asyncio.sleep(0.1)
            with pytest.raises(TimedOut):
                await p.request("GET", "/", None, timeout=0.2)
            assert server.connections == 1  # the second never got a connection
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            await p.aclose()

    run(body())


def test_bad_urls_are_refused() -> None:
    for url in ("ftp://host", "http://", "127.0.0.1:80"):
        with pytest.raises(ValueError, match="url must be an http"):
            pool(url)
