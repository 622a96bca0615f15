"""The recording gateway's ASGI application: OpenAI endpoints over an engine.

Request path, in this order, so that cheap refusals come first and nothing is
recorded for a refused request: authenticate the bearer token (401/409/410), read
the body under the size cap (413), decode JSON (400), validate fields (400), render
and encode the prompt, admit it against the session's caps (400), generate, and
record. Every refusal is an OpenAI-style error body with ``x-should-retry: false``
(the official client would otherwise retry 409 and 5xx answers).

Concurrency invariants:

* the event loop never blocks: rendering, encoding and detokenization run on the
  gateway's bounded thread pool, which the gateway owns and joins, except the
  detokenization of a completion of at most ``_INLINE_FINISH`` tokens (tens of
  microseconds, less loop time than the hand-off to the pool costs); generation is
  ``engine.submit`` (which never blocks) awaited as a future, so no thread is parked
  per request while the engine works;
* every granted request ends exactly once (recorded, or released), also when its
  client disconnects or its coroutine is cancelled; an abandoned request sets its
  stop event (and a cancelled choice calls ``engine.abort`` on its future) so the
  engine drops it within one decode step;
* each call is sampled with one :class:`dew.core.SamplingParams`: the gateway's own
  (``GatewayConfig.sampling``), with the request's values when clients may choose,
  the granted ``max_tokens``, and the stop ids plus the request's one-token stops;
* a streamed response sends its opening chunk (the role) before generation ends and
  its content only after the call was recorded, so a client never sees text that
  was not recorded. The engine returns whole calls, so the content chunks (one per
  token) arrive together once the call is complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from dew.core import Call, Engine, SamplingParams, error_text
from dew.gateway import _protocol as wire
from dew.gateway import _responses as shape
from dew.gateway._protocol import RequestError, RequestSampling
from dew.gateway._responses import Choice
from dew.gateway._sessions import Grant, SessionTable
from dew.gateway._text import (
    Prefix,
    decode,
    encode,
    finish_call,
    render_chat,
    single_token_stops,
)

__all__ = ["GatewayConfig", "build_app"]

log = logging.getLogger("dew.gateway")

_NO_RETRY = {"x-should-retry": "false"}


@dataclass(frozen=True)
class GatewayConfig:
    """What the app serves with.

    ``sampling`` is the gateway's own: its temperature, top-k and top-p sample every
    call unless ``client_sampling``; its ``stop_ids`` (resolved: never ``None``) end
    every call. Its ``max_tokens`` is the per-call cap, which the session table applies.
    """

    model_name: str
    max_body_bytes: int
    max_n: int
    sampling: SamplingParams
    client_sampling: bool

    def __post_init__(self) -> None:
        if self.sampling.stop_ids is None:
            raise ValueError("GatewayConfig.sampling.stop_ids must be resolved, not None")


class _ClientGone(Exception):
    """The client disconnected; nobody reads the answer."""


def _error(err: RequestError, *, close: bool = False) -> JSONResponse:
    headers = dict(_NO_RETRY)
    if close:
        headers["connection"] = "close"
    return JSONResponse(wire.error_body(err), status_code=err.status, headers=headers)


def _sse(obj: object) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _parse_json(raw: bytes) -> object:
    if not raw.strip():
        raise RequestError(
            400, "the request body is empty; send a JSON object", code="invalid_body"
        )
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise RequestError(
            400, f"the request body is not valid JSON: {reason}", code="invalid_json"
        ) from None


def _is_count(header: str) -> bool:
    return header.isascii() and header.isdigit()


class _Body:
    """Reads an ASGI request body under a size cap; remembers whether it was consumed."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.done = False

    async def _chunks(self) -> AsyncIterator[bytes]:
        while not self.done:
            msg = await self.request.receive()
            if msg["type"] == "http.disconnect":
                self.done = True
                raise _ClientGone
            if not msg.get("more_body", False):
                self.done = True
            yield msg.get("body", b"")

    async def read(self, limit: int) -> bytes:
        declared = self.request.headers.get("content-length")
        if declared is not None and (not _is_count(declared) or int(declared) > limit):
            raise self._too_large(limit, declared)
        parts, size = [], 0
        async for chunk in self._chunks():
            size += len(chunk)
            if size > limit:
                raise self._too_large(limit, None)
            parts.append(chunk)
        return b"".join(parts)

    @staticmethod
    def _too_large(limit: int, declared: str | None) -> RequestError:
        if declared is not None and not _is_count(declared):
            return RequestError(
                400, "the Content-Length header is not a number", code="invalid_body"
            )
        return RequestError(
            413, f"the request body exceeds {limit} bytes (max_body_bytes)", code="body_too_large"
        )

    async def drain(self, cap: int) -> bool:
        """Discard the rest of the body so the client can read our answer; False past ``cap``."""
        size = 0
        with contextlib.suppress(_ClientGone):
            async for chunk in self._chunks():
                size += len(chunk)
                if size > cap:
                    return False
        return True


