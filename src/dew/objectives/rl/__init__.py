"""GRPO-family RL for language models: sessions, packing, the objective and the scheduler."""

from dew.objectives.rl.grpo import GRPOObjective
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
