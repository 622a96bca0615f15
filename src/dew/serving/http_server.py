"""The HTTP face of one engine process (``dew serve``): a FastAPI app over a RolloutServer.

The protocol follows SGLang's native API where the two overlap, so one client drives
both; dew's additions are fields prefixed ``dew_``. The contract is ``notes/wire.md``.

Supported subset of SGLang's API:

* ``POST /generate``: ``input_ids`` (one prompt; ``text`` prompts and batches are
  refused), ``sampling_params`` with ``max_new_tokens``, ``temperature``, ``top_k``
  (-1 = off), ``top_p``, ``stop_token_ids`` (absent/null = the model's eos ids, ``[]`` =
  never stop early), ``return_logprob`` and ``rid``. Answers ``output_ids`` and
  ``meta_info`` with ``id``, ``finish_reason`` (``stop`` with ``matched``, ``length``
  with ``length``, or ``abort``), ``prompt_tokens``, ``completion_tokens``,
  ``output_token_logprobs`` (``[logprob, token_id, null]`` per token, with
  ``return_logprob``) and ``weight_version``.
* ``POST /abort_request`` (``rid``), ``POST /update_weights_from_disk``
  (``model_path``), ``POST /init_weights_update_group`` and
  ``POST /update_weights_from_distributed`` (SGLang's names and fields), ``GET /health``
  and ``GET /get_model_info``.

dew's extensions:

* ``/generate``: request ``dew_return_support`` (per-token support ids); response
  ``meta_info.weight_version`` is an int, the *oldest* weights version that served any
  token (``Call.version``); ``meta_info.dew_temperature`` (the temperature the log-probs
  are under, 1.0 for greedy) and ``meta_info.dew_support``.
* Weight pushes carry ``dew_version`` (required) and are refused (400, the old weights
  keep serving) unless it is newer than the served version; a file's own
  ``dew_version`` must equal it, and its checksum must match (:mod:`dew.serving.weights`).
* ``/health`` and ``/get_model_info`` report ``dew_version``; model info also
  ``dew_max_len``, ``dew_vocab_size`` and ``dew_eos_token_ids``.
* Errors are ``{"error": {"message", "param", "type"}}`` with a 4xx naming the field;
  weight-push refusals add SGLang's ``{"success": false, "message"}``. A closed or broken
  engine answers 503. With an API key, every endpoint but ``/health`` needs
  ``Authorization: Bearer <key>`` (401 otherwise).

Invariants:

* Threads: uvicorn's event loop thread runs every handler and owns the request table
  (rid -> future); the engine thread (the RolloutServer's) owns the model. A handler
  never blocks the loop on generation: it awaits ``asyncio.wrap_future`` of the
  engine's future, whose done-callback (on the engine thread) only schedules the wake-up.
  Weight reads, loads and broadcast receives run on the default executor, one at a
  time under one lock, so pushes are ordered and the version check holds.
* Every accepted ``/generate`` resolves exactly once: with the call, with the abort
  shape (``/abort_request``, the client disconnecting, or the server shutting down all
  call ``engine.abort``, and the engine resolves the future within one iteration), or
  with 503 (engine closed or broken). Its rid leaves the table when the handler ends,
  however it ends, and an unfinished request is aborted then.
* Bad input is refused before it reaches the engine; nothing is half-applied. A weight
  push is checked whole (file, checksum, version, names, shapes) before the engine
  copies anything, and the engine copies between two iterations.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from dew.core import Aborted, SamplingParams
from dew.serving.weights import (
    JoinedGroup,
    WeightsError,
    checksum,
    join_group,
    open_weights,
    receive_tensors,
)

if TYPE_CHECKING:
    import torch

    from dew.serving.server import RolloutServer

__all__ = ["ServeState", "build_app"]

_MAX_BODY = 64 << 20


class _Bad(Exception):
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


def _refused(message: str, param: str, status: int = 400) -> _Bad:
    """A weight-push refusal: the error shape plus SGLang's ``success``/``message``."""
    if param not in message:
        message = f"{param}: {message}"
    return _Bad(status, message, param, {"success": False, "message": message})


