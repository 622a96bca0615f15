"""Slow and greedy clients against a live gateway: bounded, answered, never tying it up."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from dew.core import RolloutKey, SamplingParams, Task
from dew.demo.model import make_model, make_tokenizer
from dew.gateway import RecordingGateway
from dew.serving import RolloutServer

TOK = make_tokenizer()


@pytest.fixture(scope="module")
def server() -> Iterator[RolloutServer]:
    with RolloutServer(make_model(max_positions=128), max_batch=8) as s:
        yield s


def _connect(gw: RecordingGateway) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", gw.port), timeout=10.0)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(4096):
        out += chunk
    return out


@pytest.mark.timeout(60)
def test_a_client_that_trickles_its_request_gets_a_408_while_others_are_served(server) -> None:
    sampling = SamplingParams(max_tokens=2)
    with RecordingGateway(server, TOK, sampling=sampling, read_timeout=1.0) as gw:
        token = gw.open(Task("t"), RolloutKey(0, 0, 0))
        silent = _connect(gw)  # connects and sends nothing
        trickle = _connect(gw)
        body_slow = _connect(gw)
        try:
            trickle.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            body_slow.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"content-type: application/json\r\ncontent-length: 200\r\n\r\n{"
            )
            # Meanwhile a well-behaved client is served at once.
            t0 = time.monotonic()
            ok = httpx.post(
                f"{gw.base_url}/chat/completions",
                headers={"authorization": f"Bearer {token}"},
                json={"model": "dew", "messages": [{"role": "user", "content": "hi"}]},
                timeout=10.0,
            )
            assert ok.status_code == 200 and time.monotonic() - t0 < 1.0
            for sock in (silent, trickle, body_slow):
                t0 = time.monotonic()
                answer = _read_all(sock)  # the server closes it
                assert answer.startswith(b"HTTP/1.1 408"), answer
                assert time.monotonic() - t0 < 3.0
        finally:
            for sock in (silent, trickle, body_slow):
                sock.close()
        record = gw.close_session(token)
        assert len(record.calls) == 1 and gw.running  # the slow ones recorded nothing


@pytest.mark.timeout(60)
def test_past_max_connections_a_request_gets_a_503(server) -> None:
    with RecordingGateway(server, TOK, max_connections=2, read_timeout=5.0) as gw:
        held = [_connect(gw) for _ in range(2)]
        try:
            time.sleep(0.2)  # both are accepted and counted
            with httpx.Client(timeout=5.0) as c:
                answer = c.get(f"{gw.base_url}/models")
            assert answer.status_code == 503
        finally:
            for sock in held:
                sock.close()
        time.sleep(0.2)
        with httpx.Client(timeout=5.0) as c:
            assert c.get(f"{gw.base_url}/models").status_code != 503


def test_the_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="read_timeout must be > 0"):
        RecordingGateway(object(), TOK, read_timeout=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_connections must be an int >= 1"):
        RecordingGateway(object(), TOK, max_connections=0)  # type: ignore[arg-type]
