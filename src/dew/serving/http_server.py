"""The HTTP face of one engine process (``dew serve``): a FastAPI app over a RolloutServer.

The protocol follows SGLang's native API where the two overlap, so one client drives
both; dew's additions are fields prefixed ``dew_``. This docstring is the contract.

Supported subset of SGLang's API:

* ``POST /generate``: ``input_ids`` or ``text`` (with the model's tokenizer), one
  prompt or a batch (a list of prompts; ``rid`` then a list, ``sampling_params`` one
  for all or a list), ``sampling_params`` with ``max_new_tokens``, ``temperature``,
  ``top_k`` (-1 = off), ``top_p``, ``stop_token_ids`` (absent/null = the model's eos
  ids, ``[]`` = never stop early), ``return_logprob`` and ``rid``. Answers (a list, for
  a batch, in its order, once all of it is done) ``output_ids``, ``text`` (the
  completion decoded without special tokens, when the server has a tokenizer) and
  ``meta_info`` with ``id``, ``finish_reason`` (``stop`` with ``matched``, ``length``
  with ``length``, or ``abort``), ``prompt_tokens``, ``completion_tokens``,
  ``output_token_logprobs`` (``[logprob, token_id, null]`` per token, with
  ``return_logprob``) and ``weight_version``. Greedy requests (``temperature`` 0)
  answer log-prob 0.0 per token with ``dew_temperature`` 1.0 and a one-id support,
  where SGLang answers the model's log-probs: 0.0 is the probability of the token
  under the distribution that drew it (a point mass), which is what a trainer's
  importance ratio needs, and the model's own log-probs are what the trainer's
  forward computes anyway.
* ``POST /abort_request`` (``rid``), ``POST /update_weights_from_disk``
  (``model_path``), ``POST /init_weights_update_group`` and
  ``POST /update_weights_from_distributed`` (SGLang's names and fields), ``GET /health``
  and ``GET /get_model_info``.

dew's extensions:

* ``/generate``: response ``meta_info.weight_version`` is an int, the *oldest* weights
  version that served any token (``Call.version``); ``meta_info.dew_temperature`` (the
  temperature the log-probs are under, 1.0 for greedy) and ``meta_info.dew_support``
  (each token's support ids, when the sampling params filter or are greedy; else null).
  Nothing dew needs rides on a request field of its own, so requests relayed by
  sglang-router (which rebuilds the body from SGLang's fields: it drops unknown ones
  and adds ``model``, ``stream`` and other flags at their defaults) lose nothing; those
  flags are accepted at SGLang's defaults.
* Weight pushes carry ``dew_version`` (required) and are refused (400, the old weights
  keep serving) unless it is newer than the served version; a file's own
  ``dew_version`` must equal it, and its checksum must match (:mod:`dew.serving.weights`).
  A file push names a regular file under the server's weights folder (``--weights-dir``),
  no larger than the model's tensors could make it; anything else is refused before it
  is read, and no refusal quotes a file's bytes. A join of a trainer's broadcast group
  runs one at a time on a thread of its own, and it and every receive in the group wait
  at most ``group_timeout`` seconds (409 while another join is under way).
* Runs: a push may name its trainer run (``dew_run``), say it starts the run's version
  sequence (``dew_restart``) or take the server over (``dew_takeover``); the run of
  the last push holds the server until ``POST /dew/release {"dew_run"}``, and another
  run's push meanwhile gets a 409 naming the holder (:mod:`dew.serving._claim`). A
  push that starts a sequence loads whatever its version, after aborting every
  request in flight.
* A request whose draw fails on its own values (logits that overflow over its
  temperature) fails alone with a 422; the other requests of its batch go on.
* ``/health`` and ``/get_model_info`` report ``dew_version`` and ``dew_run`` (the run
  holding the server, or null); health also
  ``dew_in_flight``, the ``/generate`` requests being served; model info also
  ``dew_device`` (where the model runs), ``dew_max_len``, ``dew_vocab_size`` and
  ``dew_eos_token_ids``.
* ``GET /dew/timings``: the engine's iterations by active-sequence count, cumulative
  since it started (:meth:`~dew.serving.RolloutServer.timings`), as
  ``{"engines": [EngineTimings.to_json(), ...]}`` (:mod:`dew.core.sketch`): one entry,
  named ``"local"``, with ``max_active`` the server's ``--max-batch`` and
  ``iterations`` ``{"<active>": [iterations, seconds], ...}``. A reader takes the
  difference of two reads for what ran between them.
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
import math
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from dew.core import Aborted, SamplingParams, scored_temperature
from dew.serving._folders import weights_root
from dew.serving._http_common import (
    AbortBody,
    GenerateBody,
    Refusal,
    SamplingBody,
    ServeState,
    parse_body,
)
from dew.serving._http_weights import from_disk, from_distributed, init_group, release

if TYPE_CHECKING:
    import torch

    from dew.serving.server import RolloutServer

__all__ = ["ServeState", "build_app"]

# --------------------------------------------------------------------------- generate


@dataclass(frozen=True)
class _Item:
    """One prompt of a ``/generate`` (the only one, or one of a batch), checked."""

    ids: list[int]
    params: SamplingParams
    rid: str


def _items(state: ServeState, req: GenerateBody) -> tuple[list[_Item], bool]:
    """The request's prompts, each checked, and whether it came as a batch (SGLang's
    form: lists of prompts, and of rids and sampling params or one for all)."""
    if (req.input_ids is None) == (req.text is None):
        raise Refusal(400, "send input_ids or text (one of them)", "input_ids")
    if req.text is not None:
        if state.tokenizer is None:
            message = "text prompts need the model's tokenizer, which this server has none of"
            raise Refusal(400, message + "; send input_ids", "text")
        field, batch = "text", isinstance(req.text, list)
        texts = req.text if isinstance(req.text, list) else [req.text]
        prompts = [[int(t) for t in state.tokenizer(x)["input_ids"]] for x in texts]
    else:
        ids = req.input_ids
        field, batch = "input_ids", bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]  # type: ignore[assignment,list-item]
    n = len(prompts)
    if batch and n == 0:
        raise Refusal(400, f"{field} is an empty batch", field)
    sampling = req.sampling_params
    if isinstance(sampling, list) and (not batch or len(sampling) != n):
        message = f"sampling_params is a list of {len(sampling)}; give one, or one per prompt ({n})"
        raise Refusal(400, message, "sampling_params")
    rids = req.rid if req.rid is not None else [uuid.uuid4().hex for _ in range(n)]
    if isinstance(rids, str):
        if batch:
            raise Refusal(400, f"rid must be a list of {n} for a batch of {n}", "rid")
        rids = [rids]
    if len(rids) != n or not all(rids) or len(set(rids)) != n:
        raise Refusal(400, f"rid must be {n} distinct non-empty strings", "rid")
    items = []
    for i, (prompt, rid) in enumerate(zip(prompts, rids, strict=True)):
        sp = sampling[i] if isinstance(sampling, list) else sampling
        name = f"{field}[{i}]" if batch else field
        if rid in state.inflight:
            raise Refusal(400, f"rid {rid!r} is already in flight", "rid")
        items.append(_Item(prompt, _sampling(state, prompt, sp, name), rid))
    return items, batch


def _sampling(state: ServeState, ids: list[int], sp: SamplingBody, name: str) -> SamplingParams:
    """One prompt's SamplingParams, once everything the model decides is checked."""
    vocab, max_len, p = state.engine.vocab_size, state.engine.max_len, "sampling_params."
    if not ids:
        raise Refusal(400, f"{name} is empty; it needs at least one token", name)
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            message = f"{name}[{i}] = {t} is outside the vocabulary [0, {vocab})"
            raise Refusal(400, message, name)
    if sp.max_new_tokens < 1:
        raise Refusal(
            400, f"max_new_tokens must be >= 1, got {sp.max_new_tokens}", p + "max_new_tokens"
        )
    if len(ids) >= max_len:
        message = f"{name} has {len(ids)} tokens; the context length {max_len} leaves no room"
        raise Refusal(400, message, name)
    if len(ids) + sp.max_new_tokens > max_len:
        message = f"len({name}) + max_new_tokens = {len(ids)} + {sp.max_new_tokens} > {max_len}"
        raise Refusal(400, message + " (the context length)", p + "max_new_tokens")
    if not math.isfinite(sp.temperature) or sp.temperature < 0:
        raise Refusal(
            400, f"temperature must be finite and >= 0, got {sp.temperature}", p + "temperature"
        )
    if sp.top_k != -1 and sp.top_k < 1:
        raise Refusal(400, f"top_k must be -1 (off) or >= 1, got {sp.top_k}", p + "top_k")
    if not 0.0 < sp.top_p <= 1.0:
        raise Refusal(400, f"top_p must be in (0, 1], got {sp.top_p}", p + "top_p")
    stops = sp.stop_token_ids
    for i, t in enumerate(stops or ()):
        if not 0 <= t < vocab:
            message = f"stop_token_ids[{i}] = {t} is outside the vocabulary [0, {vocab})"
            raise Refusal(400, message, p + "stop_token_ids")
    try:
        return SamplingParams(
            max_tokens=sp.max_new_tokens,
            temperature=sp.temperature,
            top_k=None if sp.top_k == -1 else sp.top_k,
            top_p=None if sp.top_p == 1.0 else sp.top_p,
            stop_ids=None if stops is None else tuple(stops),
        )
    except ValueError as exc:  # SamplingParams' own bounds; its message opens with the field
        field = _WIRE_FIELD.get(str(exc).split(" ", 1)[0])
        raise Refusal(400, str(exc), p + field if field else "sampling_params") from None


