"""RecordingGateway end to end: the official openai client, a real RolloutServer, 127.0.0.1."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest
import torch

from dew.core import Aborted, Call, Rollout, RolloutKey, SamplingParams, Status, Task
from dew.demo.model import make_model, make_tokenizer
from dew.gateway import RecordingGateway
from dew.objectives.rl.chains import chains, merge_ratio
from dew.serving import RolloutServer

TOK = make_tokenizer()
EOS = TOK.eos_token_id
WAIT = 30.0  # seconds; every wait here is on an event, bounded by this


@pytest.fixture(scope="module")
def model() -> Any:
    return make_model(max_positions=256, seed=1)


@pytest.fixture(scope="module")
def server(model: Any) -> Iterator[RolloutServer]:
    with RolloutServer(model, max_batch=16, seed=0) as s:
        yield s


@contextmanager
def running(engine: Any, **kw: Any) -> Iterator[RecordingGateway]:
    kw.setdefault("sampling", SamplingParams(max_tokens=6))
    with RecordingGateway(engine, TOK, **kw) as gw:
        yield gw


@contextmanager
def client(gw: RecordingGateway, token: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gw.base_url, api_key=token, max_retries=0, timeout=WAIT) as c:
        yield c


def template_ids(messages: list[dict]) -> list[int]:
    return list(
        TOK.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    )


def content_ids(call: Call) -> list[int]:
    ids = [int(t) for t in call.completion]
    return ids[:-1] if call.finish_reason == "stop" and ids[-1] == EOS else ids


def teacher_log_probs(model: Any, call: Call) -> list[float]:
    ids = torch.tensor([[int(t) for t in call.prompt] + [int(t) for t in call.completion]])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits / call.temperature, -1)
    n = len(call.prompt)
    return [lp[n - 1 + i, int(t)].item() for i, t in enumerate(call.completion)]


def toy_tool_agent(c: openai.OpenAI, turns: int) -> tuple[list[list[dict]], list[str]]:
    """Asks, runs a 'count' tool on each reply, sends the result back; returns what it sent."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "count",
                "description": "count characters",
                "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
            },
        }
    ]
    messages: list[dict] = [
        {"role": "system", "content": "You may call count(text)."},
        {"role": "user", "content": "How long is your answer?"},
    ]
    sent, replies = [], []
    for turn in range(turns):
        sent.append([dict(m) for m in messages])
        r = c.chat.completions.create(
            model="dew", messages=messages, tools=tools, max_tokens=5 + turn
        )
        reply = r.choices[0].message.content
        assert r.choices[0].finish_reason in ("stop", "length")
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply})
        messages.append(
            {
                "role": "tool",
                "tool_call_id": f"call-{turn}",
                "content": json.dumps({"count": len(reply)}),
            }
        )
    return sent, replies


@pytest.mark.timeout(120)
def test_multi_turn_tool_agent_records_exactly_what_the_engine_produced(spy, model):
    with running(spy) as gw:
        token = gw.open(Task("t"), RolloutKey(0, 0, 0))
        with client(gw, token) as c:
            sent, replies = toy_tool_agent(c, turns=3)
        rec = gw.close_session(token)
    assert len(rec.calls) == 3
    assert all(a is b for a, b in zip(rec.calls, spy.calls, strict=True))
    for call, messages, reply in zip(rec.calls, sent, replies, strict=True):
        assert [int(t) for t in call.prompt] == template_ids(messages)
        assert TOK.decode(content_ids(call), skip_special_tokens=False) == reply
        assert call.version == spy.version and call.support is None
        assert list(call.log_probs) == pytest.approx(teacher_log_probs(model, call), abs=2e-3)
    assert len(chains(rec.calls)) == 1
    rollout = Rollout(RolloutKey(0, 0, 0), Task("t"), Status.COMPLETED, rec.calls, reward=1.0)
    assert merge_ratio([rollout]) == 1.0
    assert rec.turns == 3 and rec.tokens == sum(len(c.completion) for c in rec.calls)
    assert rec.truncation is None and rec.error is None


