"""Sizing rollout scheduling before spending accelerators.

``presets``: completion-length models fitted to published traces. ``planner``: an
event-driven prediction of each scheduling policy's throughput against the limit.
``sim``: a time-scaled simulated engine that drives the real scheduler. ``cli``: the
``dew plan`` command.
"""

from dew.plan._engine import EngineConfig, EngineModel
from dew.plan.presets import PRESETS, LengthDraws, LengthPreset, preset

__all__ = ["PRESETS", "EngineConfig", "EngineModel", "LengthDraws", "LengthPreset", "preset"]