# SamplingParams' field -> the wire's (SGLang's) name for it.
_WIRE_FIELD = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "stop_ids": "stop_token_ids",
}


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _answer(state: ServeState, item: _Item, logprobs: bool, call: Any) -> dict[str, Any]:
    completion = [int(t) for t in call.completion]
    n = len(completion)
    if call.finish_reason == "stop":
        finish: dict[str, Any] = {"type": "stop", "matched": completion[-1]}
    else:
        finish = {"type": "length", "length": n}
    meta: dict[str, Any] = {
        "id": item.rid,
        "finish_reason": finish,
        "prompt_tokens": len(item.ids),
        "completion_tokens": n,
        "weight_version": int(call.version),
        "dew_temperature": float(call.temperature),
        "dew_support": (
            [[int(s) for s in row] for row in call.support]
            if call.support is not None  # kept when the params filter or are greedy
            else None
        ),
    }
    if logprobs:
        meta["output_token_logprobs"] = [
            [float(lp), t, None] for lp, t in zip(call.log_probs, completion, strict=True)
        ]
    answer: dict[str, Any] = {"output_ids": completion, "meta_info": meta}
    if state.tokenizer is not None:
        answer["text"] = state.tokenizer.decode(completion, skip_special_tokens=True)
    return answer


def _aborted(state: ServeState, item: _Item, logprobs: bool, exc: Aborted) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": item.rid,
        "finish_reason": {"type": "abort"},
        "prompt_tokens": len(item.ids),
        "completion_tokens": int(exc.tokens),
        "weight_version": state.engine.version,
        "dew_temperature": scored_temperature(item.params.temperature),
        "dew_support": None,
    }
    if logprobs:
        meta["output_token_logprobs"] = []
    answer: dict[str, Any] = {"output_ids": [], "meta_info": meta}
    if state.tokenizer is not None:
        answer["text"] = ""
    return answer


