"""ChatTokens remembers renders and encodings: the same ids, fewer template runs."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from dew.demo.model import make_tokenizer
from dew.objectives.rl.sources import ChatTokens
from dew.objectives.rl.sources.chat import _Memo

WAIT = 30.0


def _counting(template_suffix: str = "") -> tuple[Any, list[int]]:
    """A demo tokenizer whose template runs are counted (``template_suffix`` appended)."""
    tok = make_tokenizer()
    tok.chat_template = tok.chat_template + template_suffix
    runs = [0]
    render = tok.apply_chat_template

    def counted(*args: Any, **kwargs: Any) -> Any:
        runs[0] += 1
        return render(*args, **kwargs)

    tok.apply_chat_template = counted
    return tok, runs


def _fresh_ids(tok: Any, messages: list[dict[str, Any]]) -> list[int]:
    return list(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    )


def test_a_repeated_prompt_runs_the_template_once_and_gives_the_same_ids() -> None:
    tok, runs = _counting()
    chat = ChatTokens(tok)
    first = [{"role": "user", "content": "12345="}]
    start = runs[0]
    ids = [chat.first(first) for _ in range(3)]
    assert runs[0] - start == 1
    assert ids[0] == ids[1] == ids[2] == _fresh_ids(tok, first)
    # Each caller gets its own list: changing one leaves what is remembered alone.
    ids[0].append(-1)
    assert chat.first(first) == ids[1]

    new = [{"role": "user", "content": "678="}]
    start = runs[0]
    stopped = chat.after_reply("12345<|im_end|>", True, new)
    cut = chat.after_reply("123", False, new)  # other replies, the same messages
    again = chat.after_reply("9<|im_end|>", True, new)
    assert runs[0] - start == 1
    assert stopped == again and cut != stopped
    reply = tok("12345<|im_end|>", add_special_tokens=False)["input_ids"]
    full = [*first, {"role": "assistant", "content": "12345"}, *new]
    assert chat.first(first) + reply + stopped == _fresh_ids(tok, full)


def test_a_template_that_reads_the_clock_is_run_every_time() -> None:
    tok, runs = _counting("{% if false %}{{ strftime_now('%Y') }}{% endif %}")
    chat = ChatTokens(tok)
    messages = [{"role": "user", "content": "1="}]
    start = runs[0]
    results = [chat.first(messages) for _ in range(3)]
    assert runs[0] - start == 3
    assert results[0] == results[2] == _fresh_ids(tok, messages)


def test_messages_json_cannot_write_are_rendered_every_time() -> None:
    tok, runs = _counting()
    chat = ChatTokens(tok)

    class Text:  # renders as its text; not JSON
        def __str__(self) -> str:
            return "42="

    messages = [{"role": "user", "content": Text()}]
    start = runs[0]
    results = [chat.first(messages) for _ in range(2)]
    assert runs[0] - start == 2
    assert results[0] == results[1] == _fresh_ids(tok, messages)


def test_messages_json_would_confuse_with_others_are_rendered_every_time() -> None:
    tok, _ = _counting()
    chat = ChatTokens(tok)
    # JSON writes a tuple as it writes a list, but the template renders them apart.
    as_tuple = [{"role": "user", "content": ("1=",)}]
    as_list = [{"role": "user", "content": ["1="]}]
    assert _fresh_ids(tok, as_tuple) != _fresh_ids(tok, as_list)
    assert chat.first(as_tuple) == _fresh_ids(tok, as_tuple)
    assert chat.first(as_list) == _fresh_ids(tok, as_list)
    assert chat.first(as_tuple) == _fresh_ids(tok, as_tuple)


def test_the_memo_forgets_the_least_recently_used_first() -> None:
    memo = _Memo(2)
    made: list[str] = []

    def make(key: str) -> str:
        made.append(key)
        return key.upper()

    assert memo.get("a", lambda: make("a")) == "A"
    memo.get("b", lambda: make("b"))
    memo.get("a", lambda: make("a"))  # touched: b is now the oldest
    memo.get("c", lambda: make("c"))  # over the bound: b goes
    memo.get("a", lambda: make("a"))
    memo.get("b", lambda: make("b"))
    assert made == ["a", "b", "c", "b"]


@pytest.mark.timeout(WAIT)
def test_threads_asking_at_once_get_equal_ids() -> None:
    tok, _ = _counting()
    chat = ChatTokens(tok)
    messages = [[{"role": "user", "content": f"{i % 5}="}] for i in range(40)]
    want = [_fresh_ids(tok, m) for m in messages]
    got: list[list[list[int]]] = [[] for _ in range(8)]
    start = threading.Barrier(8)

    def ask(k: int) -> None:
        start.wait(timeout=WAIT)
        got[k] = [chat.first(m) for m in messages]

    threads = [threading.Thread(target=ask, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=WAIT)
    assert not any(t.is_alive() for t in threads)
    assert all(g == want for g in got)
