"""Train an unmodified agent harness through an OpenAI-compatible, recording gateway.

* :class:`RecordingGateway` (:mod:`dew.gateway.recording`): an HTTP server speaking
  ``/v1/chat/completions`` (with ``stream: true``), ``/v1/completions`` and
  ``/v1/models`` in front of any :class:`dew.core.Engine`; every call a session's
  bearer token makes is recorded token-exactly, and :meth:`~RecordingGateway.close_session`
  hands over its :class:`Recording`;
* :class:`HarnessSource` (:mod:`dew.gateway.harness`): a session source that runs a
  harness (a Python callable given a :class:`HarnessEndpoint`, or a command run as a
  subprocess) per rollout and scores its :class:`HarnessOutcome` with a verifier.

Private modules: ``_app`` (the ASGI application), ``_protocol`` (request validation),
``_responses`` (response bodies), ``_sessions`` (the session table), ``_text``
(between text and tokens).

This package needs the ``gateway`` extra (starlette, uvicorn, httpx, openai); nothing
else of dew imports it. It builds on :mod:`dew.core` only (``tests/test_layers.py``).
"""

from dew.gateway.harness import (
    Harness,
    HarnessEndpoint,
    HarnessOutcome,
    HarnessSource,
    HarnessVerifier,
)
from dew.gateway.recording import DEFAULT_SAMPLING, Recording, RecordingGateway

__all__ = [
    "DEFAULT_SAMPLING",
    "Harness",
    "HarnessEndpoint",
    "HarnessOutcome",
    "HarnessSource",
    "HarnessVerifier",
    "Recording",
    "RecordingGateway",
]
