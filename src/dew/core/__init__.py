"""dew's core vocabulary, shared by every layer and importing nothing else of dew.

* records: :class:`Task`, :class:`RolloutKey`, :class:`Call`, :class:`Rollout`,
  :class:`Status`;
* protocols: :class:`Session`, :class:`SessionSource` (where rollouts come from),
  :class:`Engine` (where completions come from), :class:`Publisher` (where weights go);
* :class:`SamplingParams`, validated once; :func:`scored_temperature`, the temperature
  a completion's log-probs are reported under; :class:`Aborted`, how an engine reports a
  stopped request;
* :class:`ThreadedSource`, the base for sources written as blocking Python, and the
  reward parsing every source applies (:func:`parse_reward`);
* the argument checks every layer shares: :func:`as_int`, :func:`is_real`;
* the sketches a run's profile is made of (:mod:`dew.core.sketch`): :class:`LogHistogram`,
  :class:`IterationLog`, :class:`EngineTimings`, and :class:`Timed`, an engine that
  reports its iteration timings.

Serving (engines), sources and the gateway build on this package and never on each
other (``tests/test_layers.py`` checks the import graph).
"""

from dew.core._checks import as_int, is_real
from dew.core.engine import (
    MIN_TEMPERATURE,
    Aborted,
    Engine,
    EngineError,
    Publisher,
    SamplingParams,
    Variables,
    scored_temperature,
)
from dew.core.outcome import error_text, parse_reward
from dew.core.sketch import EngineTimings, IterationLog, LogHistogram, Timed
from dew.core.threaded import ThreadedSession, ThreadedSource
from dew.core.types import (
    Call,
    Rollout,
    RolloutKey,
    Session,
    SessionSource,
    Status,
    Task,
    cancelled_rollout,
)

__all__ = [
    "MIN_TEMPERATURE",
    "Aborted",
    "Call",
    "Engine",
    "EngineError",
    "EngineTimings",
    "IterationLog",
    "LogHistogram",
    "Publisher",
    "Rollout",
    "RolloutKey",
    "SamplingParams",
    "Session",
    "SessionSource",
    "Status",
    "Task",
    "ThreadedSession",
    "ThreadedSource",
    "Timed",
    "Variables",
    "as_int",
    "cancelled_rollout",
    "error_text",
    "is_real",
    "parse_reward",
    "scored_temperature",
]
