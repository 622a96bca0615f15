"""What ``dew serve``'s endpoints share: request bodies, refusals and the app's state."""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from dew.serving._claim import Claim
from dew.serving.weights import JoinedGroup

if TYPE_CHECKING:
    import torch

    from dew.serving.server import RolloutServer

__all__ = [
    "AbortBody",
    "FromDiskBody",
    "FromDistributedBody",
    "GenerateBody",
    "InitGroupBody",
    "Refusal",
    "SamplingBody",
    "ServeState",
    "parse_body",
    "refused",
]

_MAX_BODY = 64 << 20


class Refusal(Exception):
    """A request refused with ``status``; ``param`` names the field at fault."""

    def __init__(
        self, status: int, message: str, param: str | None, extra: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.extra = extra or {}

    def response(self) -> JSONResponse:
        body = {
            **self.extra,
            "error": {"message": self.message, "param": self.param, "type": _kind(self.status)},
        }
        return JSONResponse(body, status_code=self.status)


def _kind(status: int) -> str:
    return {401: "authentication_error", 404: "not_found_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )


def refused(message: str, param: str, status: int = 400) -> Refusal:
    """A weight-push refusal: the error shape plus SGLang's ``success``/``message``."""
    if param not in message:
        message = f"{param}: {message}"
    return Refusal(status, message, param, {"success": False, "message": message})


# --------------------------------------------------------------------------- bodies


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SamplingBody(_Strict):
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop_token_ids: list[int] | None = None


class GenerateBody(_Strict):
    # One prompt, or a batch of them (SGLang's form: lists of prompts, and of rids and
    # sampling params or one for all); token ids, or text with the model's tokenizer.
    input_ids: list[int] | list[list[int]] | None = None
    text: str | list[str] | None = None
    sampling_params: SamplingBody | list[SamplingBody]
    return_logprob: bool = False
    rid: str | list[str] | None = None
    # What SGLang's clients, sglang-router among them, send with these defaults. Taken at
    # those values; any other asks for something dew serve does not do (400 naming it).
    model: str | None = None
    stream: Literal[False] = False
    return_text_in_logprobs: Literal[False] = False
    return_hidden_states: Literal[False] = False
    return_entropy: Literal[False] = False
    return_bytes: Literal[False] = False
    background: Literal[False] = False
    log_metrics: bool = True
    no_logs: bool = False


class AbortBody(_Strict):
    rid: str


class PushBody(_Strict):
    """The run fields every weight push may carry (see :mod:`dew.serving._claim`)."""

    dew_version: int
    dew_run: str | None = None
    dew_restart: bool = False
    dew_takeover: bool = False


class FromDiskBody(PushBody):
    model_path: str


class ReleaseBody(_Strict):
    dew_run: str


class InitGroupBody(_Strict):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "dew"
    backend: str = "gloo"


class FromDistributedBody(PushBody):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "dew"


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


_M = TypeVar("_M", bound=BaseModel)


async def parse_body(request: Request, model: type[_M]) -> _M:
    body = await request.body()
    if len(body) > _MAX_BODY:
        raise Refusal(413, f"the body is over {_MAX_BODY} bytes", "body")
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise Refusal(400, f"malformed JSON body: {exc}", "body") from None
    except RecursionError:  # arrays or objects nested deeper than the parser goes
        raise Refusal(400, "malformed JSON body: nested too deeply", "body") from None
    if not isinstance(data, dict):
        raise Refusal(400, f"the body must be a JSON object, got {type(data).__name__}", "body")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        # A union's member (list[int], SamplingBody, str, ...) is no part of the field.
        loc = [p for p in first["loc"] if not (isinstance(p, str) and _is_type_tag(p))]
        param = ".".join(str(p) for p in loc if isinstance(p, str)) or "body"
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
        kind = first["type"]
        if kind == "extra_forbidden":
            message = f"unknown field {where!r}"
        elif kind == "missing":
            message = f"missing required field {where!r}"
        else:
            message = f"{where or 'body'}: {first['msg']} (got {first.get('input')!r:.80})"
        raise Refusal(400, message, param) from None


def _is_type_tag(part: str) -> bool:
    return "[" in part or part[:1].isupper() or part in ("str", "int", "float", "bool")


# --------------------------------------------------------------------------- state


class ServeState:
    """What the app keeps: the engine, the in-flight requests, the broadcast groups.

    Everything here is touched only on the event loop thread, except the blocking
    weight work, which runs on the executor one job at a time under ``weights_lock``.
    """

    def __init__(
        self,
        engine: RolloutServer,
        *,
        api_key: str | None,
        model_path: str,
        tokenizer_path: str | None,
        tokenizer: Any = None,
        reference: Mapping[str, torch.Tensor] | None,
        weights_dir: Path,
        group_timeout: float,
    ) -> None:
        self.engine = engine
        self.api_key = api_key or None
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path
        self.tokenizer = tokenizer  # for text prompts and answers; None: token ids only
        self.shapes = (
            None
            if reference is None
            else {name: tuple(int(d) for d in t.shape) for name, t in reference.items()}
        )
        self.weights_dir = weights_dir
        # The largest weights file a push may name: the model's tensors at 8 bytes an
        # element (no dtype is wider) and the largest header safetensors allows.
        self.max_weights_bytes = (
            None
            if reference is None
            else 8 * sum(t.numel() for t in reference.values()) + (100 << 20) + 8
        )
        self.inflight: dict[str, Any] = {}  # rid -> the engine's future; loop thread only
        # dew_sha256 of the weights last pushed; None while the initial weights serve.
        self.published: str | None = None
        self.claim = Claim()  # which trainer run holds the weights
        self.groups: dict[str, JoinedGroup] = {}
        # Joining a trainer's group: its connect and every later receive are bounded by
        # group_timeout, and run one at a time on a thread no other work shares.
        self.group_timeout = group_timeout
        self.join_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dew-join")
        self.joining = False
        self._lock: asyncio.Lock | None = None

    @property
    def weights_lock(self) -> asyncio.Lock:
        if self._lock is None:  # made on the loop that uses it
            self._lock = asyncio.Lock()
        return self._lock

    def alive(self) -> bool:
        return self.engine.alive

    def close(self) -> None:
        """Let the join thread go: a join under way ends within ``group_timeout``."""
        self.join_executor.shutdown(wait=True, cancel_futures=True)

    def abort_all(self) -> None:
        """Abort every in-flight request (on shutdown): each answers the abort shape."""
        for future in list(self.inflight.values()):
            self.engine.abort(future)

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Refusal(
                401, "missing API key: send 'Authorization: Bearer <key>'", "authorization"
            )
        if not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise Refusal(401, "invalid API key", "authorization")