async def _watch_disconnect(request: Request, stop: threading.Event) -> None:
    # After the body is read, the server's next message is the disconnect.
    while True:
        try:
            msg = await request.receive()
        except Exception:  # the connection is in a state we cannot read: stop watching
            log.debug("disconnect watcher ended", exc_info=True)
            return
        if msg["type"] == "http.disconnect":
            stop.set()
            return


# Completions up to this many tokens are decoded on the event loop: decoding a few tokens
# with a small tokenizer measured cheaper than the loop's share of the hand-off to the
# pool and back (bench/RESULTS.md, "gateway: profile").
_INLINE_FINISH = 8


@dataclass(frozen=True)
class _Prompt:
    ids: np.ndarray  # [n] int64
    text: str


@dataclass(frozen=True)
class _Kind:
    """One endpoint family: how to parse, build the prompt and shape the answer."""

    parse: Callable[[object], Any]
    prompt: Callable[[Any, tuple[Prefix, ...]], _Prompt]
    response: Callable[[str, str, int, Sequence[Choice], bool], dict[str, Any]]
    opening: Callable[[str, str, int], dict[str, Any]]
    stream: Callable[..., list[dict[str, Any]]]
    id_prefix: str


class _Service:
    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        table: SessionTable,
        config: GatewayConfig,
        pool: Executor,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.table = table
        self.config = config
        self.pool = pool
        self.vocab_size = len(tokenizer)
        self._tasks: set[asyncio.Future[list[Choice]]] = set()
        self.kinds = {
            "chat": _Kind(
                parse=lambda body: wire.parse_chat(body, max_n=config.max_n),
                prompt=self._chat_prompt,
                response=shape.chat_response,
                opening=shape.chat_opening,
                stream=shape.chat_stream,
                id_prefix="chatcmpl-",
            ),
            "completion": _Kind(
                parse=lambda body: wire.parse_completion(
                    body, max_n=config.max_n, vocab_size=self.vocab_size
                ),
                prompt=self._completion_prompt,
                response=shape.completion_response,
                opening=shape.completion_opening,
                stream=shape.completion_stream,
                id_prefix="cmpl-",
            ),
        }

    # ------------------------------------------------------------------ prompts

    def _chat_prompt(self, req: wire.ChatRequest, history: tuple[Prefix, ...]) -> _Prompt:
        text = render_chat(self.tokenizer, req.messages, req.tools)
        return _Prompt(encode(self.tokenizer, text, history, add_special_tokens=False), text)

    def _completion_prompt(
        self, req: wire.CompletionRequest, history: tuple[Prefix, ...]
    ) -> _Prompt:
        if isinstance(req.prompt, str):
            ids = encode(self.tokenizer, req.prompt, history, add_special_tokens=True)
            return _Prompt(ids, req.prompt)
        ids = np.asarray(req.prompt, dtype=np.int64)
        return _Prompt(ids, decode(self.tokenizer, req.prompt))

    # ------------------------------------------------------------------ sampling

    def _params(self, s: RequestSampling) -> SamplingParams:
        """The request's sampling (before its grant sets ``max_tokens`` and stop ids)."""
        c = self.config
        if not c.client_sampling:
            # The trained policy's sampling, whatever the harness asks for: every
            # recorded call then comes from the distribution the objective assumes.
            return c.sampling
        base = c.sampling
        temperature = base.temperature if s.temperature is None else s.temperature
        if temperature <= 0:
            raise RequestError(
                400,
                "'temperature' must be > 0: a greedy call has no sampling distribution to train on",
                param="temperature",
                code="invalid_value",
            )
        try:
            return replace(
                base,
                temperature=temperature,
                top_p=base.top_p if s.top_p is None else s.top_p,
                top_k=base.top_k if s.top_k is None else s.top_k,
            )
        except ValueError as exc:  # SamplingParams' bounds: this request's values alone
            field = str(exc).split(" ", 1)[0]
            raise RequestError(400, str(exc), param=field, code="invalid_value") from None

    # ------------------------------------------------------------------ generation

    def _submit(self, prompt: _Prompt, params: SamplingParams, grant: Grant) -> Future[Call]:
        """The engine's future for one choice; a refusal at submit becomes its exception."""
        try:
            return self.engine.submit(
                prompt.ids, params, stop=grant.stop, affinity=grant.session.key.group
            )
        except Exception as exc:  # bad input (ValueError) or a closed engine, said at once
            failed: Future[Call] = Future()
            failed.set_exception(exc)
            return failed

    def _finish(
        self, prompt: _Prompt, call: Call, stop_ids: Collection[int], stops: Sequence[str]
    ) -> tuple[Call, Choice, Prefix]:
        recorded, choice, completion_text = finish_call(self.tokenizer, call, stop_ids, stops)
        ids = np.concatenate([prompt.ids, np.asarray(recorded.completion, dtype=np.int64)])
        return recorded, choice, Prefix(prompt.text + completion_text, ids)

    async def _one(
        self, prompt: _Prompt, grant: Grant, params: SamplingParams, stops: Sequence[str]
    ) -> tuple[Call, Choice, Prefix]:
        future = self._submit(prompt, params, grant)
        try:
            call = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.engine.abort(future)  # nobody will read it
            raise
        stop_ids = frozenset(params.stop_ids or ())
        if len(call.completion) <= _INLINE_FINISH:
            # Decoding a short completion costs the loop less than the hand-off to the
            # pool and back would (two thread wake-ups and a future chained each way).
            return self._finish(prompt, call, stop_ids, stops)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self._finish, prompt, call, stop_ids, stops)

    async def _generate(
        self, grant: Grant, prompt: _Prompt, sampling: RequestSampling, params: SamplingParams
    ) -> list[Choice]:
        """Generate and record all choices, or release the grant and raise."""
        extra_ids, _ = single_token_stops(self.tokenizer, sampling.stop)
        stop_ids = set(self.config.sampling.stop_ids or ()) | extra_ids
        params = replace(params, max_tokens=grant.max_tokens, stop_ids=tuple(sorted(stop_ids)))
        futures = [
            asyncio.ensure_future(self._one(prompt, grant, params, sampling.stop))
            for _ in range(sampling.n)
        ]
        try:
            done, pending = await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
            aborted = grant.stop.is_set()  # by a close or a disconnect, before any sibling stop
            if pending:  # one choice failed: the others are useless
                grant.stop.set()
                await asyncio.wait(pending)
        except BaseException:  # cancelled with the client gone: abort and release
            grant.stop.set()
            for f in futures:
                f.cancel()
            self.table.release(grant)
            raise
        first = next((f.exception() for f in futures if f in done and f.exception()), None)
        if first is None:
            results = [f.result() for f in futures]
            if self.table.record(grant, [r[0] for r in results], [r[2] for r in results]):
                return [r[1] for r in results]
            aborted = True
        else:
            self._release_failed(grant, first, aborted)
        status = self.table.status(grant.session)
        if status is not None:
            raise status
        raise _ClientGone

    def _release_failed(self, grant: Grant, exc: BaseException, aborted: bool) -> None:
        if aborted or isinstance(exc, RequestError):
            self.table.release(grant)
            if isinstance(exc, RequestError):
                raise exc
            return
        if isinstance(exc, ValueError):  # the engine refused this input
            self.table.release(grant)
            raise RequestError(
                400, f"the engine refused the request: {exc}", code="engine_rejected"
            ) from None
        text = f"engine failure: {error_text(exc)}"
        log.error("%s for %s", text, grant.session.key, exc_info=exc)
        self.table.release(grant, error=text)
        raise RequestError(500, text, code="engine_error", kind="server_error") from None

    # ------------------------------------------------------------------ endpoints

    async def serve(self, request: Request, kind_name: str) -> Response:
        kind = self.kinds[kind_name]
        body = _Body(request)
        session = None
        try:
            session = self.table.authenticate(request.headers.get("authorization"))
            req = kind.parse(_parse_json(await body.read(self.config.max_body_bytes)))
            params = self._params(req.sampling)
            loop = asyncio.get_running_loop()
            history = self.table.history(session)
            prompt = await loop.run_in_executor(self.pool, kind.prompt, req, history)
            grant = self.table.grant(
                session,
                n=req.sampling.n,
                requested=req.sampling.max_tokens,
                prompt_len=len(prompt.ids),
            )
        except RequestError as err:
            ok = body.done or await body.drain(4 * self.config.max_body_bytes + (1 << 20))
            return _error(err, close=not ok)
        except _ClientGone:
            return Response(status_code=499)
        except Exception as exc:  # a gateway bug: the session's outcome is not the agent's
            if session is not None:
                self.table.fail(session, f"gateway failure: {error_text(exc)}")
            raise
        rid = kind.id_prefix + secrets.token_hex(12)
        # Generation runs as its own task, watched for the client's disconnect, so the
        # grant is released even when a streaming response is never iterated.
        task = asyncio.ensure_future(self._watched(request, grant, prompt, req.sampling, params))
        self._tasks.add(task)
        task.add_done_callback(self._reap)
        if req.sampling.stream:
            return StreamingResponse(
                self._stream(kind, rid, grant, task, len(prompt.ids), req.sampling),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache"},
            )
        try:
            choices = await asyncio.shield(task)
        except RequestError as err:
            return _error(err)
        except _ClientGone:
            return Response(status_code=499)
        except BaseException:
            grant.stop.set()
            raise
        try:
            out = kind.response(
                rid, self.config.model_name, len(prompt.ids), choices, req.sampling.logprobs
            )
        except Exception as exc:  # recorded, but the agent never got it
            self.table.fail(grant.session, f"gateway failure: {error_text(exc)}")
            raise
        return JSONResponse(out)

    def _reap(self, task: asyncio.Future[list[Choice]]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved here: the awaiting response may be gone

    async def _watched(
        self,
        request: Request,
        grant: Grant,
        prompt: _Prompt,
        sampling: RequestSampling,
        params: SamplingParams,
    ) -> list[Choice]:
        watcher = asyncio.ensure_future(_watch_disconnect(request, grant.stop))
        try:
            return await self._generate(grant, prompt, sampling, params)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _stream(
        self,
        kind: _Kind,
        rid: str,
        grant: Grant,
        task: asyncio.Future[list[Choice]],
        prompt_tokens: int,
        sampling: RequestSampling,
    ) -> AsyncIterator[str]:
        model = self.config.model_name
        try:
            yield _sse(kind.opening(rid, model, sampling.n))
            choices = await asyncio.shield(task)
        except RequestError as err:
            yield _sse(wire.error_body(err))
            return
        except _ClientGone:
            return
        except BaseException:  # the response was cancelled: nobody will read the call
            grant.stop.set()
            raise
        for chunk in kind.stream(
            rid,
            model,
            prompt_tokens,
            choices,
            logprobs=sampling.logprobs,
            include_usage=sampling.include_usage,
        ):
            yield _sse(chunk)
        yield "data: [DONE]\n\n"

    async def models(self, request: Request, model_id: str | None = None) -> Response:
        try:
            self.table.authenticate(request.headers.get("authorization"))
        except RequestError as err:
            return _error(err)
        card = {
            "id": self.config.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "dew",
            "version": int(self.engine.version),
        }
        if model_id is None:
            return JSONResponse({"object": "list", "data": [card]})
        if model_id != self.config.model_name:
            return _error(
                RequestError(
                    404,
                    f"model {model_id!r} is not served here; it serves {self.config.model_name!r}",
                    param="model",
                    code="model_not_found",
                    kind="not_found_error",
                )
            )
        return JSONResponse(card)


_MODEL_PREFIX = "/v1/models/"  # + a model id: that model's card


class _App:
    """The ASGI application: four routes dispatched by method and path.

    No framework sits between uvicorn and the service: the endpoints read the raw
    request (the body under its cap, the bearer token) and answer whole responses, so
    routing by a dict costs less per call than a stack of middleware would.
    """

    def __init__(self, service: _Service) -> None:
        self.service = service
        self.routes: dict[str, dict[str, Callable[[Request], Awaitable[Response]]]] = {
            "/v1/chat/completions": {"POST": self._chat},
            "/v1/completions": {"POST": self._completions},
            "/v1/models": {"GET": service.models},
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # uvicorn runs with lifespan and websockets off
            raise RuntimeError(f"the gateway serves HTTP only, not {scope['type']!r}")
        request = Request(scope, receive)
        response = await self._route(request, scope["path"], scope["method"])
        await response(scope, receive, send)

    async def _route(self, request: Request, path: str, method: str) -> Response:
        methods = self.routes.get(path)
        if methods is None and path.startswith(_MODEL_PREFIX) and len(path) > len(_MODEL_PREFIX):
            model_id = path[len(_MODEL_PREFIX) :]
            methods = {"GET": lambda r: self.service.models(r, model_id)}
        if methods is None:
            return _error(RequestError(404, "Not Found", code="not_found"))
        endpoint = methods.get(method)
        if endpoint is None:
            response = _error(RequestError(405, "Method Not Allowed"))
            response.headers["allow"] = ", ".join(methods)
            return response
        return await endpoint(request)

    async def _chat(self, request: Request) -> Response:
        return await self._guarded(request, "chat")

    async def _completions(self, request: Request) -> Response:
        return await self._guarded(request, "completion")

    async def _guarded(self, request: Request, kind: str) -> Response:
        try:
            return await self.service.serve(request, kind)
        except Exception as exc:  # a gateway bug: answer 500 and say so, never crash
            log.exception("gateway failure on %s", request.url.path)
            return _error(
                RequestError(
                    500,
                    f"gateway failure: {error_text(exc)}",
                    code="gateway_error",
                    kind="server_error",
                )
            )


def build_app(
    engine: Engine, tokenizer: Any, table: SessionTable, config: GatewayConfig, pool: Executor
) -> ASGIApp:
    """The gateway's ASGI application over ``engine``, recording into ``table``."""
    return _App(_Service(engine, tokenizer, table, config, pool))