@pytest.mark.timeout(120)
def test_streaming_and_non_streaming_answers_match_the_recording(spy):
    messages = [{"role": "user", "content": "stream please"}]
    with running(spy) as gw:
        token = gw.open(Task("t"), RolloutKey(0, 0, 0))
        with client(gw, token) as c:
            plain = c.chat.completions.create(model="dew", messages=messages, logprobs=True)
            chunks = list(
                c.chat.completions.create(
                    model="dew",
                    messages=messages,
                    stream=True,
                    logprobs=True,
                    stream_options={"include_usage": True},
                )
            )
            text = c.completions.create(model="dew", prompt="abc", logprobs=0, max_tokens=4)
            text_chunks = list(
                c.completions.create(model="dew", prompt=[7, 8, 9], stream=True, max_tokens=4)
            )
        rec = gw.close_session(token)
    assert len(rec.calls) == 4
    first, second, third, fourth = rec.calls
    # Non-streaming chat.
    assert plain.choices[0].message.content == TOK.decode(content_ids(first))
    lps = [x.logprob for x in plain.choices[0].logprobs.content]
    assert lps == pytest.approx(list(first.log_probs)[: len(content_ids(first))])
    assert plain.usage.prompt_tokens == len(first.prompt)
    assert plain.usage.completion_tokens == len(first.completion)
    # Streaming chat: the role first, a chunk per content token, the finish, the usage.
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [
        ch.choices[0].delta.content
        for ch in chunks[1:]
        if ch.choices and ch.choices[0].delta.content
    ]
    assert "".join(deltas) == TOK.decode(content_ids(second))
    streamed = [
        ch.choices[0].logprobs.content[0].logprob
        for ch in chunks[1:]
        if ch.choices and ch.choices[0].logprobs
    ]
    assert streamed == pytest.approx(list(second.log_probs)[: len(content_ids(second))])
    finishes = [
        ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason
    ]
    assert finishes == [second.finish_reason]
    assert chunks[-1].usage.completion_tokens == len(second.completion)
    assert list(second.prompt) == list(first.prompt)  # same messages, same prompt
    # Completions, text and token prompts.
    assert [int(t) for t in third.prompt] == list(TOK("abc")["input_ids"])
    assert text.choices[0].text == TOK.decode(content_ids(third))
    assert text.choices[0].logprobs.token_logprobs == pytest.approx(
        list(third.log_probs)[: len(content_ids(third))]
    )
    assert [int(t) for t in fourth.prompt] == [7, 8, 9]
    assert "".join(ch.choices[0].text for ch in text_chunks if ch.choices) == TOK.decode(
        content_ids(fourth)
    )


@pytest.mark.timeout(120)
def test_n_choices_are_recorded_as_one_call_each(spy):
    with running(spy) as gw:
        token = gw.open(Task("t"), RolloutKey(0, 0, 0))
        with client(gw, token) as c:
            r = c.chat.completions.create(
                model="dew", n=3, max_tokens=3, messages=[{"role": "user", "content": "x"}]
            )
        rec = gw.close_session(token)
    assert len(r.choices) == 3 and len(rec.calls) == 3
    assert {tuple(c.prompt) for c in rec.calls} == {tuple(rec.calls[0].prompt)}
    for choice, call in zip(r.choices, rec.calls, strict=True):
        assert choice.message.content == TOK.decode(content_ids(call))
    assert r.usage.completion_tokens == sum(len(c.completion) for c in rec.calls)


@pytest.mark.timeout(120)
def test_sampling_is_the_gateways_unless_clients_may_choose(spy):
    ask = {
        "model": "dew",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 2,
        "temperature": 0.3,
        "top_p": 0.5,
        "stop": ["\n", "END"],
    }
    with running(spy, sampling=SamplingParams(max_tokens=6, temperature=0.9)) as gw:
        token = gw.open(Task("t"), RolloutKey(7, 0, 0))
        with client(gw, token) as c:
            c.chat.completions.create(**ask)
        gw.close_session(token)
    p = spy.params[-1]
    assert spy.affinities[-1] == 7  # the session's group: a fleet keeps it on one engine
    assert (p.temperature, p.top_p, p.top_k) == (0.9, None, None)
    newline = TOK("\n", add_special_tokens=False)["input_ids"][0]
    assert set(p.stop_ids) == {EOS, newline}
    with running(spy, client_sampling=True) as gw:
        token = gw.open(Task("t"), RolloutKey(0, 1, 0))
        with client(gw, token) as c:
            c.chat.completions.create(**ask)
            with pytest.raises(openai.BadRequestError, match="temperature"):
                c.chat.completions.create(**{**ask, "temperature": 0})
        rec = gw.close_session(token)
    p = spy.params[-1]
    assert (p.temperature, p.top_p) == (0.3, 0.5)
    assert len(rec.calls) == 1 and rec.calls[0].support is not None


