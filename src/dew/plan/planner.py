"""Event-driven prediction of a scheduling policy's throughput against the limit.

The model has three parts and no threads or clock: simulated time jumps from one
event (a completion, a trainer step ending) to the next.

* The engine: :class:`dew.plan._engine.EngineModel`, one continuous-batching engine
  whose iteration takes ``a + b * active`` seconds, FIFO queue, ``max_active`` slots.
* The policy: the scheduler's own admission state machine
  (:class:`dew.objectives.rl._admission.Admission`), fed the same events the real
  driver feeds it. The plan therefore follows every rule the scheduler follows
  (groups, oversampling, admit, staleness); what it leaves out is the cost of
  running them — threads, packing, Python — which is what the benchmark measures.
* The trainer: step ``k`` registers batches up to ``k + ahead`` (the prefetch),
  pushes weights version ``k``, hands over batch ``k``, waits until it can be
  consumed, then trains for ``T`` seconds.

Task ``i`` of batch ``k`` is task id ``k * tasks + i``; lengths come from
:class:`dew.plan.presets.LengthDraws`, so the simulated-engine run with the same seed
draws exactly the same lengths.

The limit of step ``k`` is ``max(T, batch tokens / full throughput)``, with the
batch's nominal tokens (the first ``group`` samples of each task, first attempt): no
policy that trains on every task can beat both the trainer and a saturated engine.
Policies that cut (oversample, admit) generate less than that and can exceed 1; they
are compared in admitted samples per second beside their length bias.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from dew._collector import paused
from dew.objectives.rl._admission import Admission, Cancel, Consumed, Start
from dew.objectives.rl.sessions import Call, RolloutKey, Status, Task, _rollout_unchecked
from dew.plan._engine import EngineConfig, EngineModel
from dew.plan._trace import BatchLedger, Figures, StepTrace, Trace, summarize
from dew.plan.presets import LengthDraws, LengthPreset, preset

__all__ = [
    "Figures",
    "Policy",
    "Scenario",
    "generation_time",
    "limit_steps",
    "plan",
    "simulate",
]

_PROMPT = np.zeros(1, dtype=np.int64)  # the model needs one prompt token, not a real one
_ONE = np.zeros(1, dtype=np.int64)
_ONE_LP = np.zeros(1, dtype=np.float64)


@dataclass(frozen=True)
class Policy:
    """Scheduler settings that shape throughput: ``RolloutScheduler``'s arguments."""

    ahead: int = 1
    oversample: int = 0  # extra samples per group
    admit: int | None = None  # groups admitted per batch (None: all)
    max_lag: int | None = None  # None: the smallest allowed, ``ahead``

    def __post_init__(self) -> None:
        if self.ahead < 0:
            raise ValueError(f"ahead={self.ahead}: must be >= 0")
        if self.oversample < 0:
            raise ValueError(f"oversample={self.oversample}: must be >= 0")
        if self.admit is not None and self.admit < 1:
            raise ValueError(f"admit={self.admit}: must be None or >= 1")
        if self.max_lag is not None and self.max_lag < self.ahead:
            raise ValueError(f"max_lag={self.max_lag}: must be >= ahead={self.ahead}")

    @property
    def lag(self) -> int:
        return self.ahead if self.max_lag is None else self.max_lag

    @property
    def name(self) -> str:
        parts = ["sync" if self.ahead == 0 else f"ahead {self.ahead}"]
        if self.oversample:
            parts.append(f"oversample {self.oversample}")
        if self.admit is not None:
            parts.append(f"admit {self.admit}")
        if self.max_lag is not None and self.max_lag != self.ahead:
            parts.append(f"max_lag {self.max_lag}")
        return " + ".join(parts)


@dataclass(frozen=True)
class Scenario:
    """What is trained: length preset, task batch shape, trainer step time ``T``."""

    preset: LengthPreset
    tasks: int
    group: int
    T: float  # trainer seconds per step
    steps: int = 16
    warmup: int = 4  # steps excluded from the figures while the pipeline fills
    seed: int = 0
    quantum: int = 1  # lengths rounded up to a multiple of this
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if self.tasks < 1 or self.group < 1:
            raise ValueError(f"tasks={self.tasks} and group={self.group} must be >= 1")
        if not (self.T >= 0 and math.isfinite(self.T)):
            raise ValueError(f"T={self.T}: must be a finite number of seconds >= 0")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup={self.warmup}: must be in [0, steps={self.steps})")

    @classmethod
    def relative(cls, preset_name: str, tasks: int, group: int, t_ratio: float, **kw) -> Scenario:
        """A scenario whose ``T`` is ``t_ratio`` x a batch's generation time at full speed."""
        p = preset(preset_name)
        engine = kw.get("engine", EngineConfig())
        return cls(p, tasks, group, t_ratio * generation_time(p, tasks, group, engine), **kw)

    def draws(self) -> LengthDraws:
        return LengthDraws(self.preset, self.seed, quantum=self.quantum)


_MEAN_LENGTH: dict[LengthPreset, float] = {}


def generation_time(p: LengthPreset, tasks: int, group: int, engine: EngineConfig) -> float:
    """Seconds a saturated engine takes for ``tasks x group`` samples of mean length."""
    if p not in _MEAN_LENGTH:
        _MEAN_LENGTH[p] = p.mean_length()
    return tasks * group * _MEAN_LENGTH[p] / engine.full_throughput


def limit_steps(scenario: Scenario, draws: LengthDraws) -> list[float]:
    """Per step, ``max(T, nominal batch tokens / full throughput)``."""
    tasks, group = scenario.tasks, scenario.group
    full = scenario.engine.full_throughput
    return [
        max(scenario.T, draws.first_tokens(k * tasks, tasks, group) / full)
        for k in range(scenario.steps)
    ]


