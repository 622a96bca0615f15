"""Where rollouts come from: sources the scheduler starts sessions on.

* :class:`PromptSource`: single-turn prompts scored by a verifier;
* :class:`EnvironmentSource`: multi-turn episodes against an in-process environment;
* ``RecordingGateway`` / ``HarnessSource`` (:mod:`.gateway`): any OpenAI-client program
  as the agent. They need the ``gateway`` extra, so they are imported on first use.
"""

from __future__ import annotations

from typing import Any

from dew.objectives.rl.sources.environment import (
    AgentError,
    Environment,
    EnvironmentSource,
    Observation,
)
from dew.objectives.rl.sources.prompts import PromptSource, Verifier

__all__ = [
    "AgentError",
    "Environment",
    "EnvironmentSource",
    "HarnessEndpoint",
    "HarnessOutcome",
    "HarnessSource",
    "Observation",
    "PromptSource",
    "Recording",
    "RecordingGateway",
    "Verifier",
]

_GATEWAY = frozenset(
    {"HarnessEndpoint", "HarnessOutcome", "HarnessSource", "Recording", "RecordingGateway"}
)


def __getattr__(name: str) -> Any:
    if name in _GATEWAY:
        from dew.objectives.rl.sources import gateway

        return getattr(gateway, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
