"""The gateway's memory stays flat over ten thousand requests abandoned by their clients.

A real RecordingGateway in front of a real RolloutServer, in this process (where a
trainer runs it); each request asks for a long generation and its client hangs up
right after sending, so the gateway must abort the generation and keep nothing of it.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import time

import httpx
import pytest

from dew.core import RolloutKey, SamplingParams, Task
from dew.demo.model import make_model, make_tokenizer
from dew.gateway import RecordingGateway
from dew.serving import RolloutServer
from tests.serving._launch import rss_kib

LONG = 1000  # tokens a request asks for: it would outlive the test had it not been aborted
N = 10_000  # abandoned requests per phase
WAVE = 32  # requests abandoned together
BODY = json.dumps(
    {"model": "dew", "messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG}
).encode()


def _engine_reaches(server: RolloutServer, count: int, what: str) -> None:
    """Wait until the engine holds ``count`` generations (pending or active)."""
    deadline = time.monotonic() + 30.0
    while True:
        stats = server.stats()
        if stats["pending"] + stats["active"] == count:
            return
        assert time.monotonic() < deadline, f"{what}: {stats}"
        time.sleep(0.002)


def _abandon(server: RolloutServer, gateway: RecordingGateway, first: int, n: int) -> None:
    """``n`` long chat requests, each on its own session, abandoned mid-generation.

    In waves of ``WAVE``: every request of a wave is sent, the clients wait until the
    engine is generating all of them, then hang up; the next wave starts once the
    gateway has aborted them all in the engine. Each session is then collected.
    """
    for start in range(first, first + n, WAVE):
        tokens, socks = [], []
        try:
            for i in range(start, min(start + WAVE, first + n)):
                token = gateway.open(Task("rss"), RolloutKey(i, 0, 0))
                head = (
                    "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                    "content-type: application/json\r\n"
                    f"authorization: Bearer {token}\r\ncontent-length: {len(BODY)}\r\n\r\n"
                ).encode()
                sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=10.0)
                socks.append(sock)
                tokens.append(token)
                sock.sendall(head + BODY)
            _engine_reaches(server, len(socks), f"wave {start}: not all generating")
        finally:
            for sock in socks:
                sock.close()
        _engine_reaches(server, 0, f"wave {start}: disconnects not aborted")
        for token in tokens:
            assert gateway.close_session(token).calls == ()  # aborted: nothing recorded


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gateway_memory_stays_flat_over_ten_thousand_aborted_requests() -> None:
    with (
        RolloutServer(make_model(max_positions=2048), max_batch=64) as server,
        RecordingGateway(
            server,
            make_tokenizer(),
            sampling=SamplingParams(max_tokens=LONG, stop_ids=()),
            max_turns=None,
        ) as gateway,
    ):
        # Warm up: allocator pools and caches grow over the first few thousand. After
        # that the only growth is the tombstones of collected sessions, bounded by
        # retain=65,536 (measured 2026-12-02: 401 MiB after 1,250, 404 after 10,000,
        # 407 after 20,000: ~300 bytes a tombstone).
        _abandon(server, gateway, 0, N)
        gc.collect()
        time.sleep(1.0)
        before = rss_kib(os.getpid())
        _abandon(server, gateway, N, N)
        gc.collect()
        time.sleep(2.0)
        after = rss_kib(os.getpid())
        # Had the aborts not been taken up, this would queue behind thousands of
        # 1,000-token generations: the short timeout tells.
        token = gateway.open(Task("after"), RolloutKey(2 * N, 0, 0))
        with httpx.Client(timeout=10.0) as http:
            r = http.post(
                f"{gateway.base_url}/chat/completions",
                content=BODY.replace(b'"max_tokens": 1000', b'"max_tokens": 2'),
                headers={"authorization": f"Bearer {token}", "content-type": "application/json"},
            )
        assert r.status_code == 200, r.text
        assert len(gateway.close_session(token).calls) == 1
        stats = server.stats()
        assert stats["active"] == 0 and stats["pending"] == 0, stats
    assert after - before < 16 * 1024, (before, after)  # KiB: under 16 MiB of growth