async def _generate(state: ServeState, request: Request) -> Response:
    state.authorize(request)
    req = await parse_body(request, GenerateBody)
    items, batch = _items(state, req)
    engine = state.engine
    futures: list[Any] = []
    watcher: asyncio.Future[None] | None = None
    try:
        for item in items:
            try:
                futures.append(engine.submit(item.ids, item.params))
            except ValueError as exc:  # checked above; the engine's own word as a fallback
                raise Refusal(400, str(exc), "input_ids") from None
            except RuntimeError as exc:
                raise Refusal(503, f"the engine is not serving: {exc}", None) from None
            state.inflight[item.rid] = futures[-1]
        watcher = asyncio.ensure_future(_disconnected(request))
        results = asyncio.gather(*map(asyncio.wrap_future, futures), return_exceptions=True)
        await asyncio.wait({watcher, results}, return_when=asyncio.FIRST_COMPLETED)
        for future in futures:  # the client left; the engine drops them within an iteration
            if not future.done():
                engine.abort(future)
        answers = []
        for item, outcome in zip(items, await results, strict=True):
            if isinstance(outcome, Aborted):
                answers.append(_aborted(state, item, req.return_logprob, outcome))
            elif isinstance(outcome, ValueError):  # this prompt's draw alone failed
                message = f"rid {item.rid!r}: {outcome}"
                raise Refusal(422, message, "sampling_params") from None
            elif isinstance(outcome, RuntimeError):
                message = f"the engine is not serving: {outcome}"
                raise Refusal(503, message, None) from None
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                answers.append(_answer(state, item, req.return_logprob, outcome))
        return JSONResponse(answers if batch else answers[0])
    finally:
        if watcher is not None:
            watcher.cancel()
        for item, future in zip(items, futures, strict=False):
            if not future.done():  # this handler was cancelled: nobody will read the answer
                engine.abort(future)
            state.inflight.pop(item.rid, None)


