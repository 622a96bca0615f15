"""OpenAI wire format for the recording gateway: request validation.

Everything here is pure: a decoded JSON body goes in, a typed request comes out, or a
:class:`RequestError` carrying the HTTP status, a message naming the offending field
and an OpenAI error ``code``. Each known field has one validator in a registry
(``_SAMPLING_FIELDS``); unknown fields are ignored, as the OpenAI-compatible servers
harnesses are written against (vLLM, SGLang) ignore them. A validator never lets a
Python exception other than :class:`RequestError` escape, so bad input cannot become
a 500.

Sampling fields the engine cannot honor (penalties, ``logit_bias``, top log-prob
alternatives, ``echo``, ``suffix``, ``best_of``) are refused with 400 when they ask
for something other than the neutral value, rather than silently ignored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "RequestError",
    "RequestSampling",
    "error_body",
    "parse_chat",
    "parse_completion",
]

# Roles a chat template may meet; anything else is almost surely a client bug.
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
MAX_MESSAGES = 4096
MAX_STOP = 16
MAX_STOP_CHARS = 256


class RequestError(Exception):
    """A request the gateway refuses: HTTP ``status`` with an OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind


def error_body(err: RequestError) -> dict[str, Any]:
    return {
        "error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}
    }


def _bad(param: str, rule: str) -> RequestError:
    return RequestError(400, f"'{param}' {rule}", param=param, code="invalid_value")


# --------------------------------------------------------------------------- scalars


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def text(value: object, param: str) -> str:
    """A string that encodes to UTF-8 (JSON allows lone surrogates; tokenizers do not)."""
    if not isinstance(value, str):
        raise _bad(param, f"must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(param, "is not valid Unicode text (lone surrogate)") from None
    return value


def _int_in(param: str, low: int, high: int | None = None) -> Callable[[object], int | None]:
    def check(v: object) -> int | None:
        if v is None:
            return None
        if not _is_int(v):
            raise _bad(param, f"must be an integer, got {type(v).__name__}")
        assert isinstance(v, int)
        if v < low or (high is not None and v > high):
            upper = "" if high is None else f" and <= {high}"
            raise _bad(param, f"must be >= {low}{upper}, got {v}")
        return v

    return check


def _number_in(
    param: str, low: float, high: float, *, low_open: bool = False
) -> Callable[[object], float | None]:
    def check(v: object) -> float | None:
        if v is None:
            return None
        if not _is_number(v):
            raise _bad(param, f"must be a number, got {type(v).__name__}")
        x = float(v)  # type: ignore[arg-type]
        below = x <= low if low_open else x < low
        if not math.isfinite(x) or below or x > high:
            bracket = "(" if low_open else "["
            raise _bad(param, f"must be in {bracket}{low}, {high}], got {v}")
        return x

    return check


def _bool(param: str) -> Callable[[object], bool | None]:
    def check(v: object) -> bool | None:
        if v is None or isinstance(v, bool):
            return v
        raise _bad(param, f"must be a boolean, got {type(v).__name__}")

    return check


def _neutral(param: str, neutral: Callable[[object], bool], what: str) -> Callable[[object], None]:
    def check(v: object) -> None:
        if v is not None and not neutral(v):
            raise RequestError(
                400,
                f"'{param}' is not supported by this gateway ({what})",
                param=param,
                code="unsupported_parameter",
            )

    return check


def _stop(v: object) -> tuple[str, ...]:
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list):
        raise _bad("stop", f"must be a string or a list of strings, got {type(v).__name__}")
    if len(items) > MAX_STOP:
        raise _bad("stop", f"may hold at most {MAX_STOP} sequences, got {len(items)}")
    out = []
    for i, s in enumerate(items):
        s = text(s, f"stop[{i}]")
        if not s or len(s) > MAX_STOP_CHARS:
            raise _bad(f"stop[{i}]", f"must have 1 to {MAX_STOP_CHARS} characters")
        out.append(s)
    return tuple(out)


def _stream_options(v: object) -> bool:
    if v is None:
        return False
    if not isinstance(v, dict):
        raise _bad("stream_options", f"must be an object, got {type(v).__name__}")
    usage = v.get("include_usage", False)
    if not isinstance(usage, bool):
        raise _bad("stream_options.include_usage", "must be a boolean")
    return usage


