"""Between text and tokens for the recording gateway: prompts in, client-visible text out.

Prompts. A chat request is rendered to text with the tokenizer's chat template and
then encoded. Before encoding, the text is compared with the text of the session's
latest recorded calls (prompt text + decoded completion). When one of them is a
prefix, that call's exact token ids are reused for the prefix and only the rest is
encoded, so the new prompt extends the earlier call token-exactly and the two pack
into one chain, even where re-encoding the decoded completion would give other ids
(a byte-level BPE that merges differently, a special token spelled out in pieces).
When no earlier text is a prefix (a template that rewrites past turns, a client that
edits the assistant message, a stop string cut out of the content), the prompt is
encoded from scratch and the call opens a new chain. Either way the recorded prompt
is exactly what the engine was fed: tokens are never guessed.

Completions. The engine keeps the stop token in the completion; the client gets the
text without it. A stop *string* that is not one token cannot stop the engine, so
the completion is cut after the token that completes it (recorded tokens up to that
point, the text before the stop string returned), as OpenAI servers do.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dew.core import Call
from dew.gateway._protocol import RequestError
from dew.gateway._responses import Choice

__all__ = ["Prefix", "decode", "encode", "finish_call", "render_chat", "token_pieces"]


@dataclass(frozen=True, eq=False)
class Prefix:
    """Text the engine has seen or produced in a session, and its exact token ids."""

    text: str
    ids: np.ndarray  # [n] int64


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(
        list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
    )


def render_chat(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping] | None
) -> str:
    try:
        out = tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=list(tools) if tools else None,
            add_generation_prompt=True,
            tokenize=False,
        )
    except Exception as exc:  # a template is code run on client data: its failure is a 400
        raise RequestError(
            400,
            f"the chat template cannot render these messages: {exc}",
            param="messages",
            code="template_error",
        ) from None
    if not isinstance(out, str) or not out:
        raise RequestError(
            400, "the chat template rendered nothing", param="messages", code="template_error"
        )
    return out


def _tokenize(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def encode(
    tokenizer: Any, text: str, history: Iterable[Prefix], *, add_special_tokens: bool
) -> np.ndarray:
    """Token ids for ``text``, reusing the longest ``history`` entry that prefixes it.

    Returns [n] int64. ``add_special_tokens`` applies only when encoding from scratch
    (a reused prefix already carries whatever the first encoding added).
    """
    best: Prefix | None = None
    for p in history:
        if len(p.text) <= len(text) and text.startswith(p.text):
            if best is None or len(p.text) > len(best.text):
                best = p
    if best is None:
        return np.asarray(_tokenize(tokenizer, text, add_special_tokens), dtype=np.int64)
    rest = text[len(best.text) :]
    tail = _tokenize(tokenizer, rest, False) if rest else []
    return np.concatenate([best.ids, np.asarray(tail, dtype=np.int64)])


def token_pieces(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """The text each token adds, so that ``"".join(pieces) == decode(ids)``.

    Incremental: each step decodes from the token before the last emitted one, so
    tokenizers that drop a leading space at the start of a decode still give the
    space to the right token; a token that ends inside a multi-byte character gets
    "" and the character goes to the token that completes it.
    """
    ids = [int(t) for t in ids]
    pieces: list[str] = []
    prefix_at = read_at = 0
    for i in range(len(ids)):
        before = decode(tokenizer, ids[prefix_at:read_at]) if read_at > prefix_at else ""
        now = decode(tokenizer, ids[prefix_at : i + 1])
        if len(now) > len(before) and not now.endswith("\ufffd") and now.startswith(before):
            pieces.append(now[len(before) :])
            prefix_at, read_at = read_at, i + 1
        else:
            pieces.append("")
    full = decode(tokenizer, ids)
    joined = "".join(pieces)
    if joined != full:  # the last tokens never completed a character, or a decoder quirk
        if pieces and full.startswith(joined):
            pieces[-1] += full[len(joined) :]
        elif pieces:
            pieces = [""] * (len(pieces) - 1) + [full]
    return pieces


def _clip(pieces: Sequence[str], chars: int) -> list[str]:
    """The leading pieces holding the first ``chars`` characters (the last one cut)."""
    out: list[str] = []
    at = 0
    for p in pieces:
        if at >= chars:
            break
        out.append(p[: chars - at])
        at += len(p)
    return out


def _first_stop(text: str, start: int, stops: Sequence[str]) -> int | None:
    hits = [i for s in stops if (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
    return min(hits) if hits else None


def finish_call(
    tokenizer: Any, call: Call, stop_ids: Collection[int], stops: Sequence[str]
) -> tuple[Call, Choice, str]:
    """What to record, what the client sees, and the completion's text (for :func:`encode`).

    The recorded call is the engine's own object unless a stop string cut it.
    """
    completion = [int(t) for t in call.completion]
    pieces = token_pieces(tokenizer, completion)
    k = len(completion)
    stopped = bool(k) and completion[-1] in stop_ids
    reason = call.finish_reason or ("stop" if stopped else "length")
    if reason == "stop" and stopped:
        k -= 1  # the stop token ends the turn; the client never sees it
    cut: int | None = None
    content_chars = 0
    text_so_far = ""
    if stops:
        for i in range(k):
            start = len(text_so_far)
            text_so_far += pieces[i]
            hit = _first_stop(text_so_far, start, stops)
            if hit is not None:
                cut, content_chars = i + 1, hit
                break
    if cut is None:
        content_pieces = pieces[:k]
        recorded = call
    else:
        content_pieces = _clip(pieces[:cut], content_chars)
        recorded = replace(
            call,
            completion=completion[:cut],
            log_probs=list(call.log_probs)[:cut],
            support=None if call.support is None else list(call.support)[:cut],
            finish_reason="stop",
        )
        pieces = pieces[:cut]
    log_probs = [float(x) for x in list(recorded.log_probs)[: len(content_pieces)]]
    choice = Choice(
        content="".join(content_pieces),
        pieces=content_pieces,
        log_probs=log_probs,
        finish_reason="stop" if cut is not None else reason,
        completion_tokens=len(recorded.completion),
    )
    return recorded, choice, "".join(pieces)


def single_token_stops(tokenizer: Any, stops: Sequence[str]) -> tuple[set[int], list[str]]:
    """Split stop strings into those that are one token (the engine stops on them) and the rest."""
    ids: set[int] = set()
    rest: list[str] = []
    for s in stops:
        enc = _tokenize(tokenizer, s, False)
        if len(enc) == 1 and decode(tokenizer, enc) == s:
            ids.add(enc[0])
        else:
            rest.append(s)
    return ids, rest
