"""What a rollout scheduler is built with: its knobs, and the hooks a pool hands it.

:class:`SchedulerConfig` is the single home of the scheduling knobs. The scheduler,
its admission state machine (:mod:`dew.objectives.rl.admission`), the planner
(``dew plan``) and the simulated engine run all read them from one frozen value, so
each default is written here once and every check runs in one place
(``__post_init__``). A refused value raises ``ValueError`` whose message starts with
``name=value:`` and states the rule it broke.

:class:`SchedulerHooks` is how a multi-process pool joins a scheduler (see
:func:`dew.pool.attach`): it is handed over whole, before the task stream opens,
instead of attributes being set on a live scheduler.

The packed batch shape (``width``, ``rows``) is not a knob: it is required by the
scheduler and has no default. :func:`check_shape` validates it with the same rules.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from dew.core import Publisher
from dew.objectives.rl.estimators import DEFAULT_ESTIMATOR, Estimator, advantage_estimator
from dew.objectives.rl.truncation import DEFAULT_TRUNCATION, TruncationPolicy, truncation_policy

if TYPE_CHECKING:
    from dew.data import Batch

__all__ = [
    "EstimatorChoice",
    "SchedulerConfig",
    "SchedulerHooks",
    "TruncationChoice",
    "check_shape",
]

# A registered name, or a function with the registered functions' signature (see
# dew.objectives.rl.estimators.ESTIMATORS and dew.objectives.rl.truncation).
EstimatorChoice = str | Estimator
TruncationChoice = str | TruncationPolicy


def _refuse(name: str, value: object, rule: str) -> NoReturn:
    raise ValueError(f"{name}={value!r}: {rule}")


def _is_int(value: object) -> bool:
    """A Python or numpy integer; a bool or an integral float is not one."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _whole(name: str, value: object, least: int) -> None:
    if not (_is_int(value) and value >= least):  # type: ignore[operator]
        _refuse(name, value, f"must be an int >= {least}")