def _zero_number(v: object) -> bool:
    return _is_number(v) and v == 0


def _empty_mapping(v: object) -> bool:
    return isinstance(v, dict) and not v


def _no_alternatives(v: object) -> bool:
    return _is_int(v) and v == 0


# --------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class RequestSampling:
    """What a request asks of the engine. ``None`` means: the gateway's setting.

    The request's side only: the gateway turns it, with its own defaults, into the
    :class:`dew.core.SamplingParams` the engine gets (``_app``).
    """

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False


def _top_k(v: object) -> int | None:
    if v is None:
        return None
    if not _is_int(v):
        raise _bad("top_k", f"must be an integer, got {type(v).__name__}")
    assert isinstance(v, int)
    if v in (-1, 0):  # vLLM's spelling of "no top-k"
        return None
    if v < 1:
        raise _bad("top_k", f"must be >= 1 (or -1 / 0 for none), got {v}")
    return v


# field name -> (RequestSampling attribute or None when only validated, validator)
_SAMPLING_FIELDS: Mapping[str, tuple[str | None, Callable[[object], Any]]] = {
    "max_tokens": ("max_tokens", _int_in("max_tokens", 1)),
    "temperature": ("temperature", _number_in("temperature", 0.0, 2.0)),
    "top_p": ("top_p", _number_in("top_p", 0.0, 1.0, low_open=True)),
    "top_k": ("top_k", _top_k),
    "stop": ("stop", _stop),
    "stream": ("stream", _bool("stream")),
    "stream_options": ("include_usage", _stream_options),
    "presence_penalty": (None, _neutral("presence_penalty", _zero_number, "only 0")),
    "frequency_penalty": (None, _neutral("frequency_penalty", _zero_number, "only 0")),
    "repetition_penalty": (
        None,
        _neutral("repetition_penalty", lambda v: _is_number(v) and v == 1, "only 1"),
    ),
    "logit_bias": (None, _neutral("logit_bias", _empty_mapping, "only an empty map")),
    "seed": (None, _int_in("seed", -(2**63), 2**64 - 1)),
    "user": (None, lambda v: None if v is None else text(v, "user")),
}


def _sampling(body: Mapping[str, Any], extra: Mapping[str, Any], max_n: int) -> RequestSampling:
    values: dict[str, Any] = {}
    for name, (attr, check) in {**_SAMPLING_FIELDS, **extra}.items():
        if name not in body:
            continue
        parsed = check(body[name])
        if attr is not None and parsed is not None:
            values[attr] = parsed
    n = _int_in("n", 1, max_n)(body.get("n"))
    return RequestSampling(**values, n=1 if n is None else n)


# --------------------------------------------------------------------------- chat


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None
    sampling: RequestSampling


def _content(v: object, param: str) -> str | None:
    if v is None or isinstance(v, str):
        return None if v is None else text(v, param)
    if not isinstance(v, list):
        raise _bad(param, f"must be a string, null or a list of parts, got {type(v).__name__}")
    parts = []
    for j, part in enumerate(v):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise _bad(where, f"must be an object, got {type(part).__name__}")
        kind = part.get("type")
        if kind != "text":
            raise RequestError(
                400,
                f"'{where}.type' {kind!r} is not supported; only text parts are",
                param=where,
                code="unsupported_content",
            )
        parts.append(text(part.get("text"), f"{where}.text"))
    return "".join(parts)


def _tool_calls(v: object, param: str) -> list[dict[str, Any]]:
    if not isinstance(v, list):
        raise _bad(param, f"must be a list, got {type(v).__name__}")
    out = []
    for j, call in enumerate(v):
        where = f"{param}[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise _bad(where, "must be an object with a 'function' object")
        fn = call["function"]
        out.append(
            {
                "id": text(call.get("id", ""), f"{where}.id"),
                "type": "function",
                "function": {
                    "name": text(fn.get("name"), f"{where}.function.name"),
                    "arguments": text(fn.get("arguments", ""), f"{where}.function.arguments"),
                },
            }
        )
    return out


