"""GRPO-family RL for language models: sessions, packing, the objective and the scheduler.

The records and protocols (``Call``, ``Rollout``, ``Session``...) are :mod:`dew.core`'s,
re-exported here beside what the RL side adds.

``GRPOObjective`` (the one part that needs torch) is imported on first use, so the
planner and ``dew plan``, which use the scheduler's bookkeeping, start without torch.
"""

from typing import TYPE_CHECKING, Any

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
from dew.objectives.rl.config import SchedulerConfig, SchedulerHooks
from dew.objectives.rl.estimators import ESTIMATORS, advantage_estimator
from dew.objectives.rl.metrics import session_metrics
from dew.objectives.rl.pack import PackStats, pack
from dew.objectives.rl.scheduler import Publisher, RolloutScheduler, SchedulerRecord, task_ids
from dew.objectives.rl.truncation import TRUNCATION_POLICIES, Truncation

if TYPE_CHECKING:
    from dew.objectives.rl.grpo import GRPOObjective


def __getattr__(name: str) -> Any:
    if name == "GRPOObjective":
        from dew.objectives.rl.grpo import GRPOObjective

        return GRPOObjective
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ESTIMATORS",
    "TRUNCATION_POLICIES",
    "Call",
    "Chain",
    "GRPOObjective",
    "PackStats",
    "Publisher",
    "Rollout",
    "RolloutKey",
    "RolloutScheduler",
    "SchedulerConfig",
    "SchedulerHooks",
    "SchedulerRecord",
    "Session",
    "SessionSource",
    "Status",
    "Task",
    "ThreadedSource",
    "Truncation",
    "advantage_estimator",
    "chains",
    "merge_ratio",
    "pack",
    "session_metrics",
    "task_ids",
]
