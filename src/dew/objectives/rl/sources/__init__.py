"""Where rollouts come from: sources the scheduler starts sessions on.

* :class:`PromptSource`: single-turn prompts scored by a verifier (or a
  :class:`GroupVerifier`, a group's completions in one call);
* :class:`EnvironmentSource`: multi-turn episodes against an in-process environment;
* :class:`ChatTokens`: chat-template prompts extended token-exactly, turn by turn.

Sources use an engine only through :class:`dew.core.Engine`. Any OpenAI-client program
as the agent: ``HarnessSource`` in :mod:`dew.gateway`.
"""

from dew.objectives.rl.sources.chat import ChatTokens
from dew.objectives.rl.sources.environment import (
    AgentError,
    Environment,
    EnvironmentSource,
    Observation,
)
from dew.objectives.rl.sources.prompts import GroupVerifier, PromptSource, Verifier

__all__ = [
    "AgentError",
    "ChatTokens",
    "Environment",
    "EnvironmentSource",
    "GroupVerifier",
    "Observation",
    "PromptSource",
    "Verifier",
]