# --------------------------------------------------------------------------- bodies


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Sampling(_Strict):
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop_token_ids: list[int] | None = None


class _Generate(_Strict):
    input_ids: list[int]
    sampling_params: _Sampling
    return_logprob: bool = False
    rid: str | None = None
    dew_return_support: bool = False


class _Abort(_Strict):
    rid: str


class _FromDisk(_Strict):
    model_path: str
    dew_version: int


class _InitGroup(_Strict):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "dew"
    backend: str = "gloo"


class _FromDistributed(_Strict):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "dew"
    dew_version: int


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


_M = TypeVar("_M", bound=BaseModel)


async def _parse(request: Request, model: type[_M]) -> _M:
    body = await request.body()
    if len(body) > _MAX_BODY:
        raise _Bad(413, f"the body is over {_MAX_BODY} bytes", "body")
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _Bad(400, f"malformed JSON body: {exc}", "body") from None
    if not isinstance(data, dict):
        raise _Bad(400, f"the body must be a JSON object, got {type(data).__name__}", "body")
    if model is _Generate and "text" in data:
        raise _Bad(400, "text prompts are not supported; send input_ids (token ids)", "text")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = first["loc"]
        param = ".".join(str(p) for p in loc if isinstance(p, str)) or "body"
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
        kind = first["type"]
        if kind == "extra_forbidden":
            message = f"unknown field {where!r}"
        elif kind == "missing":
            message = f"missing required field {where!r}"
        else:
            message = f"{where or 'body'}: {first['msg']} (got {first.get('input')!r:.80})"
        raise _Bad(400, message, param) from None


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
        reference: Mapping[str, torch.Tensor] | None,
    ) -> None:
        self.engine = engine
        self.api_key = api_key or None
        self.model_path = model_path
        self.tokenizer_path = tokenizer_path
        self.shapes = (
            None
            if reference is None
            else {name: tuple(int(d) for d in t.shape) for name, t in reference.items()}
        )
        self.inflight: dict[str, Any] = {}  # rid -> the engine's future; loop thread only
        # dew_sha256 of the weights last pushed; None while the initial weights serve.
        self.published: str | None = None
        self.groups: dict[str, JoinedGroup] = {}
        self._lock: asyncio.Lock | None = None

    @property
    def weights_lock(self) -> asyncio.Lock:
        if self._lock is None:  # made on the loop that uses it
            self._lock = asyncio.Lock()
        return self._lock

    def alive(self) -> bool:
        return self.engine.alive

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
            raise _Bad(401, "missing API key: send 'Authorization: Bearer <key>'", "authorization")
        if not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise _Bad(401, "invalid API key", "authorization")


# --------------------------------------------------------------------------- generate