def _message(m: object, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _bad(where, f"must be an object, got {type(m).__name__}")
    role = text(m.get("role"), f"{where}.role")
    if role not in ROLES:
        raise _bad(f"{where}.role", f"must be one of {sorted(ROLES)}, got {role!r}")
    out: dict[str, Any] = {"role": role}
    content = _content(m.get("content"), f"{where}.content")
    if m.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
    # Templates render content verbatim; a missing content is an empty turn, except
    # beside tool calls, where templates test for it.
    out["content"] = content if content is not None or "tool_calls" in out else ""
    for name in ("name", "tool_call_id"):
        if m.get(name) is not None:
            out[name] = text(m[name], f"{where}.{name}")
    return out


def _tools(v: object) -> tuple[dict[str, Any], ...] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(t, dict) for t in v):
        raise _bad("tools", "must be a list of objects")
    for j, tool in enumerate(v):
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"tools[{j}].function", "must be an object")
        text(fn.get("name"), f"tools[{j}].function.name")
    return tuple(v)


def _chat_logprobs(v: object) -> bool | None:
    return _bool("logprobs")(v)


_CHAT_FIELDS: Mapping[str, tuple[str | None, Callable[[object], Any]]] = {
    "max_completion_tokens": ("max_tokens", _int_in("max_completion_tokens", 1)),
    "logprobs": ("logprobs", _chat_logprobs),
    "top_logprobs": (
        None,
        _neutral("top_logprobs", _no_alternatives, "only 0: alternatives are not recorded"),
    ),
}


def parse_chat(body: object, *, max_n: int) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object", code="invalid_body")
    if "model" in body and body["model"] is not None:
        text(body["model"], "model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "is required and must be a non-empty list")
    if len(messages) > MAX_MESSAGES:
        raise _bad("messages", f"may hold at most {MAX_MESSAGES} messages, got {len(messages)}")
    parsed = tuple(_message(m, i) for i, m in enumerate(messages))
    # _CHAT_FIELDS is applied after the common fields, so max_completion_tokens wins
    # over the older max_tokens when both are set.
    sampling = _sampling(body, _CHAT_FIELDS, max_n)
    return ChatRequest(parsed, _tools(body.get("tools")), sampling)


# --------------------------------------------------------------------------- completions


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | tuple[int, ...]
    sampling: RequestSampling


def _prompt(v: object, vocab_size: int) -> str | tuple[int, ...]:
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # a batch of one prompt
    if isinstance(v, str):
        if not v:
            raise _bad("prompt", "must not be empty")
        return text(v, "prompt")
    if isinstance(v, list) and v and all(_is_int(t) for t in v):
        bad = [t for t in v if not 0 <= t < vocab_size]
        if bad:
            raise _bad("prompt", f"token ids must be in [0, {vocab_size}), got {bad[0]}")
        return tuple(v)
    raise _bad(
        "prompt",
        "must be a non-empty string or a non-empty list of token ids (one prompt per request)",
    )


def _completion_logprobs(v: object) -> bool | None:
    n = _int_in("logprobs", 0, 5)(v)
    if n is None:
        return None
    if n > 0:
        raise RequestError(
            400,
            "'logprobs' above 0 asks for alternatives, which are not recorded; use 0",
            param="logprobs",
            code="unsupported_parameter",
        )
    return True


_COMPLETION_FIELDS: Mapping[str, tuple[str | None, Callable[[object], Any]]] = {
    "logprobs": ("logprobs", _completion_logprobs),
    "echo": (None, _neutral("echo", lambda v: v is False, "only false")),
    "suffix": (None, _neutral("suffix", lambda v: False, "only null")),
    "best_of": (None, _neutral("best_of", lambda v: _is_int(v) and v == 1, "only 1")),
}


def parse_completion(body: object, *, max_n: int, vocab_size: int) -> CompletionRequest:
    """Validate a ``/v1/completions`` body."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object", code="invalid_body")
    if "model" in body and body["model"] is not None:
        text(body["model"], "model")
    if "prompt" not in body:
        raise _bad("prompt", "is required")
    prompt = _prompt(body["prompt"], vocab_size)
    return CompletionRequest(prompt, _sampling(body, _COMPLETION_FIELDS, max_n))
