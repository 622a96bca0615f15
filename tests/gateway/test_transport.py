"""The harness's HTTP transport: against a live gateway, and against raw sockets that
misbehave on purpose (no answer, an answer cut short, a closed keep-alive connection)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from dew.core import RolloutKey, SamplingParams, Task
from dew.demo.model import make_model, make_tokenizer
from dew.gateway import RecordingGateway
from dew.gateway._transport import LoopbackTransport, _quiet
from dew.serving import RolloutServer

TOK = make_tokenizer()
WAIT = 60.0


@pytest.fixture(scope="module")
def gateway() -> Iterator[RecordingGateway]:
    with (
        RolloutServer(make_model(max_positions=256), max_batch=8) as server,
        RecordingGateway(server, TOK, sampling=SamplingParams(max_tokens=8)) as gw,
    ):
        yield gw


def ask(client: openai.OpenAI, stream: bool) -> str:
    messages = [{"role": "user", "content": "digit 3"}]
    if not stream:
        out = client.chat.completions.create(model="dew", messages=messages, max_tokens=4)
        return out.choices[0].message.content or ""
    chunks = client.chat.completions.create(
        model="dew", messages=messages, max_tokens=4, stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.timeout(120)
def test_calls_and_streams_through_one_kept_connection(gateway: RecordingGateway) -> None:
    transport = LoopbackTransport()
    token = gateway.open(Task("t"), RolloutKey(0, 0, 0))
    with httpx.Client(transport=transport) as http:
        client = openai.OpenAI(
            base_url=gateway.base_url, api_key=token, http_client=http, max_retries=0
        )
        replies = [ask(client, stream=s) for s in (False, True, False, True)]
        assert len(transport._idle) == 1  # each exchange gave the connection back
        sock = transport._idle[0][0]
        ask(client, stream=False)
        assert [s for s, _ in transport._idle] == [sock]  # the same one, reused
    assert transport._idle == [] and sock.fileno() == -1  # closed with the client
    recording = gateway.close_session(token)
    # What the client read is what the gateway recorded, streamed or not.
    texts = [TOK.decode(list(c.completion), skip_special_tokens=True) for c in recording.calls]
    assert replies == texts[:4] and len(recording.calls) == 5


@pytest.mark.timeout(120)
def test_threads_share_a_transport_each_on_a_connection_of_its_own(
    gateway: RecordingGateway,
) -> None:
    transport = LoopbackTransport()
    together = threading.Barrier(4, timeout=WAIT)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        token = gateway.open(Task(str(i)), RolloutKey(1, i, 0))
        client = openai.OpenAI(
            base_url=gateway.base_url,
            api_key=token,
            http_client=httpx.Client(transport=transport),
            max_retries=0,
        )
        try:
            together.wait()
            ask(client, stream=i % 2 == 1)
        except BaseException as exc:  # kept for the assertion below
            errors.append(exc)
        finally:
            gateway.close_session(token)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert errors == [] and not any(t.is_alive() for t in threads)
    assert 1 <= len(transport._idle) <= 4  # never more connections than exchanges at once
    transport.close()


class RawServer:
    """A TCP listener on 127.0.0.1 whose one thread handles each connection with ``serve``."""

    def __init__(self, serve: Callable[[socket.socket], None], connections: int = 1) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1/x"
        self.stop = threading.Event()

        def run() -> None:
            for _ in range(connections):
                conn, _ = self.listener.accept()
                with conn:
                    serve(conn)

        self.thread = threading.Thread(target=run, name="raw-server")
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.listener.close()
        self.thread.join(WAIT)


def read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(4096)
    return data


def answer(body: bytes, *extra: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n" % len(body) + b"".join(extra)
    return head + b"\r\n" + body


@pytest.mark.timeout(60)
def test_an_answer_that_never_comes_is_a_read_timeout() -> None:
    server = RawServer(lambda conn: (read_request(conn), server.stop.wait(WAIT)))
    transport = LoopbackTransport()
    try:
        with httpx.Client(transport=transport, timeout=0.3) as http:
            with pytest.raises(httpx.ReadTimeout):
                http.post(server.url, content=b"{}")
        assert transport._idle == []  # the connection of a failed exchange is closed
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_an_answer_cut_short_is_a_protocol_error() -> None:
    def cut(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this")

    server = RawServer(cut)
    transport = LoopbackTransport()
    try:
        with httpx.Client(transport=transport, timeout=WAIT) as http:
            with pytest.raises(httpx.RemoteProtocolError, match="before its answer was complete"):
                http.post(server.url, content=b"{}")
        assert transport._idle == []
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_a_connection_the_server_closed_is_not_reused() -> None:
    seen: list[bytes] = []

    def once(conn: socket.socket) -> None:
        seen.append(read_request(conn))
        conn.sendall(answer(b"ok"))  # keep-alive by default, then closed by the server

    server = RawServer(once, connections=2)
    transport = LoopbackTransport()
    try:
        with httpx.Client(transport=transport, timeout=WAIT) as http:
            assert http.post(server.url, content=b'{"a": 1}').text == "ok"
            # The server has closed that connection; the next request opens another.
            for _ in range(100):
                if not _quiet(transport._idle[0][0]):
                    break
                server.stop.wait(0.05)
            assert http.post(server.url, content=b'{"a": 2}').text == "ok"
        # One write a request: the head and its whole body, with the length set once.
        assert seen[0].startswith(b"POST /v1/x HTTP/1.1\r\n")
        assert seen[0].lower().count(b"content-length: 8") == 1
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_a_stream_left_at_its_last_event_still_gives_its_connection_back() -> None:
    go, rest_sent = threading.Event(), threading.Event()

    def stream(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\nevent1\r\n")
        assert go.wait(WAIT)
        conn.sendall(b"0\r\n\r\n")  # the body's end, after the reader has stopped
        rest_sent.set()
        server.stop.wait(WAIT)  # the connection stays open: only the client may end it

    server = RawServer(stream)
    transport = LoopbackTransport()
    try:
        with httpx.Client(transport=transport, timeout=WAIT) as http:
            with http.stream("POST", server.url, content=b"{}") as response:
                # A reader that stops at its last event, as openai stops at [DONE].
                assert next(response.iter_raw()) == b"event1"
                go.set()
                # On loopback the server's send returns once the bytes are in the
                # client's socket: the end has arrived, unread.
                assert rest_sent.wait(WAIT)
            # Closing read the end that had arrived: the connection is whole and kept.
            assert len(transport._idle) == 1
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_a_streams_end_that_comes_just_after_the_reader_left_is_still_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    closing = threading.Event()

    def stream(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\nevent1\r\n")
        assert closing.wait(WAIT)  # the reader is closing, with the end not yet sent
        conn.sendall(b"0\r\n\r\n")  # as a busy server's end comes: a moment late
        server.stop.wait(WAIT)

    import dew.gateway._transport as transport_module

    quiet = transport_module._quiet

    def quiet_noting_the_close(sock: socket.socket, within: float = 0.0) -> bool:
        if within > 0:
            closing.set()
        return quiet(sock, within)

    monkeypatch.setattr(transport_module, "_quiet", quiet_noting_the_close)
    server = RawServer(stream)
    transport = LoopbackTransport()
    try:
        with httpx.Client(transport=transport, timeout=WAIT) as http:
            with http.stream("POST", server.url, content=b"{}") as response:
                assert next(response.iter_raw()) == b"event1"
            assert len(transport._idle) == 1  # the late end was read: the connection kept
    finally:
        server.close()


def test_quiet_tells_an_idle_connection_from_a_closed_or_chatty_one() -> None:
    a, b = socket.socketpair()
    try:
        assert _quiet(a)
        b.sendall(b"x")
        assert not _quiet(a)  # bytes nobody asked for
        a.recv(1)
        b.close()
        assert not _quiet(a)  # closed by the peer
    finally:
        a.close()


def test_only_plain_http_is_spoken() -> None:
    with httpx.Client(transport=LoopbackTransport()) as http:
        with pytest.raises(httpx.UnsupportedProtocol, match="plain HTTP"):
            http.get("https://127.0.0.1:1/v1/models")