def _sampling(state: ServeState, req: _Generate) -> SamplingParams:
    """The request's SamplingParams, once everything the model decides is checked."""
    vocab, max_len = state.engine.vocab_size, state.engine.max_len
    ids, sp, p = req.input_ids, req.sampling_params, "sampling_params."
    if not ids:
        raise _Bad(400, "input_ids is empty; it needs at least one token id", "input_ids")
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise _Bad(
                400, f"input_ids[{i}] = {t} is outside the vocabulary [0, {vocab})", "input_ids"
            )
    if sp.max_new_tokens < 1:
        raise _Bad(
            400, f"max_new_tokens must be >= 1, got {sp.max_new_tokens}", p + "max_new_tokens"
        )
    if len(ids) >= max_len:
        message = f"input_ids has {len(ids)} tokens; the context length {max_len} leaves no room"
        raise _Bad(400, message, "input_ids")
    if len(ids) + sp.max_new_tokens > max_len:
        message = f"len(input_ids) + max_new_tokens = {len(ids)} + {sp.max_new_tokens} > {max_len}"
        raise _Bad(400, message + " (the context length)", p + "max_new_tokens")
    if not math.isfinite(sp.temperature) or sp.temperature < 0:
        raise _Bad(
            400, f"temperature must be finite and >= 0, got {sp.temperature}", p + "temperature"
        )
    if sp.top_k != -1 and sp.top_k < 1:
        raise _Bad(400, f"top_k must be -1 (off) or >= 1, got {sp.top_k}", p + "top_k")
    if not 0.0 < sp.top_p <= 1.0:
        raise _Bad(400, f"top_p must be in (0, 1], got {sp.top_p}", p + "top_p")
    stops = sp.stop_token_ids
    for i, t in enumerate(stops or ()):
        if not 0 <= t < vocab:
            message = f"stop_token_ids[{i}] = {t} is outside the vocabulary [0, {vocab})"
            raise _Bad(400, message, p + "stop_token_ids")
    try:
        return SamplingParams(
            max_tokens=sp.max_new_tokens,
            temperature=sp.temperature,
            top_k=None if sp.top_k == -1 else sp.top_k,
            top_p=None if sp.top_p == 1.0 else sp.top_p,
            stop_ids=None if stops is None else tuple(stops),
        )
    except ValueError as exc:
        raise _Bad(400, str(exc), "sampling_params") from None


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _answer(rid: str, prompt: int, req: _Generate, call: Any) -> dict[str, Any]:
    completion = [int(t) for t in call.completion]
    n = len(completion)
    if call.finish_reason == "stop":
        finish: dict[str, Any] = {"type": "stop", "matched": completion[-1]}
    else:
        finish = {"type": "length", "length": n}
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": prompt,
        "completion_tokens": n,
        "weight_version": int(call.version),
        "dew_temperature": float(call.temperature),
        "dew_support": (
            [[int(s) for s in row] for row in call.support]
            if req.dew_return_support and call.support is not None
            else None
        ),
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = [
            [float(lp), t, None] for lp, t in zip(call.log_probs, completion, strict=True)
        ]
    return {"output_ids": completion, "meta_info": meta}


def _aborted(rid: str, prompt: int, req: _Generate, exc: Aborted, version: int) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": {"type": "abort"},
        "prompt_tokens": prompt,
        "completion_tokens": int(exc.tokens),
        "weight_version": version,
        "dew_temperature": req.sampling_params.temperature or 1.0,
        "dew_support": None,
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = []
    return {"output_ids": [], "meta_info": meta}


async def _generate(state: ServeState, request: Request) -> Response:
    state.authorize(request)
    req = await _parse(request, _Generate)
    params = _sampling(state, req)
    rid = req.rid if req.rid is not None else uuid.uuid4().hex
    if not rid:
        raise _Bad(400, "rid must be a non-empty string", "rid")
    if rid in state.inflight:
        raise _Bad(400, f"rid {rid!r} is already in flight", "rid")
    engine = state.engine
    try:
        future = engine.submit(req.input_ids, params)
    except ValueError as exc:  # checked above; the engine's own word as a fallback
        raise _Bad(400, str(exc), "input_ids") from None
    except RuntimeError as exc:
        raise _Bad(503, f"the engine is not serving: {exc}", None) from None
    state.inflight[rid] = future
    watcher = asyncio.ensure_future(_disconnected(request))
    result = asyncio.wrap_future(future)
    try:
        await asyncio.wait({watcher, result}, return_when=asyncio.FIRST_COMPLETED)
        if not result.done():
            engine.abort(future)  # the client left; the engine drops it within an iteration
        try:
            call = await result
        except Aborted as exc:
            return JSONResponse(_aborted(rid, len(req.input_ids), req, exc, engine.version))
        except RuntimeError as exc:
            raise _Bad(503, f"the engine is not serving: {exc}", None) from None
        return JSONResponse(_answer(rid, len(req.input_ids), req, call))
    finally:
        watcher.cancel()
        if not future.done():  # this handler was cancelled: nobody will read the answer
            engine.abort(future)
        state.inflight.pop(rid, None)