@pytest.mark.timeout(120)
def test_one_sessions_extreme_sampling_fails_its_own_request_alone(server, model):
    ask = {"model": "dew", "messages": [{"role": "user", "content": "x"}], "max_tokens": 40}
    with running(server, client_sampling=True, sampling=SamplingParams(max_tokens=40)) as gw:
        calm, wild = (gw.open(Task("t"), RolloutKey(0, i, 0)) for i in range(2))
        with client(gw, calm) as a, client(gw, wild) as b:
            worker = threading.Thread(target=lambda: a.chat.completions.create(**ask))
            worker.start()
            for extreme in ({"temperature": 1e-300}, {"temperature": 5e-3}):
                with pytest.raises(openai.BadRequestError, match="temperature"):
                    b.chat.completions.create(**{**ask, **extreme})
            b.chat.completions.create(**{**ask, "top_p": 1e-300})  # extreme, yet well-defined
            worker.join(WAIT)
            assert not worker.is_alive()
        calm_rec, wild_rec = gw.close_session(calm), gw.close_session(wild)
    assert len(calm_rec.calls) == 1 and len(wild_rec.calls) == 1
    for call in calm_rec.calls:
        assert call.log_probs == pytest.approx(teacher_log_probs(model, call), abs=2e-4)


@pytest.mark.timeout(60)
def test_models_endpoint(spy):
    with running(spy, model_name="policy") as gw:
        token = gw.open(Task("t"), RolloutKey(0, 0, 0))
        with client(gw, token) as c:
            assert [m.id for m in c.models.list()] == ["policy"]
            assert c.models.retrieve("policy").id == "policy"
            with pytest.raises(openai.NotFoundError):
                c.models.retrieve("gpt-4")
        with client(gw, "dew-wrong") as c, pytest.raises(openai.AuthenticationError):
            c.models.list()
        gw.close_session(token)


def post(
    gw: RecordingGateway,
    token: str | None,
    body: bytes | str,
    path: str = "chat/completions",
    **headers: str,
) -> httpx.Response:
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    if isinstance(body, str):
        body = body.encode()
    return httpx.post(f"{gw.base_url}/{path}", content=body, headers=headers, timeout=WAIT)


CHAT = json.dumps({"model": "dew", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})


@pytest.mark.timeout(120)
def test_rejected_requests_record_nothing(spy):
    with running(spy, max_body_bytes=4096, max_turns=2, max_tokens_per_session=5) as gw:
        token = gw.open(Task("t"), RolloutKey(3, 1, 0))
        secret = "dew-not-a-real-key-1234567890"
        r = post(gw, secret, CHAT)
        assert r.status_code == 401 and secret not in r.text
        assert r.headers["x-should-retry"] == "false"
        assert post(gw, None, CHAT).status_code == 401
        big = json.dumps({"messages": [{"role": "user", "content": "x" * 5000}]})
        r = post(gw, token, big)
        assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"]
        # Chunked, with no Content-Length: counted as it arrives.
        r = httpx.post(
            f"{gw.base_url}/chat/completions",
            content=iter([big.encode()] * 3),
            headers={"authorization": f"Bearer {token}"},
            timeout=WAIT,
        )
        assert r.status_code == 413
        r = post(gw, token, "{not json")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = post(gw, token, '{"messages": [{"role": "user", "content": "x"}], "n": "2"}')
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        missing = post(gw, token, "{}", path="nowhere")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        # A known path with the wrong method: 405 naming the one it takes, in the same shape.
        wrong = httpx.get(f"{gw.base_url}/chat/completions", timeout=WAIT)
        assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
        assert wrong.json()["error"]["message"] == "Method Not Allowed"
        assert post(gw, token, "{}", path="models").status_code == 405
        assert not spy.calls
        with client(gw, token) as c:
            first = c.chat.completions.create(
                model="dew", max_tokens=4, messages=[{"role": "user", "content": "x"}]
            )
            assert first.usage.completion_tokens <= 4
            # The budget has at most one token left: clamped, finishing on length.
            second = c.chat.completions.create(
                model="dew", max_tokens=4, messages=[{"role": "user", "content": "y"}]
            )
            with pytest.raises(openai.BadRequestError) as info:
                c.chat.completions.create(model="dew", messages=[{"role": "user", "content": "z"}])
            assert info.value.code in ("turn_limit_exceeded", "token_limit_exceeded")
        assert len(spy.calls) == 2
        newer = gw.open(Task("t"), RolloutKey(3, 1, 1))
        r = post(gw, token, CHAT)
        assert r.status_code == 409 and r.json()["error"]["code"] == "session_superseded"
        rec = gw.close_session(token)
        assert rec.calls == tuple(spy.calls)
        assert rec.truncation in ("turns", "length")
        assert second.choices[0].finish_reason in ("stop", "length")
        gw.close_session(newer)
        r = post(gw, newer, CHAT)
        assert r.status_code == 410 and r.json()["error"]["code"] == "session_closed"
        assert len(spy.calls) == 2


