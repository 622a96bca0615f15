"""Chat-template token ids for sources, built turn by turn, and the default stop ids.

Chat prompts are built *incrementally*: the first prompt is the chat template applied
to the first messages; every later prompt is the previous prompt, the model's
completion, then the tokens of only what the template puts after that completion (the
rest of the assistant turn, the new messages and the generation prompt). Nothing the
model produced is re-tokenized, so each prompt extends the previous call token-exactly
and a multi-turn rollout packs into one chain.

Those two pieces of template text are found by rendering against a fixed anchor
conversation (a system message and an assistant message with a marker content) and
cutting the anchor's own rendering off, which works for any template that renders a
conversation as the concatenation of its turns (ChatML, Llama 3, Mistral and the like).
A template that rewrites earlier turns is refused with a clear error.

Renders and encodings are remembered (a bounded memo per :class:`ChatTokens`, keyed by
the messages' JSON text where it reads back as the same messages, and by the text): the
samples of a group see the same observations, and the worker threads of a multi-turn
source would otherwise run the template and the tokenizer again for each of them,
holding the interpreter lock the engine and the trainer wait for. The ids are the same
either way. A template that reads the clock (``strftime_now``) is rendered every time.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from dew.core import SamplingParams, error_text

__all__ = ["ChatTokens", "resolve_stop_ids", "text_encoder"]


_MARK = "\x00dew-marker\x00"
# Renders and encodings a ChatTokens remembers (each): a multi-turn source renders the
# same messages for every sample of a group, from many threads at once.
_REMEMBERED = 4096


class _Memo:
    """A bounded, thread-safe memo: the least recently used entry goes first."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._lock = threading.Lock()
        self._values: OrderedDict[Hashable, Any] = OrderedDict()

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._values:
                self._values.move_to_end(key)
                return self._values[key]
        value = make()  # outside the lock: two threads may both make it, with one result
        with self._lock:
            self._values[key] = value
            if len(self._values) > self._size:
                self._values.popitem(last=False)
        return value


def resolve_stop_ids(sampling: SamplingParams, tokenizer: Any) -> SamplingParams:
    """``sampling`` with ``stop_ids=None`` replaced by the tokenizer's end-of-sequence id.

    Without a tokenizer (or one without an end-of-sequence id), ``None`` stays, and the
    engine stops at its model's end-of-sequence ids.
    """
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if sampling.stop_ids is not None or eos is None:
        return sampling
    ids = (eos,) if isinstance(eos, int) else tuple(eos)
    return dataclasses.replace(sampling, stop_ids=ids)


def text_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """``text -> token ids``, no special tokens added: the ids ``tokenizer(text,
    add_special_tokens=False)`` gives. A fast tokenizer's Rust tokenizer is called
    directly: the same ids without the Python wrapper's cost, which a source's worker
    threads would otherwise pay at every turn while holding the interpreter lock."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and callable(getattr(backend, "encode", None)):
        return lambda text: backend.encode(text, add_special_tokens=False).ids
    return lambda text: [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


class ChatTokens:
    """Chat-template token ids for a tokenizer, built turn by turn (see module docstring)."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; chat prompts need one")
        self.tokenizer = tokenizer
        self._encode = text_encoder(tokenizer)
        # A template that reads the clock (``strftime_now``) renders differently over
        # time; any other renders the same messages to the same text.
        self._renders = (
            None if "strftime_now" in str(tokenizer.chat_template) else _Memo(_REMEMBERED)
        )
        self._encodings = _Memo(_REMEMBERED)
        system = [{"role": "system", "content": "anchor"}]
        try:
            anchor = self._render(system, generation=False)
            with_reply = self._render([*system, {"role": "assistant", "content": _MARK}], False)
        except Exception as exc:  # a template is code; say which step it refused
            raise ValueError(
                f"the chat template cannot render a system + assistant "
                f"conversation: {error_text(exc)}"
            ) from exc
        if not with_reply.startswith(anchor) or _MARK not in with_reply:
            raise ValueError("the chat template does not render turns by concatenation")
        self._anchor = [*system, {"role": "assistant", "content": _MARK}]
        self._anchor_text = with_reply
        # What the template writes after an assistant message's content (e.g. "<|im_end|>\n").
        self._reply_suffix = with_reply[with_reply.index(_MARK) + len(_MARK) :]

    def _render(self, messages: Sequence[Mapping[str, Any]], generation: bool) -> str:
        return self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=generation, tokenize=False
        )

    def first(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids of ``messages`` followed by the generation prompt (what
        ``apply_chat_template(..., tokenize=True)`` gives: the rendered text, encoded
        without special tokens added)."""
        return self._ids(self._text(messages))

    def after_reply(
        self, completion_text: str, stopped: bool, messages: Sequence[Mapping[str, Any]]
    ) -> list[int]:
        """Tokens to append after a completion to reach the next generation prompt.

        ``completion_text`` is the decoded completion including its stop token when
        ``stopped``; the template's end-of-turn text is appended minus whatever the
        completion already wrote of it.
        """
        suffix = self._reply_suffix
        for cut in range(len(suffix), 0, -1):  # longest end of the completion that starts it
            if stopped and completion_text.endswith(suffix[:cut]):
                suffix = suffix[cut:]
                break
        full = self._text([*self._anchor, *messages])
        if not full.startswith(self._anchor_text):
            raise ValueError(
                "the chat template rewrites earlier turns; prompts cannot be extended token-exactly"
            )
        return self._ids(suffix + full[len(self._anchor_text) :])

    def _text(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """``messages`` rendered with the generation prompt, remembered where exact."""
        if self._renders is None:
            return self._render(messages, generation=True)
        plain = [dict(m) for m in messages]
        try:
            key = json.dumps(plain, sort_keys=True)
        except (TypeError, ValueError):  # contents JSON cannot write: rendered each time
            return self._render(messages, generation=True)
        if json.loads(key) != plain:  # a tuple, a key that is not a string, a NaN: JSON
            # would give another message list the same text, so this one is not remembered
            return self._render(messages, generation=True)
        return self._renders.get(key, lambda: self._render(messages, generation=True))

    def _ids(self, text: str) -> list[int]:
        return list(self._encodings.get(text, lambda: tuple(self._encode(text))))