# --------------------------------------------------------------------------- weights


def _check_newer(state: ServeState, version: int, digest: str | None) -> bool:
    """Whether a push of ``version`` (weights ``digest``) must be loaded; refuses a stale one.

    A version newer than the served one loads. The served version again loads only as
    the first push to a fresh server (which serves its initial weights unpublished, so
    a trainer's first push at that number goes through), and is a no-op when it carries
    the very weights already served (a trainer re-publishing after a resume). Anything
    else is refused: an older version, or other weights under the served number.
    """
    served = state.engine.version
    if version > served:
        return True
    if version == served and state.published is None:
        return True
    if version == served and digest is not None and digest == state.published:
        return False
    raise _refused(
        f"dew_version {version} is not newer than the served version {served}", "dew_version"
    )


async def _from_disk(state: ServeState, request: Request) -> Response:
    state.authorize(request)
    req = await _parse(request, _FromDisk)
    async with state.weights_lock:
        if req.dew_version < state.engine.version:  # stale for sure: refuse before reading
            _check_newer(state, req.dew_version, None)
        try:
            weights = await asyncio.to_thread(open_weights, req.model_path)
        except WeightsError as exc:
            raise _refused(str(exc), "model_path") from None
        version = weights.version
        if version != req.dew_version:
            raise _refused(
                f"{req.model_path} holds dew_version {version}, the request says {req.dew_version}",
                "dew_version",
            )
        if _check_newer(state, version, weights.checksum):
            await _load(state, weights.tensors, version, "model_path")
            state.published = weights.checksum
    return JSONResponse(
        {"success": True, "message": f"serving {req.model_path}", "dew_version": version}
    )


async def _load(state: ServeState, tensors: Mapping[str, Any], version: int, param: str) -> None:
    try:
        await asyncio.to_thread(state.engine.load, tensors, version)
    except ValueError as exc:
        raise _refused(f"the weights do not fit the model: {exc}", param) from None
    except RuntimeError as exc:
        raise _refused(f"the engine is not serving: {exc}", param, 503) from None


async def _init_group(state: ServeState, request: Request) -> Response:
    state.authorize(request)
    req = await _parse(request, _InitGroup)
    if req.backend not in ("gloo", "nccl"):
        raise _refused(f"backend must be 'gloo' or 'nccl', got {req.backend!r}", "backend")
    if req.world_size < 2:
        raise _refused(f"world_size must be >= 2, got {req.world_size}", "world_size")
    if not 1 <= req.rank_offset < req.world_size:
        raise _refused(
            f"rank_offset must be in [1, world_size), got {req.rank_offset}", "rank_offset"
        )
    if not 0 < req.master_port < 65536:
        raise _refused(f"master_port must be a TCP port, got {req.master_port}", "master_port")
    try:
        joined = await asyncio.to_thread(
            join_group,
            req.master_address,
            req.master_port,
            req.rank_offset,
            req.world_size,
            backend=req.backend,
            group_name=req.group_name,
        )
    except Exception as exc:  # the peer is gone, or the backend is missing
        raise _refused(f"could not join the group: {exc}", "master_address") from None
    state.groups[req.group_name] = joined
    return JSONResponse({"success": True, "message": f"joined {req.group_name!r}"})


def _check_specs(state: ServeState, req: _FromDistributed) -> None:
    if not len(req.names) == len(req.dtypes) == len(req.shapes):
        raise _refused(
            f"names, dtypes and shapes differ in length: {len(req.names)}, "
            f"{len(req.dtypes)}, {len(req.shapes)}",
            "names",
        )
    import torch

    for i, d in enumerate(req.dtypes):
        if not isinstance(getattr(torch, d.removeprefix("torch."), None), torch.dtype):
            raise _refused(f"dtypes[{i}] = {d!r} is not a torch dtype", "dtypes")
    if state.shapes is None:
        return
    for name, shape in zip(req.names, req.shapes, strict=True):
        want = state.shapes.get(name)
        if want is None:
            raise _refused(f"names: {name!r} is not a tensor of the model", "names")
        if tuple(shape) != want:
            raise _refused(f"shapes: {name!r} is {tuple(shape)}, the model has {want}", "shapes")


