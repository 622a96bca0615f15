"""Prompt encoding with prefix reuse, detokenization and call finishing (pure functions)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dew.core import Call
from dew.demo.model import make_tokenizer
from dew.gateway._text import (
    Prefix,
    decode,
    encode,
    finish_call,
    render_chat,
    single_token_stops,
    token_pieces,
)
from dew.objectives.rl.chains import chains

TOK = make_tokenizer()
EOS = TOK.eos_token_id
VOCAB = len(TOK)


def ids_of(text: str) -> list[int]:
    return list(TOK(text, add_special_tokens=False)["input_ids"])


def template_ids(messages: list[dict]) -> list[int]:
    out = TOK.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, VOCAB - 1), max_size=40))
def test_token_pieces_concatenate_to_the_decoded_text(ids):
    pieces = token_pieces(TOK, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == decode(TOK, ids)


def test_render_chat_matches_the_tokenizers_own_tokenization():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    text = render_chat(TOK, messages, None)
    assert encode(TOK, text, (), add_special_tokens=False).tolist() == template_ids(messages)


def test_encode_reuses_the_recorded_ids_of_the_longest_matching_prefix():
    user = [{"role": "user", "content": "hi"}]
    prompt_text = render_chat(TOK, user, None)
    prompt = encode(TOK, prompt_text, (), add_special_tokens=False)
    # The model spelled "<|im_end|>" character by character: re-encoding its text would
    # give the single special token, so only reuse keeps the recorded ids.
    completion = ids_of("ok") + ids_of("<") + ids_of("|im_end|>")
    completion = [t for t in completion] + [EOS]
    completion_text = decode(TOK, completion)
    assert ids_of(completion_text) != completion  # re-tokenization would diverge
    recorded = Prefix(
        prompt_text + completion_text, np.concatenate([prompt, np.asarray(completion)])
    )
    shorter = Prefix(prompt_text, prompt)
    content = completion_text[: -len("<|im_end|>")]
    turn2 = [*user, {"role": "assistant", "content": content}, {"role": "user", "content": "again"}]
    text2 = render_chat(TOK, turn2, None)
    ids2 = encode(TOK, text2, (shorter, recorded), add_special_tokens=False)
    assert ids2[: len(recorded.ids)].tolist() == recorded.ids.tolist()
    assert decode(TOK, ids2) == decode(TOK, template_ids(turn2))
    calls = [
        Call(prompt, completion, [-1.0] * len(completion), 0),
        Call(ids2, ids_of("x"), [-1.0], 0),
    ]
    assert len(chains(calls)) == 1
    # Without the history the same text encodes afresh: a new chain, correct tokens.
    fresh = encode(TOK, text2, (), add_special_tokens=False)
    assert fresh.tolist() == template_ids(turn2)
    assert len(chains([calls[0], Call(fresh, ids_of("x"), [-1.0], 0)])) == 2


def test_encode_ignores_history_that_is_not_a_prefix():
    text = render_chat(TOK, [{"role": "user", "content": "hello"}], None)
    other = Prefix("something else", np.asarray(ids_of("something else")))
    assert encode(TOK, text, (other,), add_special_tokens=False).tolist() == ids_of(text)


def make_call(prompt: list[int], completion: list[int], finish: str | None) -> Call:
    return Call(
        prompt,
        completion,
        [-0.1 * (i + 1) for i in range(len(completion))],
        3,
        finish_reason=finish,
    )


def test_finish_call_strips_the_stop_token_from_the_content_but_records_it():
    completion = [*ids_of("abc"), EOS]
    call = make_call(ids_of("p"), completion, "stop")
    recorded, choice, text = finish_call(TOK, call, {EOS}, ())
    assert recorded is call
    assert choice.content == "abc" and choice.finish_reason == "stop"
    assert list(choice.pieces) == ["a", "b", "c"]
    assert choice.log_probs == pytest.approx([-0.1, -0.2, -0.3])
    assert choice.completion_tokens == 4
    assert text == "abc<|im_end|>"


def test_finish_call_on_length_keeps_every_token_in_the_content():
    call = make_call(ids_of("p"), ids_of("abcd"), "length")
    recorded, choice, _ = finish_call(TOK, call, {EOS}, ())
    assert recorded is call and choice.content == "abcd" and choice.finish_reason == "length"


def test_finish_call_cuts_at_a_multi_token_stop_string():
    call = make_call(ids_of("p"), ids_of("ab END cd"), "length")
    recorded, choice, text = finish_call(TOK, call, {EOS}, ("END",))
    assert choice.content == "ab " and choice.finish_reason == "stop"
    assert list(recorded.completion) == ids_of("ab END")
    assert list(recorded.log_probs) == list(call.log_probs)[:6]
    assert recorded.finish_reason == "stop" and recorded.version == 3
    assert text == "ab END"
    assert "".join(choice.pieces) == choice.content
    assert len(choice.pieces) == len(choice.log_probs)


def test_single_token_stops_splits_by_encoding():
    ids, rest = single_token_stops(TOK, ["\n", "END", "<|im_end|>"])
    assert ids == {ids_of("\n")[0], EOS}
    assert rest == ["END"]
