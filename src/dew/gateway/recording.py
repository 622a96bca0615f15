"""Train an unmodified agent harness: an OpenAI-compatible server that records every call.

:class:`RecordingGateway` serves ``/v1/chat/completions`` (with ``stream: true``),
``/v1/completions`` and ``/v1/models`` over HTTP in front of an engine (any
:class:`dew.core.Engine`, such as ``dew.serving.RolloutServer``). Each
rollout attempt opens a session and receives its own bearer token; the harness
uses it as its API key. Every call the engine serves for that token is recorded
token-exactly (prompt ids, completion ids, behavior log-probs, weights version),
and :meth:`RecordingGateway.close_session` hands the recording over.
:class:`~dew.gateway.HarnessSource` (in :mod:`dew.gateway.harness`) runs a harness per rollout
against it and turns the recording plus a verifier's reward into a ``Rollout``.

Decisions worth knowing:

* Refusals: unknown token 401, closed session 410, superseded attempt 409 (a newer
  session was opened for the same group and sample); none records anything.
  Session caps (``max_turns``, ``max_tokens_per_session``, ``max_context``) answer
  400 with codes ``turn_limit_exceeded``, ``token_limit_exceeded`` and
  ``context_length_exceeded``, or clamp ``max_tokens`` so the call ends with
  ``finish_reason: "length"``; either way the session's recording says which limit
  cut it (``truncation``). Bodies over ``max_body_bytes`` get 413, malformed ones 400.
* Sampling: the gateway holds one :class:`dew.core.SamplingParams`. By default every
  call is sampled with its ``temperature``, ``top_p`` and ``top_k``, whatever the
  harness asks, so recorded log-probs come from the distribution the objective trains
  with. ``client_sampling=True`` honors the request's values instead (then
  ``temperature`` must be > 0). Its ``max_tokens`` caps every call (and is the
  default when a request names none); its ``stop_ids`` end every call (``None``: the
  tokenizer's eos). Each call reaches the engine as one ``SamplingParams`` built from
  these, the request and the session's remaining budget.
* Multi-turn chats pack into one chain when the template re-renders earlier turns
  unchanged: the gateway reuses the recorded ids of the longest earlier
  prompt + completion whose text starts the new prompt (see :mod:`dew.gateway._text`).
  Otherwise the call opens a new chain; its tokens are still exactly the ones fed.
* The gateway binds 127.0.0.1 by default and refuses any non-loopback address
  unless ``allow_remote=True``. It calls nothing over the network, so a caller's
  ``Authorization`` header never leaves the process.

Thread ownership: :meth:`RecordingGateway.start` runs uvicorn on one thread the
gateway owns; :meth:`RecordingGateway.close` closes every session (aborting their
generations), stops the server, joins that thread and the pool that renders,
encodes and detokenizes (generations are the engine's futures, awaited on the loop).
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import uvicorn

from dew._net import bind, is_loopback, uvicorn_config, uvicorn_server
from dew.core import Engine, RolloutKey, SamplingParams, Task
from dew.gateway._app import GatewayConfig, build_app
from dew.gateway._sessions import Limits, Recording, SessionTable

__all__ = ["DEFAULT_SAMPLING", "Recording", "RecordingGateway"]

DEFAULT_SAMPLING = SamplingParams(max_tokens=4096)
"""The gateway's sampling unless told otherwise: temperature 1, no filter, at most
4096 tokens a call, stopping at the tokenizer's eos."""


