"""HTTPEngine: the :class:`~dew.core.Engine` contract and a Publisher over one server.

An :class:`HTTPEngine` drives one ``dew serve`` process (or a server speaking the same
subset of SGLang's native API; :mod:`dew.serving.http_server` documents it) and looks
to sources exactly like the in-process :class:`~dew.serving.RolloutServer`: ``submit``
returns a future at once, the future resolves to a token-exact :class:`~dew.core.Call`,
and ``load`` publishes weights under a version number.

The threads, the pools, retries and stopping are those of every engine over one
server (:mod:`dew.serving._http_base`). What is this server's:

* Stopping: each request carries an ``rid``; a stopped or aborted request gets
  ``/abort_request``, and the server answers the ``/generate`` with finish reason
  ``abort`` and the tokens made so far: ``Aborted(tokens=n)``.
* ``version`` is set by ``/get_model_info``, ``/health`` and every push, and raised
  (never lowered) by the ``weight_version`` of every response.
* ``batch_groups``: requests submitted together under one ``affinity`` (a group's
  samples, as sources submit them) go in one ``/generate`` of SGLang's batch form,
  which saves the fixed cost of a request per sample; each keeps its own rid (so one
  is aborted alone) and future. The batch is answered once its last request ends, so
  this is for short generations of even length: with long or uneven ones, the first
  finishers wait for the last (and a cut of the slowest, ``oversample``, cannot see
  them first).
* Runs: every push names the engine's ``run``; its first push starts the run's version
  sequence, so a new run (or the same run resumed) may count from 0 on a server
  another run pushed to. A server held by another live run refuses it (409, naming
  that run) unless ``takeover``; :meth:`close` releases the server
  (:mod:`dew.serving._claim` has the rule).
* Timings (:class:`~dew.core.Timed`): :meth:`HTTPEngine.timings` reads the server's
  ``GET /dew/timings`` within the connect timeout and names its entry by the engine's
  URL, so entries read from several servers are told apart.
* The ``Call`` is built from the response alone: prompt = the ids sent, completion =
  ``output_ids``, ``log_probs`` from ``output_token_logprobs`` (checked to match the
  ids), ``version`` = ``weight_version`` (the oldest weights that served a token),
  ``temperature`` = ``dew_temperature`` and ``support`` = ``dew_support`` (required
  when the params filter or are greedy, as the in-process engine keeps support then).
  Arguments are checked in the caller's thread with the in-process engine's rules
  (``ValueError``), against the server's ``max_len``, ``vocab_size`` and
  ``eos_token_ids`` read once at construction.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dew.core import (
    Aborted,
    Call,
    EngineError,
    EngineTimings,
    SamplingParams,
    as_int,
    scored_temperature,
)
from dew.serving._http_base import (
    CONNECT_TIMEOUT,
    REQUEST_TIMEOUT,
    STARTUP_TIMEOUT,
    LoopEngine,
    Pending,
    _settle,
)
from dew.serving._http_client import Pool
from dew.serving._requests import Request

__all__ = ["HTTPEngine"]

# Seconds a request waits on the loop for the rest of its group (batch_groups): the
# group's submits come one after another from one thread.
_GATHER = 0.001


class HTTPEngine(LoopEngine):
    """An :class:`~dew.core.Engine` and :class:`~dew.core.Publisher` over one server.

    ``url``: the server's base URL (``http://127.0.0.1:8000``). ``api_key``: sent as a
    bearer token. ``weights_dir``: where :meth:`load` writes weights files (a folder the
    server can read: shared memory or a shared filesystem); default a private folder
    in ``/dev/shm`` (or the temp folder), removed by :meth:`close`. ``timeout``: seconds
    a request may wait for its answer (a whole generation; also a weight push and a
    wait for a free connection); ``connect_timeout``: seconds to open a connection.
    ``max_connections``: the ``/generate`` pool's size. ``startup_timeout``: how long the
    constructor keeps asking ``/get_model_info`` while the server does not answer; an
    unreachable server then raises :class:`~dew.core.EngineError` naming the URL (a 4xx,
    e.g. a bad API key, raises ``ValueError``). ``poll``: seconds between two looks at
    the ``stop`` events of the requests in flight. ``abort_urls``: where
    ``/abort_request`` goes instead of ``url``: the workers behind a router (sglang-router
    does not relay aborts, so each is asked; a worker that never had the rid ignores it).
    ``run``: the trainer run this engine pushes for (default: one of its own, so two
    engines are two runs); ``takeover``: push even while another run holds the server,
    which that run's next push then finds refused. ``batch_groups``: one request per
    group (see the module docstring).
    """

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        weights_dir: str | Path | None = None,
        timeout: float = REQUEST_TIMEOUT,
        connect_timeout: float = CONNECT_TIMEOUT,
        max_connections: int = 256,
        startup_timeout: float = STARTUP_TIMEOUT,
        poll: float = 0.005,
        abort_urls: Sequence[str] = (),
        run: str | None = None,
        takeover: bool = False,
        batch_groups: bool = False,
    ) -> None:
        if not isinstance(batch_groups, bool):
            raise ValueError(f"batch_groups must be a bool, got {batch_groups!r}")
        self._batch_groups = batch_groups
        # Requests waiting for the rest of their group (loop thread only), sent as one.
        self._gathering: dict[Hashable, list[Pending]] = {}
        self._flushing: asyncio.TimerHandle | None = None
        super().__init__(
            url,
            api_key=api_key,
            weights_dir=weights_dir,
            timeout=timeout,
            connect_timeout=connect_timeout,
            max_connections=max_connections,
            startup_timeout=startup_timeout,
            poll=poll,
            abort_urls=abort_urls,
            run=run,
            takeover=takeover,
        )

    def _describe(self, within: float) -> None:
        try:
            info = self._block(self._answering("GET", "/get_model_info", within))
        except EngineError as exc:
            raise EngineError(f"dew serve at {self._url} is not answering: {exc}") from None
        try:
            self._max_len = as_int(info["dew_max_len"], "dew_max_len")
            self._vocab = as_int(info["dew_vocab_size"], "dew_vocab_size")
            self._eos = tuple(as_int(t, "dew_eos_token_ids") for t in info["dew_eos_token_ids"])
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(
                f"{self._url}/get_model_info does not describe the model as dew serve "
                f"does (dew_max_len, dew_vocab_size, dew_eos_token_ids): {exc!r}"
            ) from None
        self._set_version(info.get("dew_version"), exact=True)
        self._held_by = info.get("dew_run")

    def health(self) -> bool:
        """Whether the server answers ``GET /health`` with 200 within the connect
        timeout; updates :attr:`version`. False once closed."""
        self._check_not_loop("health()")
        try:
            data = self._block(self._request("GET", "/health", None, retry=True, short=True))
        except (EngineError, ValueError, RuntimeError):
            return False
        self._set_version(data.get("dew_version"), exact=True)
        self._held_by = data.get("dew_run")
        return True

    def timings(self) -> list[EngineTimings]:
        """The server's iteration log (``GET /dew/timings``), cumulative since it
        started, its entry named by :attr:`url` (several entries, should a server report
        more: ``url#name``). Blocks at most the connect timeout; a server that does not
        answer, answers anything but 200 or a malformed body raises
        :class:`~dew.core.EngineError` naming the URL."""
        self._check_not_loop("timings()")
        path = "/dew/timings"
        response = self._block(self._read(path))
        try:
            data = response.json()
            entries = [EngineTimings.from_json(e) for e in data["engines"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"{self._url}{path}: malformed answer: {exc}") from None
        if len(entries) == 1:
            return [dataclasses.replace(entries[0], name=self._url)]
        return [dataclasses.replace(e, name=f"{self._url}#{e.name}") for e in entries]

    def load_file(self, path: str | Path, version: int) -> None:
        """Ask the server to load the weights file ``path`` (written by
        :func:`dew.serving.weights.write_weights`) and serve it as ``version``.

        A fleet writes the file once and pushes it to every engine this way. Never
        retried: the server refuses a version it already serves.
        """
        self._check_not_loop("load_file()")
        version = as_int(version, "version")
        body = {
            "model_path": str(Path(path).resolve()),
            "dew_version": version,
            "dew_run": self.run,
            "dew_restart": not self._pushed,
            "dew_takeover": self._takeover,
        }
        data = self._block(self._request("POST", "/update_weights_from_disk", body))
        if data.get("success") is False:
            raise ValueError(f"{self._url}: weights refused: {data.get('message')}")
        self._took()
        self._set_version(data.get("dew_version", version), exact=True)

    async def _release(self) -> None:
        await self._request("POST", "/dew/release", {"dew_run": self.run}, short=True)

    def _start(self, p: Pending) -> None:
        if not self._batch_groups or p.affinity is None:
            super()._start(p)
            return
        self._inflight[p.rid] = p
        self._gathering.setdefault(p.affinity, []).append(p)
        if self._flushing is None:  # the group's other submits are on their way
            self._flushing = self._loop.call_later(_GATHER, self._flush)
        if self._watcher is None:
            self._watcher = self._spawn(self._watch())

    def _flush(self) -> None:
        """Send what gathered: one request per group (a group of one as a plain one)."""
        self._flushing = None
        groups, self._gathering = self._gathering, {}
        for group in groups.values():
            if len(group) == 1:
                self._spawn(self._generate(group[0]))
            else:
                self._spawn(self._generate_batch(group))

    async def _generate_batch(self, group: list[Pending]) -> None:
        """One ``/generate`` of SGLang's batch form for ``group``; each request settles
        with its own answer (the whole batch's error when the exchange failed)."""
        live = [p for p in group if not p.stopped]
        outcomes: dict[str, Call | BaseException] = {
            p.rid: Aborted("generation stopped before it was sent") for p in group if p.stopped
        }
        if live:
            first = live[0].body
            body = {
                "input_ids": [p.body["input_ids"] for p in live],
                "sampling_params": [p.body["sampling_params"] for p in live],
                "return_logprob": first["return_logprob"],
                "rid": [p.rid for p in live],
            }
            try:
                answers = await self._request("POST", self._generate_path, body, many=True)
                if len(answers) != len(live):
                    raise EngineError(
                        f"{self._url}{self._generate_path}: malformed batch answer: "
                        f"{type(answers).__name__} for {len(live)} prompts"
                    )
                outcomes.update(
                    (p.rid, self._outcome(p, a)) for p, a in zip(live, answers, strict=True)
                )
            except (EngineError, ValueError) as exc:
                outcomes.update((p.rid, exc) for p in live)
            except asyncio.CancelledError:
                raise  # close() cancelled it; _shutdown resolves the futures
            except Exception as exc:  # a bug of ours: the requests are lost
                where = f"{self._url}{self._generate_path}"
                outcomes.update((p.rid, EngineError(f"{where}: {exc!r}")) for p in live)
        for p in group:
            self._inflight.pop(p.rid, None)
            _settle(p.future, outcomes[p.rid])

    async def _abort_request(self, rid: str, pool: Pool | None) -> None:
        await self._request(
            "POST", "/abort_request", {"rid": rid}, retry=True, short=True, pool=pool
        )

    def _generation(self, request: Request, params: SamplingParams, rid: str) -> dict[str, Any]:
        """The ``/generate`` request (the wire format: :mod:`dew.serving.http_server`)."""
        sampling: dict[str, Any] = {"max_new_tokens": params.max_tokens}
        for key, value in (
            ("temperature", params.temperature),
            ("top_k", params.top_k),  # absent = off, as SGLang's -1
            ("top_p", params.top_p),
            ("stop_token_ids", None if params.stop_ids is None else list(params.stop_ids)),
        ):
            if value is not None:
                sampling[key] = value
        return {
            "input_ids": request.prompt,
            "sampling_params": sampling,
            "return_logprob": True,
            "rid": rid,
        }

    def _outcome(self, p: Pending, data: Mapping[str, Any]) -> Call | BaseException:
        try:
            meta = data["meta_info"]
            out = [int(t) for t in data["output_ids"]]
            finish = meta.get("finish_reason")
            kind = finish.get("type") if isinstance(finish, Mapping) else finish
            if kind == "abort":
                if p.stopped:
                    tokens = as_int(meta.get("completion_tokens", len(out)), "completion_tokens")
                    return Aborted("generation stopped", tokens=tokens)
                return EngineError(f"{self._url}/generate: the server aborted the request")
            if kind not in ("stop", "length"):
                raise ValueError(f"unknown finish reason {finish!r}")
            rows = meta["output_token_logprobs"]
            if [int(r[1]) for r in rows] != out or not out:
                raise ValueError("output_token_logprobs do not match output_ids")
            log_probs = [float(r[0]) for r in rows]
            try:
                version = as_int(meta.get("weight_version"), "weight_version")
            except ValueError:
                version = self.version  # a server without dew's version field
            else:
                self._set_version(version, exact=False)
            temperature = meta.get("dew_temperature")
            support = meta.get("dew_support") if p.keeps_support else None
            if p.keeps_support and (support is None or len(support) != len(out)):
                raise ValueError("dew_support is missing or does not match output_ids")
            return Call(
                prompt=p.prompt,
                completion=out,
                log_probs=log_probs,
                version=version,
                temperature=scored_temperature(
                    float(temperature or p.body["sampling_params"]["temperature"])
                ),
                support=None if support is None else [[int(t) for t in s] for s in support],
                finish_reason=kind,
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            return EngineError(f"{self._url}/generate: malformed answer: {exc!r}")
