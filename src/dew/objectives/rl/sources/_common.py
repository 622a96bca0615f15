"""Helpers shared by the in-process sources: reward parsing, error text, chat tokens.

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
"""

from __future__ import annotations

import math
import threading
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol

from dew.objectives.rl.sessions import Call

__all__ = ["ChatTokens", "Engine", "error_text", "parse_reward", "token_ids"]


class Engine(Protocol):
    """What a source needs of an engine; ``dew.serving.RolloutServer`` is one.

    An engine may also offer ``submit`` with ``generate``'s arguments, returning a
    ``concurrent.futures.Future`` of the :class:`Call` (as ``RolloutServer.submit``
    does); :class:`~dew.objectives.rl.sources.PromptSource` then needs no thread per
    rollout.
    """

    @property
    def version(self) -> int: ...

    def generate(
        self,
        prompt: Sequence[int],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        stop_ids: Collection[int] = (),
        stop: threading.Event | None = None,
    ) -> Call: ...


_MARK = "\x00dew-marker\x00"


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def parse_reward(out: object) -> tuple[float, dict[str, float]]:
    """A verifier's float, or mapping of named parts, as (reward, components)."""
    if isinstance(out, Mapping):
        if not out:
            # An empty mapping would sum to a reward of 0 that no check produced.
            raise ValueError("verifier returned an empty mapping of reward components")
        parts: dict[str, float] = {}
        for name, value in out.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"reward component {name!r} is {value!r}, not a number")
            if not math.isfinite(value):
                raise ValueError(f"reward component {name!r} is {value!r}, not finite")
            parts[str(name)] = float(value)
        return float(sum(parts.values())), parts
    if isinstance(out, bool) or not isinstance(out, (int, float)):
        raise ValueError(f"verifier returned {out!r}; expected a number or a mapping of numbers")
    if not math.isfinite(out):
        raise ValueError(f"verifier returned {out!r}, not a finite number")
    return float(out), {}


def token_ids(value: object, name: str) -> list[int]:
    """Token ids from a list, tuple, numpy array or tensor."""
    items = value.tolist() if hasattr(value, "tolist") else value
    if not isinstance(items, Sequence) or isinstance(items, (str, bytes)):
        raise ValueError(f"{name} must be token ids, got {type(value).__name__}")
    try:
        return [int(t) for t in items]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be token ids (ints)") from None


def _ids(encoded: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True).
    if isinstance(encoded, Mapping):
        encoded = encoded["input_ids"]
    return [int(t) for t in encoded]


class ChatTokens:
    """Chat-template token ids for a tokenizer, built turn by turn (see module docstring)."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; chat prompts need one")
        self.tokenizer = tokenizer
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

    def _encode(self, text: str) -> list[int]:
        return _ids(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def first(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids of ``messages`` followed by the generation prompt."""
        return _ids(
            self.tokenizer.apply_chat_template(
                [dict(m) for m in messages], add_generation_prompt=True, tokenize=True
            )
        )

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
        full = self._render([*self._anchor, *messages], generation=True)
        if not full.startswith(self._anchor_text):
            raise ValueError(
                "the chat template rewrites earlier turns; prompts cannot be extended token-exactly"
            )
        return self._encode(suffix + full[len(self._anchor_text) :])
