"""What a callable harness is handed: its endpoint, and the HTTP client behind it.

Shared by :mod:`dew.gateway.harness` (runs on the source's threads) and
:mod:`dew.gateway._workers` (runs in harness processes).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import openai

__all__ = ["HarnessEndpoint", "shared_http"]


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
        ~0.1 s of CPU, mostly TLS setup, and a new connection); closing it leaves them
        open.
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
