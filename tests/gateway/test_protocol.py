"""Request validation of the gateway's OpenAI wire format (pure functions)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dew.gateway._protocol import (
    RequestError,
    parse_chat,
    parse_completion,
)

MSG = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return parse_chat({"model": "m", "messages": MSG, **fields}, max_n=4)


def refused(fn, *args, **kw) -> RequestError:
    with pytest.raises(RequestError) as info:
        fn(*args, **kw)
    return info.value


def test_chat_defaults_leave_choices_to_the_gateway():
    req = chat()
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.n) == (None, None, None, None, 1)
    assert (s.stop, s.logprobs, s.stream, s.include_usage) == ((), False, False, False)
    assert req.messages == ({"role": "user", "content": "hi"},)


def test_chat_fields_are_parsed():
    s = chat(
        max_tokens=5,
        temperature=0.5,
        top_p=0.9,
        top_k=7,
        n=3,
        stop="x",
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
        top_logprobs=0,
        presence_penalty=0,
        seed=3,
        user="u",
        unknown_field={"ignored": 1},
    ).sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.n) == (5, 0.5, 0.9, 7, 3)
    assert (s.stop, s.logprobs, s.stream, s.include_usage) == (("x",), True, True, True)


def test_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_tokens=5, max_completion_tokens=9).sampling.max_tokens == 9
    assert chat(max_tokens=5, max_completion_tokens=None).sampling.max_tokens == 5


def test_content_parts_are_joined_and_tool_calls_kept():
    req = parse_chat(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "content": "42", "tool_call_id": "c1"},
            ]
        },
        max_n=1,
    )
    assert req.messages[0]["content"] == "ab"
    assert req.messages[1]["content"] is None
    assert req.messages[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    assert req.messages[2] == {"role": "tool", "content": "42", "tool_call_id": "c1"}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_completion_tokens": 1.5}, "max_completion_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"n": 5}, "n"),
        ({"n": 0}, "n"),
        ({"stop": 3}, "stop"),
        ({"stop": [""]}, "stop[0]"),
        ({"stop": ["a"] * 17}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": []}, "stream_options"),
        ({"logprobs": 1}, "logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"logit_bias": {"1": 5}}, "logit_bias"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
        ({"model": 3}, "model"),
        ({"tools": [{"function": 1}]}, "tools[0].function"),
    ],
)
def test_chat_refusals_name_the_field(fields, param):
    err = refused(chat, **fields)
    assert err.status == 400 and err.param == param and param.split("[")[0] in err.message


def test_non_object_bodies_are_refused():
    for body in ([], "x", 3, None):
        assert refused(parse_chat, body, max_n=1).status == 400
        assert refused(parse_completion, body, max_n=1, vocab_size=10).status == 400


def test_completion_prompts():
    assert parse_completion({"prompt": "ab"}, max_n=1, vocab_size=10).prompt == "ab"
    assert parse_completion({"prompt": [1, 2]}, max_n=1, vocab_size=10).prompt == (1, 2)
    assert parse_completion({"prompt": ["ab"]}, max_n=1, vocab_size=10).prompt == "ab"
    assert parse_completion({"prompt": [[3]]}, max_n=1, vocab_size=10).prompt == (3,)
    assert parse_completion(
        {"prompt": "a", "logprobs": 0}, max_n=1, vocab_size=10
    ).sampling.logprobs
    for bad in ("", [], [10], [-1], ["a", "b"], [1, "a"], 5, None):
        err = refused(parse_completion, {"prompt": bad}, max_n=1, vocab_size=10)
        assert err.param == "prompt", bad
    assert refused(parse_completion, {}, max_n=1, vocab_size=10).param == "prompt"
    for field, value in (("logprobs", 2), ("echo", True), ("suffix", "x"), ("best_of", 2)):
        err = refused(parse_completion, {"prompt": "a", field: value}, max_n=1, vocab_size=10)
        assert err.status == 400 and err.param == field


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
fields = st.sampled_from(
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
        "presence_penalty",
        "logit_bias",
        "seed",
        "user",
        "echo",
        "suffix",
        "best_of",
    ]
)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(fields, json_values, max_size=6), st.booleans())
def test_any_json_body_parses_or_is_refused_with_a_4xx(body, with_messages):
    if with_messages:
        body.setdefault("messages", MSG)
        body.setdefault("prompt", "a")
    for parse in (
        lambda b: parse_chat(b, max_n=4),
        lambda b: parse_completion(b, max_n=4, vocab_size=50),
    ):
        try:
            parse(body)
        except RequestError as err:
            assert 400 <= err.status < 500 and err.message