def check_shape(*, width: object, rows: object) -> tuple[int, int]:
    """``(width, rows)`` as Python ints; refuses a packed batch shape that is not two
    ints >= 1."""
    _whole("width", width, 1)
    _whole("rows", rows, 1)
    return int(width), int(rows)  # type: ignore[call-overload]


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduling knobs of a :class:`~dew.objectives.rl.scheduler.RolloutScheduler`.

    ``groups`` rollouts are admitted per task; ``oversample`` more run beside them and
    the slowest are cancelled. ``admit`` (None: every task) is how many groups of a
    task batch are admitted, the first to complete. ``ahead`` is how many task batches
    are submitted before the trainer hands them over; weights are pushed when the
    served version is ``sync_every`` updates behind; a rollout whose oldest call is
    more than ``max_lag`` updates old at consumption is discarded and resubmitted.
    ``max_attempts`` bounds the failed attempts of one sample before its group is
    abandoned; ``timeout`` (seconds from submission) fails an attempt still running.
    Its default, None, sets no bound: a source that hangs, even while honouring its
    stop event, then blocks the trainer for good (``dew demo`` and ``dew train`` set
    one). ``estimator`` and ``truncation`` choose pack's advantage estimator
    and the truncation policy, by registered name or as a function; ``support_capacity``
    (None: no support rows) is pack's per-row support length.

    ``max_lag`` may not be below :attr:`lag_floor`; :meth:`tight` builds the config
    whose ``max_lag`` is exactly that.
    """

    groups: int = 4
    oversample: int = 0
    admit: int | None = None
    max_lag: int = 1
    ahead: int = 1
    sync_every: int = 1
    max_attempts: int = 3
    timeout: float | None = None
    estimator: EstimatorChoice = DEFAULT_ESTIMATOR
    truncation: TruncationChoice = DEFAULT_TRUNCATION
    support_capacity: int | None = None

    def __post_init__(self) -> None:
        for name in ("groups", "max_attempts", "sync_every"):
            _whole(name, getattr(self, name), 1)
        for name in ("oversample", "ahead", "max_lag"):
            _whole(name, getattr(self, name), 0)
        if self.admit is not None and not (_is_int(self.admit) and self.admit >= 1):
            _refuse("admit", self.admit, "must be None or an int >= 1")
        for name in ("groups", "oversample", "admit", "max_lag", "ahead", "sync_every"):
            value = getattr(self, name)  # a numpy integer is kept as the int it is
            if value is not None:
                object.__setattr__(self, name, int(value))
        object.__setattr__(self, "max_attempts", int(self.max_attempts))
        timeout = self.timeout
        if timeout is not None and not (
            isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0
        ):
            _refuse("timeout", timeout, "must be None or > 0 seconds")
        capacity = self.support_capacity
        if capacity is not None and not (_is_int(capacity) and capacity >= 1):
            _refuse("support_capacity", capacity, "must be None or an int >= 1")
        if capacity is not None:
            object.__setattr__(self, "support_capacity", int(capacity))
        advantage_estimator(self.estimator)  # raises naming estimator
        if self.groups == 1 and isinstance(self.estimator, str):
            # Every registered estimator scores a rollout against the rest of its group.
            _refuse(
                "groups",
                self.groups,
                f"estimator {self.estimator!r} scores each rollout against the others of "
                "its group, so a group of one always has advantage 0 and nothing is "
                "learned: use groups >= 2 (or pass your own estimator function)",
            )
        truncation_policy(self.truncation)  # raises naming truncation
        floor = self.lag_floor
        if self.max_lag < floor:
            raise ValueError(
                f"max_lag={self.max_lag} < ahead + sync_every - 1 = {floor}: a first "
                f"submission can already be {floor} updates stale when consumed"
            )

    @property
    def in_flight_per_task(self) -> int:
        """``(groups + oversample) * (ahead + 1)``: the most rollouts of one task slot of
        a batch that run at once. Admission starts ``groups + oversample`` samples per
        task, for the batch being trained and the ``ahead`` batches submitted early; an
        engine or a source's worker pool sized below ``tasks * in_flight_per_task``
        queues some of them."""
        return (self.groups + self.oversample) * (self.ahead + 1)

    @property
    def lag_floor(self) -> int:
        """``ahead + sync_every - 1``: how stale a first submission can be when consumed.

        A batch is submitted ``ahead`` calls before it trains, under weights that may
        already be ``sync_every - 1`` updates behind; ``max_lag`` must allow that.
        """
        return self.ahead + self.sync_every - 1

    @classmethod
    def tight(cls, **knobs: Any) -> SchedulerConfig:
        """The config of ``knobs`` with ``max_lag`` set to the smallest value they allow.

        ``max_lag`` itself may not be passed. ``SchedulerConfig.tight(ahead=2)`` has
        ``max_lag=2``; ``SchedulerConfig.tight(ahead=0)`` is synchronous on-policy
        training (``max_lag=0``).
        """
        if "max_lag" in knobs:
            raise TypeError("tight() chooses max_lag itself; pass the other knobs only")
        ahead = knobs.get("ahead", cls.ahead)
        every = knobs.get("sync_every", cls.sync_every)
        # Bad values get their own message from __post_init__, not a TypeError here.
        floor = ahead + every - 1 if _is_int(ahead) and _is_int(every) else 0
        return cls(**knobs, max_lag=max(floor, 0))

    @property
    def name(self) -> str:
        """A short label of the knobs that shape throughput, for tables and plots.

        ``"sync"`` or ``"ahead N"``, then ``sync_every``, ``oversample`` and ``admit``
        when set, and ``max_lag`` when it is looser than :attr:`lag_floor`; for
        example ``"ahead 1 + oversample 2"``.
        """
        parts = ["sync" if self.ahead == 0 else f"ahead {self.ahead}"]
        if self.sync_every != 1:
            parts.append(f"sync_every {self.sync_every}")
        if self.oversample:
            parts.append(f"oversample {self.oversample}")
        if self.admit is not None:
            parts.append(f"admit {self.admit}")
        if self.max_lag != self.lag_floor:
            parts.append(f"max_lag {self.max_lag}")
        return " + ".join(parts)


@dataclass(frozen=True)
class SchedulerHooks:
    """How a multi-process pool joins a scheduler; a single process needs none.

    ``agree(failure)`` meets the other processes after admission and before the
    rescoring, with this process's failure or None, and raises on every process when
    any one failed. ``share(batch)`` hands a share's first reader's packed rows to
    its later readers (the first reader passes its batch, later readers None, and all
    get the first reader's rows back). ``samples=False`` marks a later reader: it
    registers no task batch, starts no rollout and logs nothing, so it needs
    ``share``. ``publisher(weights)`` wraps the scheduler's publisher, for pushes the
    pool makes together.

    A scheduler takes its hooks at construction
    (:meth:`~dew.objectives.rl.scheduler.RolloutScheduler.from_config`) or through
    :meth:`~dew.objectives.rl.scheduler.RolloutScheduler.connect` before its task
    stream first opens.
    """

    agree: Callable[[BaseException | None], None] | None = None
    share: Callable[[Batch | None], Batch] | None = None
    samples: bool = True
    publisher: Callable[[Publisher], Publisher] | None = None

    def __post_init__(self) -> None:
        if not self.samples and self.share is None:
            _refuse("samples", self.samples, "a later reader (samples=False) needs a share hook")
