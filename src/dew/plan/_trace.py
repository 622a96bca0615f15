"""What one run of a policy leaves behind, and the figures computed from it.

The planner and the simulated run (``bench/schedule.py``) fill the same
:class:`Trace`, in simulated seconds, and :func:`summarize` turns it into the same
:class:`Figures`, so a prediction and a measurement differ only by what happened.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["BatchLedger", "Figures", "StepTrace", "Trace", "summarize"]


@dataclass
class StepTrace:
    """One trainer step ``k``: call at ``call``, rollouts in hand at ``ready``, done at ``end``."""

    call: float
    ready: float
    end: float
    waited: float  # seconds the trainer blocked on rollouts
    samples: int  # rollouts trained on (admitted and packed)
    tokens: float  # their completion tokens
    lag: int  # updates minus the oldest version in the batch
    token_lag: float  # token-weighted mean lag over loss-carrying tokens
    generated_at_end: float  # engine's cumulative generated tokens at ``end``


@dataclass
class BatchLedger:
    """Per task batch: every length drawn (one per attempt started) and tokens generated."""

    drawn: list[int] = field(default_factory=list)
    generated: float = 0.0


@dataclass
class Trace:
    steps: list[StepTrace]
    batches: dict[int, BatchLedger]
    limit_steps: list[float]  # per step: max(T, nominal batch tokens / full throughput)
    nominal_samples: int  # tasks x group
    full_throughput: float  # tokens per second
    generated_at_start: float  # engine's cumulative tokens at the first call


@dataclass(frozen=True)
class Figures:
    """Steady-state figures over the measured window of steps."""

    fraction: float  # limit time / actual time
    samples_ratio: float  # admitted samples per second / the limit's
    samples_per_s: float
    step_time: float  # mean seconds per step
    limit_step: float  # mean limit seconds per step
    trainer_idle: float  # share of time the trainer waited on rollouts
    engine_idle: float  # share of the engine's full-throughput capacity left unused
    lag: float  # mean over steps of the batch's oldest lag
    token_lag: float  # token-weighted lag, averaged over steps
    length_bias: float  # mean admitted length / mean drawn length
    wasted: float  # share of generated tokens never trained on

    def row(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.__dict__.items()}


def summarize(trace: Trace, warmup: int) -> Figures:
    """Figures over steps ``warmup..`` of ``trace`` (the first steps fill the pipeline)."""
    steps = trace.steps
    if not 0 <= warmup < len(steps):
        raise ValueError(f"warmup={warmup} must be in [0, {len(steps)}) steps")
    window: Sequence[StepTrace] = steps[warmup:]
    start = window[0].call
    start_gen = steps[warmup - 1].generated_at_end if warmup else trace.generated_at_start
    elapsed = window[-1].end - start
    limit = float(sum(trace.limit_steps[warmup:]))
    n = len(window)
    samples = sum(s.samples for s in window)
    tokens = sum(s.tokens for s in window)
    ks = range(warmup, len(steps))
    drawn = [x for k in ks for x in trace.batches[k].drawn] if n else []
    generated = sum(trace.batches[k].generated for k in ks)
    engine_tokens = window[-1].generated_at_end - start_gen
    limit_rate = trace.nominal_samples * n / limit
    return Figures(
        fraction=limit / elapsed,
        samples_ratio=(samples / elapsed) / limit_rate,
        samples_per_s=samples / elapsed,
        step_time=elapsed / n,
        limit_step=limit / n,
        trainer_idle=sum(s.waited for s in window) / elapsed,
        engine_idle=1.0 - engine_tokens / (trace.full_throughput * elapsed),
        lag=float(np.mean([s.lag for s in window])),
        token_lag=float(np.mean([s.token_lag for s in window])),
        length_bias=(tokens / max(samples, 1)) / float(np.mean(drawn)) if drawn else 1.0,
        wasted=1.0 - tokens / generated if generated else 0.0,
    )