class RecordingGateway:
    """OpenAI-compatible HTTP front of an engine that records each session's calls.

    ``server`` is the engine, ``tokenizer`` a Hugging Face tokenizer with a chat
    template. ``port=0`` picks a free port (see :attr:`base_url` after
    :meth:`start`). ``sampling`` is how every call is sampled (see the module
    docstring; default :data:`DEFAULT_SAMPLING`): its ``max_tokens`` caps (and, when a
    request names none, sets) a call's ``max_tokens``, its ``stop_ids`` are the tokens
    that end every call (``None``: the tokenizer's eos), and its ``temperature`` must
    be > 0. ``max_context`` caps prompt + completion tokens (default: the engine's
    ``max_len`` when it has one); ``max_n`` caps a request's ``n``. ``workers`` bounds
    the threads that render, encode and detokenize. ``retain`` is how many collected
    sessions keep answering 409/410 before their tokens become unknown (401).
    ``read_timeout`` is how long a request may take to arrive whole (a slower client
    gets a 408 and its connection closes); past ``max_connections`` open connections
    a request gets a 503.
    """

    def __init__(
        self,
        server: Engine,
        tokenizer: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        allow_remote: bool = False,
        model_name: str = "dew",
        max_body_bytes: int = 4 << 20,
        max_turns: int | None = 64,
        max_tokens_per_session: int | None = 32768,
        max_context: int | None = None,
        max_n: int = 8,
        sampling: SamplingParams = DEFAULT_SAMPLING,
        client_sampling: bool = False,
        workers: int = 64,
        retain: int = 65536,
        shutdown_grace: float = 5.0,
        startup_timeout: float = 30.0,
        read_timeout: float = 30.0,
        max_connections: int = 1024,
    ) -> None:
        if not is_loopback(host) and not allow_remote:
            raise ValueError(
                f"host={host!r} is not a loopback address; the gateway serves unauthenticated "
                "model access to anyone holding a session token, so binding it elsewhere "
                "needs allow_remote=True"
            )
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {port}")
        if max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {max_body_bytes}")
        if not 1 <= max_n <= 128:
            raise ValueError(f"max_n must be in [1, 128], got {max_n}")
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a dew.core.SamplingParams, got {sampling!r}")
        if sampling.temperature <= 0:
            # SamplingParams allows greedy; a recorded call needs a distribution to train on.
            raise ValueError(
                f"sampling.temperature must be > 0 for the gateway, got {sampling.temperature}"
            )
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if shutdown_grace < 0 or startup_timeout <= 0:
            raise ValueError(
                "shutdown_grace must be >= 0 and startup_timeout > 0, got "
                f"{shutdown_grace} and {startup_timeout}"
            )
        if not (isinstance(read_timeout, (int, float)) and read_timeout > 0):
            raise ValueError(f"read_timeout must be > 0 seconds, got {read_timeout!r}")
        if isinstance(max_connections, bool) or not (
            isinstance(max_connections, int) and max_connections >= 1
        ):
            raise ValueError(f"max_connections must be an int >= 1, got {max_connections!r}")
        if max_context is None:
            # An engine that bounds prompt + completion (RolloutServer.max_len) refuses
            # longer calls outright; clamping to it turns those into "length" finishes.
            limit = getattr(server, "max_len", None)
            max_context = limit if isinstance(limit, int) and not isinstance(limit, bool) else None
        if sampling.stop_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            sampling = replace(sampling, stop_ids=() if eos is None else (eos,))
        self._table = SessionTable(
            Limits(max_turns, max_tokens_per_session, sampling.max_tokens, max_context),
            retain=retain,
        )
        self._config = GatewayConfig(
            model_name=model_name,
            max_body_bytes=max_body_bytes,
            max_n=max_n,
            sampling=sampling,
            client_sampling=client_sampling,
        )
        self.engine = server
        self.tokenizer = tokenizer
        self.host = host
        self._port = port
        self._workers = workers
        self._grace = shutdown_grace
        self._startup_timeout = startup_timeout
        self._read_timeout = float(read_timeout)
        self._max_connections = max_connections
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._server: uvicorn.Server | None = None
        self._ready = threading.Event()  # set once the server listens (or failed to)
        self._pool: ThreadPoolExecutor | None = None
        self._failure: BaseException | None = None
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> RecordingGateway:
        """Bind, start serving on an owned thread and return once it listens."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the gateway is closed; build a new one")
            if self._thread is not None:
                raise RuntimeError("the gateway is already started")
            sock = bind(self.host, self._port, 1024)
            self._port = sock.getsockname()[1]
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="dew-gateway")
            app = build_app(self.engine, self.tokenizer, self._table, self._config, self._pool)
            config = uvicorn_config(
                app,
                read_timeout=self._read_timeout,
                max_connections=self._max_connections,
                graceful_shutdown=self._grace,
            )
            self._server = uvicorn_server(config, ready=self._ready)
            self._thread = threading.Thread(
                target=self._serve, args=(sock,), name="dew-gateway-http", daemon=True
            )
            self._thread.start()
        deadline = time.monotonic() + self._startup_timeout
        self._ready.wait(max(0.0, deadline - time.monotonic()))
        if self._failure is not None or not self._server.started:
            failure = self._failure
            self.close()
            raise RuntimeError(f"the gateway did not start: {failure!r}") from failure
        return self

    def _serve(self, sock: socket.socket) -> None:
        assert self._server is not None
        try:
            self._server.run(sockets=[sock])
        except BaseException as exc:  # kept for start() to raise; the thread just ends
            self._failure = exc
            self._ready.set()
        finally:
            sock.close()

    def close(self) -> None:
        """Close every session, stop serving and join the server thread and pool."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._table.close_all()
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> RecordingGateway:
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def port(self) -> int:
        return self._port

    @property
    def base_url(self) -> str:
        """``http://HOST:PORT/v1``, the value for ``OPENAI_BASE_URL``."""
        if self._thread is None:
            raise RuntimeError("the gateway is not started; call start() first")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self._port}/v1"

    @property
    def model_name(self) -> str:
        return self._config.model_name

    @property
    def sampling(self) -> SamplingParams:
        """The gateway's sampling, its stop ids resolved."""
        return self._config.sampling

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    # ------------------------------------------------------------------ sessions

    def open(self, task: Task, key: RolloutKey) -> str:
        """Open a session for one rollout attempt and return its bearer token.

        Supersedes every earlier session of ``(key.group, key.sample)``.
        """
        if not isinstance(key, RolloutKey):
            raise ValueError(f"key must be a RolloutKey, got {key!r}")
        return self._table.open(task, key)

    def abort(self, token: str) -> None:
        """Refuse the session's next requests (410) and abort its generations; keep its calls."""
        self._table.abort(token)

    def close_session(self, token: str) -> Recording:
        """Close the session (aborting what it has in flight) and return its recording."""
        return self._table.close(token)