async def _from_distributed(state: ServeState, request: Request) -> Response:
    state.authorize(request)
    req = await _parse(request, _FromDistributed)
    joined = state.groups.get(req.group_name)
    if joined is None:
        raise _refused(f"no weights update group named {req.group_name!r}", "group_name")
    _check_specs(state, req)
    async with state.weights_lock:
        # Strictly newer only: the digest of a broadcast is known only once it arrived,
        # and a refusal after joining would strand the sender (a first publish at the
        # initial version goes by file).
        if req.dew_version <= state.engine.version:
            raise _refused(
                f"dew_version {req.dew_version} is not newer than the served version "
                f"{state.engine.version}",
                "dew_version",
            )
        try:
            tensors = await asyncio.to_thread(
                receive_tensors, joined, req.names, req.dtypes, req.shapes
            )
        except Exception as exc:  # a broken group cannot be trusted again
            state.groups.pop(req.group_name, None)
            raise _refused(f"the broadcast failed: {exc}", "group_name") from None
        await _load(state, tensors, req.dew_version, "names")
        state.published = await asyncio.to_thread(checksum, tensors)
    return JSONResponse(
        {"success": True, "message": "serving the broadcast", "dew_version": req.dew_version}
    )


# --------------------------------------------------------------------------- app


def build_app(
    engine: RolloutServer,
    *,
    api_key: str | None = None,
    model_path: str = "",
    tokenizer_path: str | None = None,
    reference: Mapping[str, torch.Tensor] | None = None,
) -> tuple[FastAPI, ServeState]:
    """The app serving ``engine``, and its state (``abort_all`` for shutdown).

    ``reference`` (the served model's state dict) lets a broadcast push be checked by
    name and shape before any tensor is received.
    """
    state = ServeState(
        engine,
        api_key=api_key,
        model_path=model_path,
        tokenizer_path=tokenizer_path,
        reference=reference,
    )
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    def route(path: str, handler: Any, method: str = "POST") -> None:
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(state, request)
            except _Bad as exc:
                return exc.response()

        app.add_api_route(path, endpoint, methods=[method])

    async def health(state: ServeState, request: Request) -> Response:
        del request
        version = state.engine.version
        if not state.alive():
            raise _Bad(503, "the engine thread is not running", None)
        return JSONResponse({"status": "ok", "dew_version": version})

    async def model_info(state: ServeState, request: Request) -> Response:
        state.authorize(request)
        engine = state.engine
        return JSONResponse(
            {
                "model_path": state.model_path,
                "tokenizer_path": state.tokenizer_path,
                "is_generation": True,
                "dew_version": engine.version,
                "dew_max_len": engine.max_len,
                "dew_vocab_size": engine.vocab_size,
                "dew_eos_token_ids": list(engine.eos_token_ids),
            }
        )

    async def abort_request(state: ServeState, request: Request) -> Response:
        state.authorize(request)
        req = await _parse(request, _Abort)
        future = state.inflight.get(req.rid)
        if future is None or future.done():
            return JSONResponse({"success": False, "message": f"no request {req.rid!r} in flight"})
        state.engine.abort(future)
        return JSONResponse({"success": True})

    route("/generate", _generate)
    route("/abort_request", abort_request)
    route("/update_weights_from_disk", _from_disk)
    route("/init_weights_update_group", _init_group)
    route("/update_weights_from_distributed", _from_distributed)
    route("/health", health, "GET")
    route("/get_model_info", model_info, "GET")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        del request
        return _Bad(exc.status_code, str(exc.detail), None).response()

    return app, state