# --------------------------------------------------------------------------- app


def build_app(
    engine: RolloutServer,
    *,
    api_key: str | None = None,
    model_path: str = "",
    tokenizer_path: str | None = None,
    tokenizer: Any = None,
    reference: Mapping[str, torch.Tensor] | None = None,
    weights_dir: str | os.PathLike[str] | None = None,
    group_timeout: float = 30.0,
) -> tuple[FastAPI, ServeState]:
    """The app serving ``engine``, and its state (``abort_all`` for shutdown).

    ``reference`` (the served model's state dict) lets a broadcast push be checked by
    name and shape before any tensor is received, and bounds the size of a weights
    file. ``weights_dir``: the only folder whose files a push may name (default
    :func:`dew.serving._folders.weights_root`, where engines on this machine write).
    ``group_timeout``: seconds a join of a trainer's broadcast group may wait for it,
    and each receive in it; one join at a time. ``tokenizer`` (the model's): takes
    ``text`` prompts and adds ``text`` to each answer. ``state.close()`` lets its
    thread go.
    """
    state = ServeState(
        engine,
        api_key=api_key,
        model_path=model_path,
        tokenizer_path=tokenizer_path,
        tokenizer=tokenizer,
        reference=reference,
        weights_dir=weights_root() if weights_dir is None else Path(weights_dir),
        group_timeout=group_timeout,
    )
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    def route(path: str, handler: Any, method: str = "POST") -> None:
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(state, request)
            except Refusal as exc:
                return exc.response()

        app.add_api_route(path, endpoint, methods=[method])

    async def health(state: ServeState, request: Request) -> Response:
        del request
        version = state.engine.version
        if not state.alive():
            raise Refusal(503, "the engine thread is not running", None)
        return JSONResponse(
            {
                "status": "ok",
                "dew_version": version,
                "dew_in_flight": len(state.inflight),
                "dew_run": state.claim.held_by,
            }
        )

    async def model_info(state: ServeState, request: Request) -> Response:
        state.authorize(request)
        engine = state.engine
        return JSONResponse(
            {
                "model_path": state.model_path,
                "tokenizer_path": state.tokenizer_path,
                "is_generation": True,
                "dew_version": engine.version,
                "dew_run": state.claim.held_by,
                "dew_device": str(engine.device),
                "dew_max_len": engine.max_len,
                "dew_vocab_size": engine.vocab_size,
                "dew_eos_token_ids": list(engine.eos_token_ids),
            }
        )

    async def abort_request(state: ServeState, request: Request) -> Response:
        state.authorize(request)
        req = await parse_body(request, AbortBody)
        future = state.inflight.get(req.rid)
        if future is None or future.done():
            return JSONResponse({"success": False, "message": f"no request {req.rid!r} in flight"})
        state.engine.abort(future)
        return JSONResponse({"success": True})

    async def timings(state: ServeState, request: Request) -> Response:
        state.authorize(request)
        return JSONResponse({"engines": [t.to_json() for t in state.engine.timings()]})

    route("/generate", _generate)
    route("/abort_request", abort_request)
    route("/update_weights_from_disk", from_disk)
    route("/init_weights_update_group", init_group)
    route("/update_weights_from_distributed", from_distributed)
    route("/dew/release", release)
    route("/health", health, "GET")
    route("/get_model_info", model_info, "GET")
    route("/dew/timings", timings, "GET")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        del request
        return Refusal(exc.status_code, str(exc.detail), None).response()

    return app, state
