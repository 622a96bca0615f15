"""GRPO-family RL for language models: sessions, packing, the objective and the scheduler.

``GRPOObjective`` (the one part that needs torch) is imported on first use, so the
planner and ``dew plan``, which use the scheduler's bookkeeping, start without torch.
"""

from typing import TYPE_CHECKING, Any

from dew.objectives.rl.pack import ESTIMATORS, PackStats, advantage_estimator, pack
from dew.objectives.rl.scheduler import Publisher, RolloutScheduler, SchedulerRecord, task_ids
from dew.objectives.rl.sessions import (
    TRUNCATION_POLICIES,
    Call,
    Chain,
    Rollout,
    RolloutKey,
    Session,
    SessionSource,
    Status,
    Task,
    ThreadedSource,
    Truncation,
    chains,
    merge_ratio,
    session_metrics,
)

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
