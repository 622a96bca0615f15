"""Fuzzed request bodies against a live gateway: never a 5xx, never a half-recorded session."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dew.core import Rollout, RolloutKey, SamplingParams, Status, Task
from dew.demo.model import make_model, make_tokenizer
from dew.gateway import RecordingGateway
from dew.serving import RolloutServer
from tests._fuzz import json_values

TOK = make_tokenizer()
LIMIT = 2048
MAX_N = 3
BASE = {"model": "dew", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def gateway() -> Iterator[RecordingGateway]:
    with (
        RolloutServer(make_model(max_positions=128), max_batch=8) as server,
        RecordingGateway(
            server,
            TOK,
            max_body_bytes=LIMIT,
            sampling=SamplingParams(max_tokens=2),
            max_n=MAX_N,
            max_turns=None,
            max_tokens_per_session=None,
            client_sampling=True,  # so the fuzzed sampling values reach the engine
        ) as gw,
    ):
        yield gw


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60.0) as h:
        yield h


field_names = st.sampled_from(
    [
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "n",
        "stop",
        "stream",
        "stream_options",
        "logprobs",
        "top_logprobs",
        "tools",
        "prompt",
        "logit_bias",
        "seed",
        "echo",
        "presence_penalty",
    ]
)
huge = st.sampled_from([2**31, 2**63, 10**20, -1, 0, 10**4000 // 10**3990])
# Sampling values a sampler can choke on: near 0 (logits / t overflow) and far past
# any sensible range.
extreme = st.sampled_from([5e-324, 1e-300, 1e-40, 1e-9, 5e-3, 1e300, 1.7e308]) | st.floats(
    min_value=0.0, max_value=1e-2
)
message_values = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
            "content": st.one_of(st.text(max_size=20), json_values),
        }
    ),
    max_size=3,
)


@st.composite
def mutated(draw: Any) -> bytes:
    body: dict[str, Any] = dict(BASE)
    body["prompt"] = draw(st.sampled_from(["hi", [5, 6], "", [10**9]]))
    for _ in range(draw(st.integers(0, 3))):
        name = draw(field_names)
        choice = draw(st.integers(0, 3))
        if choice == 0:
            body.pop(name, None)
        elif choice == 1:
            body[name] = draw(json_values)
        elif choice == 2:
            body[name] = draw(huge)
        elif name == "messages":
            body[name] = draw(message_values)
        else:
            body[name] = draw(extreme)
    for name in ("temperature", "top_p", "top_k"):
        if draw(st.integers(0, 3)) == 0:
            body[name] = draw(extreme | huge)
    if draw(st.booleans()):
        body["n"] = draw(st.integers(1, MAX_N))
    if draw(st.booleans()):
        body["stream"] = True
    return json.dumps(body, allow_nan=True).encode()


raw_bodies = st.one_of(
    mutated(),
    st.binary(max_size=200),
    st.sampled_from(
        [
            b"",
            b"null",
            b"[]",
            b"{",
            b'{"messages": [}',
            b"[" * 1500,
            b'{"a": NaN}',
            b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
            b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
            b"1" * 5000,
            json.dumps({**BASE, "pad": "x" * LIMIT}).encode(),
        ]
    ),
    mutated().map(lambda b: b[: len(b) // 2]),
)


def sse_events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]


FUZZ = {
    "body": raw_bodies,
    "path": st.sampled_from(["chat/completions", "completions"]),
    "counter": st.integers(0, 2**31),
}


@pytest.mark.timeout(600)
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(**FUZZ)
def test_fuzzed_bodies_never_5xx_and_never_half_record(gateway, http, body, path, counter):
    check_one(gateway, http, body, path, counter)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
@given(**FUZZ)
def test_thousands_of_fuzzed_bodies_leave_the_gateway_healthy(gateway, http, body, path, counter):
    check_one(gateway, http, body, path, counter)


def test_the_gateway_is_healthy_after_the_fuzzing(gateway, http) -> None:
    # Runs after the fuzz tests of this module (pytest keeps file order): still serving.
    token = gateway.open(Task("after"), RolloutKey(2**31 + 1, 0, 0))  # beyond the fuzzed keys
    r = http.post(
        f"{gateway.base_url}/chat/completions",
        json=BASE,
        headers={"authorization": f"Bearer {token}"},
    )
    assert r.status_code == 200, r.text
    assert len(gateway.close_session(token).calls) == 1


def check_one(gateway: RecordingGateway, http: Any, body: bytes, path: str, counter: int) -> None:
    """One fuzzed request: a 2xx or a 4xx naming the problem, and a recording that is
    either empty (refused) or exactly what was answered."""
    key = RolloutKey(counter, 0, 0)
    token = gateway.open(Task("fuzz"), key)
    # Another session's well-formed call in flight beside it: whatever the fuzzed
    # request sent, that call is answered and recorded whole.
    other = gateway.open(Task("canary"), RolloutKey(counter, 1, 0))
    with ThreadPoolExecutor(1) as pool:
        canary = pool.submit(
            http.post,
            f"{gateway.base_url}/chat/completions",
            json={**BASE, "max_tokens": 2},
            headers={"authorization": f"Bearer {other}"},
        )
        r = http.post(
            f"{gateway.base_url}/{path}",
            content=body,
            headers={"authorization": f"Bearer {token}", "content-type": "application/json"},
        )
        c = canary.result()
    assert c.status_code == 200, (body[:300], c.text)
    assert len(gateway.close_session(other).calls) == 1
    recording = gateway.close_session(token)
    event(f"status {r.status_code}")
    assert r.status_code < 500, r.text
    calls = recording.calls
    if r.status_code != 200:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert calls == ()
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = sse_events(r.text)
        if events[-1] != "[DONE]":  # the stream reported an error: nothing recorded
            assert "error" in json.loads(events[-1]) and calls == ()
            return
        chunks = [json.loads(e) for e in events[:-1]]
        n = len(chunks[0]["choices"])
    else:
        answer = r.json()
        n = len(answer["choices"])
        assert answer["usage"]["completion_tokens"] == sum(len(c.completion) for c in calls)
        assert answer["usage"]["prompt_tokens"] == len(calls[0].prompt)
    assert len(calls) == n >= 1
    # Every recorded call is a valid rollout call (lengths, versions, log-probs).
    Rollout(key, Task("fuzz"), Status.COMPLETED, calls, reward=0.0)
