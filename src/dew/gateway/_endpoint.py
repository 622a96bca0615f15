"""A callable harness's side of a run: its endpoint, the HTTP clients behind it, and
running it to an answer.

Shared by :mod:`dew.gateway.harness` (runs on the source's threads) and
:mod:`dew.gateway._workers` (runs in harness processes).
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import openai

__all__ = ["Answer", "HarnessEndpoint", "ThreadClients", "run_harness", "shared_http"]

# How a run ended, as (kind, payload): ("value", what the harness returned), ("exit",
# (status, the SystemExit code as written)), ("raised", its traceback's text), and, from
# a harness process only, ("died", why).
Answer = tuple[str, Any]


@dataclass(frozen=True)
class HarnessEndpoint:
    """Where a callable harness sends its requests, and its stop signal."""

    base_url: str
    api_key: str
    model: str
    stop: threading.Event
    http_client: Any = field(default=None, repr=False)  # shared by the source's runs

    def client(self, **kwargs: Any) -> openai.OpenAI:
        """An ``openai.OpenAI`` client for this session (keyword arguments pass through).

        It sends through the connections of the worker thread running the harness,
        kept open from one rollout to the next (an HTTP client of its own would cost
        CPU, mostly TLS setup, and a new connection, each rollout: bench/RESULTS.md,
        "Figures moved out of code comments"); closing it leaves them open.
        """
        import openai

        if self.http_client is not None:
            kwargs.setdefault("http_client", self.http_client)
        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)


def shared_http() -> Any:
    """An HTTP client for one worker thread's harness runs (see HarnessEndpoint.client)."""
    import httpx

    class SharedClient(httpx.Client):
        """A pool many short-lived openai clients use; only its owner really closes it."""

        def close(self) -> None:
            pass  # an openai client's close() must not end everyone's pool

        def shutdown(self) -> None:
            super().close()

    from dew.gateway._transport import LoopbackTransport

    # The gateway speaks plain HTTP: no certificate store to load, and a transport
    # that writes each request whole (see _transport).
    return SharedClient(transport=LoopbackTransport())


class ThreadClients:
    """One :func:`shared_http` client per thread that asks for one; :meth:`shutdown`
    closes them all."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[Any] = []

    def get(self) -> Any:
        http = getattr(self._local, "client", None)
        if http is None:
            http = self._local.client = shared_http()
            with self._lock:
                self._all.append(http)
        return http

    def shutdown(self) -> None:
        with self._lock:
            clients, self._all = self._all, []
        for http in clients:
            http.shutdown()


def run_harness(harness: Callable[..., Any], task: Any, endpoint: HarnessEndpoint) -> Answer:
    """Run a callable harness on this thread and say how it ended (see ``Answer``)."""
    try:
        return "value", harness(task, endpoint)
    except SystemExit as exc:  # the harness quit: an exit status, not a crash of ours
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        return "exit", (code, repr(exc.code))
    except Exception as exc:
        return "raised", "".join(traceback.format_exception(exc))[-4000:]
