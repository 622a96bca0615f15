"""OpenAI wire format for the recording gateway: response bodies and stream chunks.

Pure functions from generated choices to the JSON shapes the official ``openai``
client parses: ``chat.completion`` / ``text_completion`` bodies and their
``chunk`` counterparts for server-sent events. A stream opens with one chunk per
choice (the assistant role, empty text), then carries one chunk per content token,
a finish chunk per choice and, when asked, a usage chunk.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Choice",
    "chat_chunk",
    "chat_opening",
    "chat_response",
    "chat_stream",
    "completion_chunk",
    "completion_opening",
    "completion_response",
    "completion_stream",
]


@dataclass(frozen=True)
class Choice:
    """One generated choice as the client sees it.

    ``pieces[i]`` is the text of content token ``i``, ``log_probs[i]`` its log-prob;
    ``"".join(pieces) == content``.
    """

    content: str
    pieces: Sequence[str]
    log_probs: Sequence[float]
    finish_reason: str
    completion_tokens: int


def _chat_logprobs_body(pieces: Sequence[str], log_probs: Sequence[float]) -> dict[str, Any]:
    return {
        "content": [
            {"token": p, "logprob": float(lp), "bytes": list(p.encode("utf-8")), "top_logprobs": []}
            for p, lp in zip(pieces, log_probs, strict=True)
        ],
        "refusal": None,
    }


def _completion_logprobs_body(pieces: Sequence[str], log_probs: Sequence[float]) -> dict[str, Any]:
    offsets, at = [], 0
    for p in pieces:
        offsets.append(at)
        at += len(p)
    return {
        "tokens": list(pieces),
        "token_logprobs": [float(x) for x in log_probs],
        "top_logprobs": None,
        "text_offset": offsets,
    }


def _usage(prompt_tokens: int, choices: Sequence[Choice]) -> dict[str, int]:
    completion = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def chat_response(
    rid: str, model: str, prompt_tokens: int, choices: Sequence[Choice], logprobs: bool
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": c.content},
                "logprobs": _chat_logprobs_body(c.pieces, c.log_probs) if logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(choices)
        ],
        "usage": _usage(prompt_tokens, choices),
    }


def completion_response(
    rid: str, model: str, prompt_tokens: int, choices: Sequence[Choice], logprobs: bool
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                "text": c.content,
                "logprobs": _completion_logprobs_body(c.pieces, c.log_probs) if logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(choices)
        ],
        "usage": _usage(prompt_tokens, choices),
    }


def _chunk(
    kind: str,
    rid: str,
    model: str,
    created: int,
    choices: Sequence[dict[str, Any]],
    usage: dict[str, int] | None,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": rid,
        "object": kind,
        "created": created,
        "model": model,
        "choices": list(choices),
    }
    if usage is not None:
        out["usage"] = usage
    return out


def chat_chunk(
    rid: str,
    model: str,
    created: int,
    choices: Sequence[dict[str, Any]],
    usage: dict[str, int] | None = None,
) -> dict[str, Any]:
    return _chunk("chat.completion.chunk", rid, model, created, choices, usage)


def completion_chunk(
    rid: str,
    model: str,
    created: int,
    choices: Sequence[dict[str, Any]],
    usage: dict[str, int] | None = None,
) -> dict[str, Any]:
    return _chunk("text_completion", rid, model, created, choices, usage)


def chat_stream(
    rid: str,
    model: str,
    prompt_tokens: int,
    choices: Sequence[Choice],
    *,
    logprobs: bool,
    include_usage: bool,
) -> list[dict[str, Any]]:
    """The chunks after the opening role chunk: one per content token, then the finish."""
    created = int(time.time())
    out = []
    for i, c in enumerate(choices):
        for piece, lp in zip(c.pieces, c.log_probs, strict=True):
            delta = {
                "index": i,
                "delta": {"content": piece},
                "finish_reason": None,
                "logprobs": _chat_logprobs_body([piece], [lp]) if logprobs else None,
            }
            out.append(chat_chunk(rid, model, created, [delta]))
        out.append(
            chat_chunk(
                rid,
                model,
                created,
                [{"index": i, "delta": {}, "finish_reason": c.finish_reason, "logprobs": None}],
            )
        )
    if include_usage:
        out.append(chat_chunk(rid, model, created, [], _usage(prompt_tokens, choices)))
    return out


def chat_opening(rid: str, model: str, n: int) -> dict[str, Any]:
    """The first chunk of a stream, sent before generation ends: each choice's role."""
    return chat_chunk(
        rid,
        model,
        int(time.time()),
        [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "finish_reason": None,
                "logprobs": None,
            }
            for i in range(n)
        ],
    )


def completion_stream(
    rid: str,
    model: str,
    prompt_tokens: int,
    choices: Sequence[Choice],
    *,
    logprobs: bool,
    include_usage: bool,
) -> list[dict[str, Any]]:
    created = int(time.time())
    out = []
    for i, c in enumerate(choices):
        for piece, lp in zip(c.pieces, c.log_probs, strict=True):
            body = _completion_logprobs_body([piece], [lp]) if logprobs else None
            out.append(
                completion_chunk(
                    rid,
                    model,
                    created,
                    [{"index": i, "text": piece, "logprobs": body, "finish_reason": None}],
                )
            )
        out.append(
            completion_chunk(
                rid,
                model,
                created,
                [{"index": i, "text": "", "logprobs": None, "finish_reason": c.finish_reason}],
            )
        )
    if include_usage:
        out.append(completion_chunk(rid, model, created, [], _usage(prompt_tokens, choices)))
    return out


def completion_opening(rid: str, model: str, n: int) -> dict[str, Any]:
    return completion_chunk(
        rid,
        model,
        int(time.time()),
        [{"index": i, "text": "", "logprobs": None, "finish_reason": None} for i in range(n)],
    )