@pytest.mark.timeout(60)
def test_context_limit_is_a_clear_400(spy):
    with running(spy, max_context=40) as gw:
        token = gw.open(Task("t"), RolloutKey(0, 0, 0))
        with client(gw, token) as c, pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model="dew", messages=[{"role": "user", "content": "x" * 60}])
        assert info.value.code == "context_length_exceeded"
        assert gw.close_session(token).truncation == "context"
    assert not spy.calls


@pytest.mark.timeout(120)
def test_cancel_mid_stream_aborts_the_generation_and_records_nothing(spy):
    with running(spy, sampling=SamplingParams(max_tokens=200)) as gw:
        token = gw.open(Task("t"), RolloutKey(0, 0, 0))
        with client(gw, token) as c:
            stream = c.chat.completions.create(
                model="dew",
                stream=True,
                max_tokens=200,
                messages=[{"role": "user", "content": "long"}],
            )
            events = iter(stream)
            opening = next(events)
            assert opening.choices[0].delta.role == "assistant"
            assert spy.wait_entered(1, WAIT)
            rec = gw.close_session(token)
            with pytest.raises(openai.APIError, match="closed"):
                list(events)
        assert spy.wait_errors(1, WAIT)
    assert isinstance(spy.errors[0], Aborted)
    assert rec.calls == () and not spy.calls


@pytest.mark.timeout(120)
def test_a_client_that_disconnects_aborts_its_generation(spy):
    with running(spy, sampling=SamplingParams(max_tokens=200)) as gw:
        token = gw.open(Task("t"), RolloutKey(0, 0, 0))
        body = json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 200})
        request = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            f"authorization: Bearer {token}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n{body}"
        ).encode()
        # A raw socket: send the request, and hang up while it is being generated.
        with socket.create_connection(("127.0.0.1", gw.port), timeout=WAIT) as sock:
            sock.sendall(request)
            assert spy.wait_entered(1, WAIT)
        assert spy.wait_errors(1, WAIT)
        assert isinstance(spy.errors[0], Aborted)
        assert gw.close_session(token).calls == ()


@pytest.mark.timeout(120)
def test_closing_the_gateway_aborts_in_flight_work(spy):
    errors: list[BaseException] = []
    gw = RecordingGateway(spy, TOK, sampling=SamplingParams(max_tokens=200)).start()
    token = gw.open(Task("t"), RolloutKey(0, 0, 0))

    def ask() -> None:
        with client(gw, token) as c:
            try:
                c.chat.completions.create(
                    model="dew", max_tokens=200, messages=[{"role": "user", "content": "x"}]
                )
            except openai.APIError as exc:
                errors.append(exc)

    worker = threading.Thread(target=ask)
    worker.start()
    assert spy.wait_entered(1, WAIT)
    gw.close()
    worker.join(WAIT)
    assert not worker.is_alive() and len(errors) == 1
    assert isinstance(spy.errors[0], Aborted)
    assert not gw.running
    with pytest.raises(RuntimeError, match="closed"):
        gw.open(Task("t"), RolloutKey(0, 1, 0))


@pytest.mark.timeout(120)
def test_an_engine_failure_is_a_500_and_marks_the_session(model):
    broken = RolloutServer(model, max_batch=2)
    broken.close()  # generate() now raises RuntimeError: an infrastructure failure
    with running(broken) as gw:
        token = gw.open(Task("t"), RolloutKey(0, 0, 0))
        with client(gw, token) as c, pytest.raises(openai.InternalServerError):
            c.chat.completions.create(model="dew", messages=[{"role": "user", "content": "x"}])
        rec = gw.close_session(token)
    assert rec.calls == () and "RolloutServer is closed" in rec.error


def test_a_non_loopback_bind_needs_an_explicit_opt_in(spy):
    for host in ("0.0.0.0", "192.168.1.2", "example.com", "::"):
        with pytest.raises(ValueError, match="allow_remote"):
            RecordingGateway(spy, TOK, host=host)
    RecordingGateway(spy, TOK, host="0.0.0.0", allow_remote=True).close()  # never started
    RecordingGateway(spy, TOK, host="localhost").close()
    RecordingGateway(spy, TOK, host="::1").close()
    with pytest.raises(RuntimeError, match="not started"):
        _ = RecordingGateway(spy, TOK).base_url
    assert RecordingGateway(spy, TOK)._table.limits.max_context == spy.max_len


@pytest.mark.timeout(60)
def test_a_taken_port_fails_at_start_and_leaves_nothing_running(spy):
    with running(spy) as gw:
        second = RecordingGateway(spy, TOK, port=gw.port)
        with pytest.raises(OSError):
            second.start()
        assert not second.running
        second.close()
        with pytest.raises(RuntimeError, match="closed"):
            second.start()
        assert gw.running