class _Run:
    """One planned run: the admission state machine driven by the engine model."""

    def __init__(self, policy: Policy, sc: Scenario) -> None:
        self.sc = sc
        self.adm = Admission(
            groups=sc.group,
            oversample=policy.oversample,
            admit=policy.admit,
            max_lag=policy.lag,
            ahead=policy.ahead,
            truncation="mask",
        )
        self.ahead = policy.ahead
        self.engine = EngineModel(sc.engine)
        self.draws = sc.draws()
        # key -> (task, task id, length, truncated) of every started attempt
        self.info: dict[RolloutKey, tuple[Task, int, int, bool]] = {}
        self.ledgers: defaultdict[int, BatchLedger] = defaultdict(BatchLedger)
        self.registered = 0
        self._calls: dict[tuple[int, bool], Call] = {}  # (version, truncated) -> shared call

    def execute(self, actions: list[Start | Cancel]) -> None:
        if not actions:  # most finish events start and cancel nothing
            return
        tasks, draws, engine, info = self.sc.tasks, self.draws, self.engine, self.info
        ledgers, batch, drawn = self.ledgers, -1, []
        for action in actions:
            key = action.key
            if type(action) is Start:
                tid = int(action.task.id)
                length, truncated = draws.get(tid, key.sample, key.attempt)
                engine.add(key, length)
                info[key] = (action.task, tid, length, truncated)
                if tid // tasks != batch:  # a submission's starts are all of one batch
                    batch = tid // tasks
                    drawn = ledgers[batch].drawn
                drawn.append(length)
            else:
                out = engine.cancel(key)
                if out is not None and out[0]:  # a queued request had generated nothing
                    ledgers[info[key][1] // tasks].generated += out[0]

    def _finished(self, key: RolloutKey, at: float, version: int) -> int:
        """Admit one completion; returns its batch."""
        task, tid, length, truncated = self.info[key]
        batch = tid // self.sc.tasks
        self.ledgers[batch].generated += length
        call = self._calls.get((version, truncated))
        if call is None:  # calls are immutable: one per (version, finish) serves every rollout
            reason = "length" if truncated else "stop"
            call = self._calls[(version, truncated)] = Call(
                _PROMPT, _ONE, _ONE_LP, version, finish_reason=reason
            )
        rollout = _rollout_unchecked(
            key,
            task,
            Status.TRUNCATED if truncated else Status.COMPLETED,
            (call,),
            float((tid + key.sample) % 2),
            "length" if truncated else None,
        )
        self.execute(self.adm.finished(key, rollout, at))
        return batch

    def run_until(self, t: float, batch: int | None = None) -> None:
        """Process completions up to time ``t``, or until one in ``batch`` makes the
        oldest batch ready (``batch`` is the oldest: nothing else can make it ready)."""
        engine, adm = self.engine, self.adm
        while (done := engine.next_until(t)) is not None:
            if self._finished(*done) == batch and adm.ready():
                return

    def register_until(self, n: int) -> None:
        tasks = self.sc.tasks
        while self.registered < n:
            b = self.registered
            self.adm.register([Task(str(b * tasks + i)) for i in range(tasks)], b)
            self.registered += 1

    def step(self, k: int) -> StepTrace:
        engine, adm = self.engine, self.adm
        call = engine.now
        self.register_until(k + self.ahead + 1)  # what the trainer's prefetch has read
        engine.served = k
        adm.pushed(k)
        self.execute(adm.call(k, call))
        consumed: list[Consumed | None] = [None]

        def try_consume() -> bool:
            consumed[0], actions = adm.consume(k, engine.now)
            self.execute(actions)
            return consumed[0] is not None

        while not try_consume():
            if engine.next_completion() is None:
                raise RuntimeError(f"step {k}: the batch can never complete (nothing running)")
            self.run_until(math.inf, batch=k)
        ready = engine.now
        out = consumed[0]
        assert out is not None
        samples = tokens = trained = lagged = 0.0
        oldest = k
        for group in out.groups:
            for r in group:
                _, _, length, truncated = self.info[r.key]
                version = r.calls[0].version
                samples += 1
                tokens += length
                oldest = min(oldest, version)
                if not truncated:
                    trained += length
                    lagged += length * (k - version)
        self.run_until(ready + self.sc.T)
        return StepTrace(
            call=call,
            ready=ready,
            end=engine.now,
            waited=ready - call,
            samples=int(samples),
            tokens=tokens,
            lag=k - oldest,
            token_lag=lagged / trained if trained else 0.0,
            generated_at_end=engine.generated,
        )


def simulate(policy: Policy, scenario: Scenario) -> Trace:
    """The planned run's trace, step by step (simulated seconds)."""
    # A plan allocates a few objects per simulated rollout, nearly all freed by reference
    # counting; collector passes over them took about a quarter of a 128 x 16 plan. The
    # run is dropped before the collector is back, so its first pass does not walk it.
    with paused():
        run = _Run(policy, scenario)
        steps = [run.step(k) for k in range(scenario.steps)]
        trace = Trace(
            steps=steps,
            batches=dict(run.ledgers),
            limit_steps=limit_steps(scenario, run.draws),
            nominal_samples=scenario.tasks * scenario.group,
            full_throughput=scenario.engine.full_throughput,
            generated_at_start=0.0,
        )
        del run
    return trace


def plan(policy: Policy, scenario: Scenario) -> Figures:
    """Predicted steady-state figures of ``policy`` on ``scenario``."""
    return summarize(simulate(policy, scenario), scenario.warmup)
