"""VLLMEngine: the :class:`~dew.core.Engine` contract and a Publisher over one vLLM server.

The threads, pools, retries and stop watching are those of every engine over one
server (:mod:`dew.serving._http_base`); this module is vLLM's dialect.

What the server must run with (:func:`dew.serving.vllm.server_args` lists it, and a
launched server has it): ``VLLM_SERVER_DEV_MODE=1`` (``/pause``, ``/resume``,
``/collective_rpc``, ``/update_weight_version``, ``/abort_requests``),
``--enable-scale-out`` (token ids in and out on ``/inference/v1/generate``),
``--logprobs-mode processed_logprobs`` (the log-prob of each token under the
distribution it was sampled from, temperature applied, which is what the trainer's
importance weights need), ``--worker-extension-cls`` naming dew's
:class:`~dew.serving.vllm.extension.WorkerExtension`, and, for broadcast pushes only,
``--weight-transfer-config '{"backend": "dew"}'``. The constructor checks each and
refuses a server without it in one line (``ValueError``); an unreachable server is an
:class:`~dew.core.EngineError`.

Generation: the prompt's ids and every sampling setting are sent explicitly (the
model's generation config never fills in a default), the stop ids dew resolved are the
only ones vLLM stops at (``ignore_eos``), and the ``Call`` is built from the answer
alone: the sampled ids, their processed log-probs, and as version the oldest weights
behind any token, read from the answer's ``weight_versions`` spans. Filtered and greedy
sampling are refused: vLLM's CPU runner does not report which ids such a sampler could
draw, and without them the trainer cannot score the tokens exactly.

Weights (``load_file``, under one lock): ``/pause?mode=keep&clear_cache=false``
freezes the requests in flight, the extension loads the file all-or-nothing (a refusal
leaves the served weights and version as they were and raises ``ValueError``),
``/update_weight_version`` labels what follows, and then:

* ``on_load="recompute"`` (default): ``/reset_prefix_cache`` with
  ``reset_running_requests``: the requests in flight are computed again from their
  tokens under the new weights, and no cached prefix of the old weights is reused, so
  every later token comes from the new weights alone;
* ``on_load="keep"``: the requests in flight go on over the keys and values they have
  (an in-flight update, as PipelineRL's): their later tokens are sampled by the new
  weights. Each request salts the prefix cache with the version it was sent under, so a
  new request never reuses an old prefix of another version, and its ``Call`` is never
  newer than that version.

Then ``/resume``. Broadcast pushes (:meth:`VLLMEngine.load_broadcast`) take the same
sequence with vLLM's weight-transfer API in place of the file: once the extension has
checked the names, shapes and version, ``/start_weight_update``, ``/update_weights``
(dew's transfer backend receives while the trainer broadcasts), ``/finish_weight_update``.

Aborts go to ``/abort_requests`` under the id the server gives a
request (``generate-tokens-`` and dew's id); the server answers the generation with
finish reason ``abort`` and its tokens so far.

Timings (:meth:`VLLMEngine.timings`, :class:`~dew.core.Timed`): vLLM keeps no log of
its iterations, but its Prometheus ``/metrics`` counts enough for a window average.
Each read scrapes it and adds one row for the window since the previous read (the
first read's window starts at the server's start) to a log the engine keeps, so the
log is cumulative as every engine's is. Of the counters summed over the label sets:

* ``vllm:iteration_tokens_total_count``: engine steps that produced output (the
  histogram's count), the window's ``iterations``;
* ``vllm:generation_tokens_total``: tokens sampled, one per running sequence per step,
  so Δtokens / Δiterations is the mean count of sequences a step ran (the histogram's
  own sum would count prompt tokens too), rounded, at least 1: the row's ``active``;
* ``vllm:inter_token_latency_seconds`` (``_sum``, ``_count``; the older
  ``vllm:time_per_output_token_seconds`` where it is missing): the time between two
  tokens of a running request, one step's time as that request saw it: the row's
  ``seconds`` are Δiterations x Δsum / Δcount.

Approximated: a window's steps all count at its mean sequence count, so one read's
row stands for the window's mix of widths (read often for a finer log); each step's
time is the mean inter-token latency, which averages over running sequences (a wide
step weighs more than a narrow one), counts the scheduling between two steps, and
lends decode steps' mean to prefill-only steps (which have no such sample). A window
without a timed step adds nothing yet: its steps join the next window. ``max_active``
is the server's ``max_num_seqs`` (as dew's worker extension reports it; 256 where
it does not). Counters that fell (a server restarted on the URL) start the log over.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dew.core import (
    Aborted,
    Call,
    EngineError,
    EngineTimings,
    IterationLog,
    SamplingParams,
    as_int,
)
from dew.serving._http_base import (
    CONNECT_TIMEOUT,
    REQUEST_TIMEOUT,
    STARTUP_TIMEOUT,
    LoopEngine,
    Pending,
)
from dew.serving._http_client import Pool, TransportError
from dew.serving._requests import Request
from dew.serving.vllm.extension import TRANSFER_BACKEND

if TYPE_CHECKING:
    from dew.serving.weights import BroadcastGroup

__all__ = ["ON_LOAD", "VLLMEngine"]

ON_LOAD = ("recompute", "keep")
EXTENSION = "dew.serving.vllm.extension.WorkerExtension"
_ID_PREFIX = "generate-tokens-"  # what vLLM's token route puts before a request's id
_SALT = "dew-v"
TRANSFER_ARGS = ("--weight-transfer-config", json.dumps({"backend": TRANSFER_BACKEND}))
MAX_ACTIVE = 256  # vLLM's default max_num_seqs: a server's own, where it does not say


def server_args() -> list[str]:
    """The ``vllm`` server flags a :class:`VLLMEngine` needs (besides
    ``VLLM_SERVER_DEV_MODE=1`` in its environment)."""
    return [
        "--enable-scale-out",
        "--logprobs-mode",
        "processed_logprobs",
        "--worker-extension-cls",
        EXTENSION,
        *TRANSFER_ARGS,
    ]


class VLLMEngine(LoopEngine):
    """An :class:`~dew.core.Engine` and :class:`~dew.core.Publisher` over one vLLM server.

    ``url``: the server's base URL. ``on_load``: what a weight push does to the
    requests in flight, ``"recompute"`` or ``"keep"`` (module docstring). The other
    arguments are :class:`~dew.serving.HTTPEngine`'s: ``api_key`` (the server's
    ``--api-key``), ``weights_dir`` (where :meth:`load` writes weights files; the server
    must be able to read it), ``timeout``, ``connect_timeout``, ``max_connections``,
    ``startup_timeout`` (how long the constructor waits for ``/health``), ``poll``,
    ``run`` and ``takeover`` (the trainer run its pushes hold the server for, and
    whether they may take it from another run; :meth:`close` releases it). A push that
    starts the run's version sequence drops the prefix cache; one that takes the server
    from a live run aborts the requests in flight (``/pause?mode=abort``).
    """

    _generate_path = "/inference/v1/generate"
    _kind = "VLLMEngine"

    def __init__(
        self,
        url: str,
        *,
        on_load: str = "recompute",
        api_key: str | None = None,
        weights_dir: str | Path | None = None,
        timeout: float = REQUEST_TIMEOUT,
        connect_timeout: float = CONNECT_TIMEOUT,
        max_connections: int = 256,
        startup_timeout: float = STARTUP_TIMEOUT,
        poll: float = 0.005,
        run: str | None = None,
        takeover: bool = False,
    ) -> None:
        if on_load not in ON_LOAD:
            raise ValueError(f"on_load={on_load!r} is not one of {list(ON_LOAD)}")
        self._on_load = on_load
        self._push_lock = threading.Lock()  # one push at a time: pause ... resume
        self._windows = MetricWindows()  # the iteration log built from /metrics reads
        self._max_active = MAX_ACTIVE
        super().__init__(
            url,
            api_key=api_key,
            weights_dir=weights_dir,
            timeout=timeout,
            connect_timeout=connect_timeout,
            max_connections=max_connections,
            startup_timeout=startup_timeout,
            poll=poll,
            run=run,
            takeover=takeover,
        )

    @property
    def on_load(self) -> str:
        return self._on_load

    # ------------------------------------------------------------------ the dialect

    def _describe(self, within: float) -> None:
        try:
            self._block(self._answering("GET", "/health", within))
        except EngineError as exc:
            raise EngineError(f"vLLM at {self._url} is not answering: {exc}") from None
        for path in ("/pause", self._generate_path):
            if self._block(self._status("GET", path)) == 404:
                raise ValueError(
                    f"vLLM at {self._url} has no {path}: start it with "
                    f"VLLM_SERVER_DEV_MODE=1 and {' '.join(server_args())}"
                )
        try:
            info = self._block(self._rpc("dew_describe"))
        except (EngineError, ValueError) as exc:
            raise ValueError(
                f"vLLM at {self._url} does not run dew's worker extension (start it with "
                f"--worker-extension-cls {EXTENSION}): {exc}"
            ) from None
        if info.get("logprobs_mode") != "processed_logprobs":
            raise ValueError(
                f"vLLM at {self._url} returns {info.get('logprobs_mode')!r} log-probs; dew "
                "needs those of the distribution sampled from: --logprobs-mode "
                "processed_logprobs"
            )
        self._max_len = as_int(info["max_len"], "max_len")
        self._vocab = as_int(info["vocab_size"], "vocab_size")
        self._eos = tuple(as_int(t, "eos_token_ids") for t in info["eos_token_ids"])
        self._workers = as_int(info["workers"], "workers")
        self._max_active = as_int(info.get("max_num_seqs", MAX_ACTIVE), "max_num_seqs")
        self._transfer = info.get("transfer")
        self._held_by = info.get("run")
        self._set_version(as_int(info["version"], "version"), exact=True)

    def _generation(self, request: Request, params: SamplingParams, rid: str) -> dict[str, Any]:
        if request.keeps_support:
            raise ValueError(
                "VLLMEngine samples with temperature > 0 and neither top_k nor top_p: vLLM "
                "does not report which ids a filtered or greedy sampler could draw, which "
                f"the trainer needs to score them exactly (got {params})"
            )
        body: dict[str, Any] = {
            "request_id": rid,
            "token_ids": request.prompt,
            "sampling_params": {
                "max_tokens": params.max_tokens,
                "temperature": params.temperature,
                # Explicit neutral values: otherwise the model's generation config
                # (say, a top_k or a repetition penalty) would fill them in.
                "top_k": 0,
                "top_p": 1.0,
                "min_p": 0.0,
                "repetition_penalty": 1.0,
                "presence_penalty": 0.0,
                "frequency_penalty": 0.0,
                "logprobs": 0,
                "ignore_eos": True,  # dew resolved the stop ids: only those stop
                "stop_token_ids": sorted(request.stop_ids),
                "detokenize": False,
            },
        }
        if self._on_load == "keep":
            body["cache_salt"] = f"{_SALT}{self.version}"
        return body

    def _outcome(self, p: Pending, data: Mapping[str, Any]) -> Call | BaseException:
        where = f"{self._url}{self._generate_path}"
        try:
            choice = data["choices"][0]
            out = [int(t) for t in choice["token_ids"] or ()]
            finish = choice["finish_reason"]
            if finish == "abort":
                if p.stopped:
                    return Aborted("generation stopped", tokens=len(out))
                return EngineError(f"{where}: the server aborted the request")
            if finish not in ("stop", "length"):
                raise ValueError(f"unknown finish reason {finish!r}")
            content = choice["logprobs"]["content"]
            if [int(c["token_id"]) for c in content] != out or not out:
                raise ValueError("the log-probs do not match token_ids")
            versions = _span_versions(choice.get("weight_versions"), len(out))
            self._set_version(max(versions), exact=False)
            version = min(versions)
            salt = p.body.get("cache_salt")
            if salt is not None:  # keep: a prefix of the salt's version may have served it
                version = min(version, int(salt.removeprefix(_SALT)))
            return Call(
                prompt=p.prompt,
                completion=out,
                log_probs=[float(c["logprob"]) for c in content],
                version=version,
                temperature=float(p.body["sampling_params"]["temperature"]),
                finish_reason=finish,
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            return EngineError(f"{where}: malformed answer: {exc!r}")

    async def _abort_request(self, rid: str, pool: Pool | None) -> None:
        body = {"request_ids": [f"{_ID_PREFIX}{rid}"]}
        await self._request("POST", "/abort_requests", body, retry=True, short=True, pool=pool)

    # ------------------------------------------------------------------ health, weights

    def health(self) -> bool:
        """Whether the server answers ``/health`` (and ``/weight_info``, which updates
        :attr:`version`) within the connect timeout. False once closed."""
        self._check_not_loop("health()")
        try:
            self._block(self._request("GET", "/health", None, retry=True, short=True))
            info = self._block(self._request("GET", "/weight_info", None, retry=True, short=True))
        except (EngineError, ValueError, RuntimeError):
            return False
        self._set_version(_label(info.get("weight_version")), exact=True)
        return True

    def timings(self) -> list[EngineTimings]:
        """The server's iterations by active-sequence count, cumulative since it
        started, as built from its ``/metrics`` (the module docstring says how, and what
        is approximated): one entry named by :attr:`url`, ``max_active`` the server's
        ``max_num_seqs``. Each read adds the window since the previous one; metrics
        without what is needed leave the log as it was. Blocks at most the connect
        timeout; a server that does not answer raises :class:`~dew.core.EngineError`
        naming the URL."""
        self._check_not_loop("timings()")
        response = self._block(self._read("/metrics"))
        log = self._windows.update(response.body.decode("utf-8", "replace"))
        return [EngineTimings(self._url, self._max_active, log)]

    def load_file(self, path: str | Path, version: int) -> None:
        """Serve the weights file ``path`` (written by
        :func:`dew.serving.weights.write_weights`) as ``version``: the push sequence of
        the module docstring. A refusal raises ``ValueError`` and changes nothing; a
        fault of the server on the way raises :class:`~dew.core.EngineError`."""
        self._check_not_loop("load_file()")
        version = as_int(version, "version")

        async def load() -> dict[str, Any]:
            return await self._rpc(
                "dew_load", str(Path(path).resolve()), str(version), *self._who()
            )

        with self._push_lock:
            self._block(self._push(load))
            self._took()
        self._set_version(version, exact=True)

    def _who(self) -> tuple[str, str, str]:
        """A push's run arguments of the extension: run, restart, takeover ("" = no)."""
        return self.run, "" if self._pushed else "1", "1" if self._takeover else ""

    async def _release(self) -> None:
        await self._rpc("dew_release", self.run)

    async def _push(self, load: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        """Pause, ``load`` the weights (its answer: ``{"version": v}``, maybe with
        ``"unchanged"``, or ``{"refused": why}``), label them, reset or keep the requests
        in flight (``on_load``), resume."""
        # clear_cache=false: vLLM would otherwise recompute the running requests even
        # under mode=keep; whether they are recomputed is on_load's to say (below). A
        # takeover of a live run's server aborts that run's requests instead.
        live = self._held_by not in (None, self.run) and self._takeover and not self._pushed
        mode = "abort" if live else "keep"
        await self._request("POST", f"/pause?mode={mode}&clear_cache=false", None)
        try:
            answer = await load()
            if "refused" in answer:
                raise ValueError(f"{self._url}: weights refused: {answer['refused']}")
            if not answer.get("unchanged"):
                label = {"new_version": str(answer["version"])}
                await self._request("POST", "/update_weight_version", label)
                # A new sequence (this engine's first push) may repeat versions that
                # salted cached prefixes.
                if self._on_load == "recompute" or not self._pushed:
                    path_ = "/reset_prefix_cache?reset_running_requests=true"
                    if not (await self._request("POST", path_, None)).get("success"):
                        raise EngineError(f"{self._url}: the prefix cache was not reset")
        finally:
            await self._request("POST", "/resume", None)

    # ------------------------------------------------------------------ broadcast

    def open_broadcast(
        self,
        address: str = "127.0.0.1",
        *,
        backend: str = "gloo",
        group_name: str = "dew",
        timeout: float = 300.0,
    ) -> BroadcastGroup:
        """Open a broadcast group of this trainer (rank 0, its store on a free port of
        ``address``, which the server must reach) and the server's workers (ranks 1 and
        up, one per worker), through vLLM's ``/init_weight_transfer_engine``, for
        :meth:`load_broadcast`. The server must run dew's transfer backend (one of
        :func:`server_args`). ``backend``: ``"gloo"`` (CPU tensors) or ``"nccl"``
        (GPUs; not yet run by dew's tests). The caller closes the group."""
        from dew.serving.weights import BroadcastGroup

        self._check_not_loop("open_broadcast()")
        if self._transfer != TRANSFER_BACKEND:
            raise ValueError(
                f"vLLM at {self._url} runs weight-transfer backend {self._transfer!r}; "
                f"broadcast pushes need dew's: start it with {' '.join(TRANSFER_ARGS)}"
            )
        port = free_port(address)
        world = 1 + self._workers
        init = {
            "address": address, "port": port, "rank_offset": 1, "world_size": world,
            "backend": backend, "group_name": group_name, "timeout": timeout,
        }  # fmt: skip
        joined = asyncio.run_coroutine_threadsafe(
            self._request("POST", "/init_weight_transfer_engine", {"init_info": init}), self._loop
        )
        try:
            group = BroadcastGroup(
                address, port, world, backend=backend, group_name=group_name, timeout=timeout
            )
        except BaseException:
            joined.cancel()
            raise
        try:
            joined.result(timeout=self._timeout)
        except BaseException as exc:
            group.close()
            if isinstance(exc, Exception):
                raise EngineError(
                    f"{self._url}: the server did not join the group: {exc}"
                ) from None
            raise
        return group

    def load_broadcast(self, group: BroadcastGroup, variables: Any, version: int) -> None:
        """Send ``variables`` through ``group`` (:meth:`open_broadcast`) and serve them
        as ``version`` (strictly newer than the served one): the push sequence of the
        module docstring, with vLLM's ``/start_weight_update``, ``/update_weights`` (the
        server receives while this thread broadcasts) and ``/finish_weight_update`` in
        place of reading a file. Names and shapes are checked by the server before
        anything is sent; a refusal raises ``ValueError`` and changes nothing."""
        from dew.serving.weights import tensor_specs

        self._check_not_loop("load_broadcast()")
        version = as_int(version, "version")
        names, dtypes, shapes = tensor_specs(variables)
        update = {"version": version, "names": names, "dtype_names": dtypes, "shapes": shapes}
        sending = threading.Event()  # set once the server receives, or the push ended

        async def load() -> dict[str, Any]:
            await self._request("POST", "/start_weight_update", None)
            receiving = asyncio.ensure_future(
                self._request("POST", "/update_weights", {"update_info": update})
            )
            sending.set()
            try:
                await receiving
            finally:  # a session left open would refuse the next push's start
                await self._request("POST", "/finish_weight_update", {})
            return await self._rpc("dew_transfer_outcome", str(version))

        with self._push_lock:
            specs = json.dumps([names, dtypes, shapes])
            check = self._block(self._rpc("dew_check_broadcast", str(version), specs, *self._who()))
            if "refused" in check:
                raise ValueError(f"{self._url}: broadcast refused: {check['refused']}")
            pushed = asyncio.run_coroutine_threadsafe(self._push(load), self._loop)
            pushed.add_done_callback(lambda _: sending.set())  # failed before the send
            try:
                sending.wait()
                if not pushed.done():  # the server waits in the collective: send
                    group.broadcast(variables)
            finally:
                pushed.result(timeout=self._timeout)
            self._took()
        self._set_version(version, exact=True)

    async def _rpc(self, method: str, *args: str) -> dict[str, Any]:
        """Call the extension's ``method`` on the server's worker; its answer."""
        body = {"method": method, "args": list(args)}
        data = await self._request("POST", "/collective_rpc", body)
        results = data.get("results")
        if not isinstance(results, list) or not results or not isinstance(results[0], dict):
            raise EngineError(f"{self._url}/collective_rpc {method}: no answer: {data!r:.200}")
        return results[0]

    async def _status(self, method: str, path: str) -> int:
        """The status ``path`` answers ``method`` with (404: not served at all)."""
        try:
            response = await self._ctl.request(method, path, None, timeout=self._connect_timeout)
        except TransportError as exc:
            raise EngineError(f"{self._url}{path}: {exc}") from None
        return response.status


# ---------------------------------------------------------------------- timings

_ITERATIONS = "vllm:iteration_tokens_total_count"
_TOKENS = "vllm:generation_tokens_total"
_STEP_TIME = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")


@dataclass(frozen=True)
class Scrape:
    """The counters of one ``/metrics`` read the timings need (each summed over its
    label sets): steps, sampled tokens, and the inter-token latencies' sum and count."""

    iterations: float
    tokens: float
    step_seconds: float
    step_samples: float


_ZERO = Scrape(0.0, 0.0, 0.0, 0.0)


def parse_metrics(text: str) -> Scrape | None:
    """The :class:`Scrape` in a Prometheus text exposition, or None when a counter it
    needs is missing."""
    wanted = {_ITERATIONS, _TOKENS}
    for base in _STEP_TIME:
        wanted.update((f"{base}_sum", f"{base}_count"))
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name, rest = line[:brace], line[line.rfind("}") + 1 :]
        elif space != -1:
            name, rest = line[:space], line[space:]
        else:
            continue
        if name not in wanted:
            continue
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if math.isfinite(value):
            sums[name] = sums.get(name, 0.0) + value
    base = next((b for b in _STEP_TIME if f"{b}_sum" in sums and f"{b}_count" in sums), None)
    if base is None or _ITERATIONS not in sums or _TOKENS not in sums:
        return None
    return Scrape(sums[_ITERATIONS], sums[_TOKENS], sums[f"{base}_sum"], sums[f"{base}_count"])


class MetricWindows:
    """A cumulative :class:`~dew.core.IterationLog` built from successive ``/metrics``
    reads, one row per window between two reads (the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._log = IterationLog()
        self._last = _ZERO  # the read the next window starts from

    def update(self, text: str) -> IterationLog:
        """Add the window ending at the read ``text``; a snapshot of the log."""
        now = parse_metrics(text)
        with self._lock:
            if now is not None:
                self._add(now)
            return self._log.snapshot()

    def _add(self, now: Scrape) -> None:
        last = self._last
        if (
            now.iterations < last.iterations
            or now.tokens < last.tokens
            or now.step_samples < last.step_samples
        ):  # the server restarted: its counters, and so this log, start over
            self._log, last = IterationLog(), _ZERO
        steps = round(now.iterations - last.iterations)
        samples = now.step_samples - last.step_samples
        if steps <= 0 or samples <= 0:  # nothing ran, or no step timed yet: wait
            self._last = now if steps <= 0 and samples <= 0 else last
            return
        active = max(1, round((now.tokens - last.tokens) / steps))
        seconds = steps * max(now.step_seconds - last.step_seconds, 0.0) / samples
        row = IterationLog.from_json({str(active): [steps, seconds]})
        self._log = self._log.merged(row)
        self._last = now


def _label(value: object) -> int:
    """dew's version from vLLM's weight label: a decimal string dew set, or the label of
    the weights the server started with (version 0)."""
    return int(value) if isinstance(value, str) and value.isdigit() else 0


def _span_versions(spans: object, tokens: int) -> list[int]:
    """The version of each span; the spans must cover the tokens, in order."""
    if not isinstance(spans, list) or not spans:
        raise ValueError("no weight_versions spans")
    at = 0
    versions = []
    for span in spans:
        if int(span["start"]) != at or int(span["end"]) <= at:
            raise ValueError(f"weight_versions spans do not tile the tokens: {spans}")
        at = int(span["end"])
        versions.append(_label(span["version"]))
    if at != tokens:
        raise ValueError(f"weight_versions spans cover {at} of {tokens} tokens")
    return versions


def free_port(address: str) -> int:
    """A TCP port of ``address`` free now (a server started next takes it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])
