"""The session vocabulary as the scheduler, pack and the objective use it.

The records and protocols themselves live in :mod:`dew.core` (so that engines, sources
and the gateway share them without importing each other); this module gathers them
with what the RL side adds on top:

* :mod:`dew.objectives.rl.chains`: a rollout's calls merged into trained sequences;
* :mod:`dew.objectives.rl.truncation`: what a TRUNCATED rollout trains on (``mask``,
  ``score``, ``zero``, or a function of your own);
* :mod:`dew.objectives.rl.metrics`: the figures each scheduler record carries.
"""

from dew.core import (
    Call,
    Rollout,
    RolloutKey,
    Session,
    SessionSource,
    Status,
    Task,
    ThreadedSource,
)
from dew.objectives.rl.chains import Chain, chains, merge_ratio
from dew.objectives.rl.metrics import session_metrics
from dew.objectives.rl.truncation import TRUNCATION_POLICIES, Truncation, truncation_policy

__all__ = [
    "TRUNCATION_POLICIES",
    "Call",
    "Chain",
    "Rollout",
    "RolloutKey",
    "Session",
    "SessionSource",
    "Status",
    "Task",
    "ThreadedSource",
    "Truncation",
    "chains",
    "merge_ratio",
    "session_metrics",
    "truncation_policy",
]
