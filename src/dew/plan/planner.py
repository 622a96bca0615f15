"""Event-driven prediction of a scheduling policy's throughput against the limit.

A policy is a :class:`~dew.objectives.rl.config.SchedulerConfig`, the very value a
``RolloutScheduler`` runs with (``SchedulerConfig.tight(ahead=1)`` for the tightest
staleness bound the other knobs allow). The scenario describes the workload; its
``group`` (samples per task) is authoritative: the planner, like
:func:`dew.plan.sim.run_scheduler`, runs the config with ``groups`` replaced by
``scenario.group`` (see :func:`policy_for`), so one policy list serves every batch
shape.

The model has three parts and no threads or clock: simulated time jumps from one
event (a completion, a trainer step ending) to the next.

* The engine: :class:`dew.plan._engine.EngineModel`, one continuous-batching engine
  whose iteration takes ``a + b * active`` seconds, FIFO queue, ``max_active`` slots;
  with ``engines > 1``, a :class:`~dew.plan._engine.FleetModel` of that many, routed
  by group as a fleet routes.
* The policy: the scheduler's own admission state machine
  (:class:`dew.objectives.rl.admission.Admission`), fed the same events the real
  driver feeds it. The plan therefore follows every rule the scheduler follows
  (groups, oversampling, admit, staleness, ``sync_every``); what it leaves out is the
  cost of running them (threads, packing, Python), which is what the benchmark
  measures. The simulated engine never fails, so ``max_attempts`` never comes into
  play, and rollout timeouts are not modelled: a config with a ``timeout`` is refused.
* Turns (``turns``: the shares of rollouts that make 1, 2, 3, ... model calls): each
  rollout draws its number of calls, and its drawn length is split evenly into that
  many calls, and after each call it waits a latency drawn for that call (a tool, and
  after the last the verifier); between calls it holds no engine slot.
* The verifier: a rollout whose generation ended is scored after a latency drawn per
  rollout (per call, multi-turn: lognormal with median ``latency`` and sigma
  ``latency_sigma``, both 0 by default), during which it holds no engine slot; a
  sandbox or a tool-backed reward model. The scheduler sees the rollout finish when its score is in.
* The trainer: step ``k`` registers batches up to ``k + ahead`` (the prefetch),
  pushes weights version ``k`` when the served version is ``sync_every`` behind,
  hands over batch ``k``, waits until it can be consumed, then trains for ``T``
  seconds. With ``sharing < 1`` the trainer and the engines share one machine's
  cores: while the trainer works and an engine runs, each goes at ``sharing`` of its
  own speed, so ``T`` stretches and iterations slow down by as much as they overlap.

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

import dataclasses
import heapq
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from dew._collector import paused
from dew.core import Call, RolloutKey, Status, Task
from dew.core.types import simulated_rollout
from dew.objectives.rl.admission import Admission, Cancel, Consumed, Start
from dew.objectives.rl.config import SchedulerConfig
from dew.plan._engine import EngineConfig, EngineModel, FleetModel
from dew.plan._trace import BatchLedger, Figures, StepTrace, Trace, summarize
from dew.plan.presets import LengthDraws, LengthPreset, preset

__all__ = [
    "Figures",
    "Scenario",
    "generation_time",
    "limit_steps",
    "plan",
    "policy_for",
    "recommend",
    "simulate",
]

_PROMPT = np.zeros(1, dtype=np.int64)  # the model needs one prompt token, not a real one
_ONE = np.zeros(1, dtype=np.int64)
_ONE_LP = np.zeros(1, dtype=np.float64)


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
    latency: float = 0.0  # median seconds from a call's last token to its score (or next call)
    latency_sigma: float = 0.0  # sigma of the lognormal verifier latency
    engines: int = 1  # identical engines behind a fleet's routing (FleetModel)
    # Shares of rollouts making 1, 2, 3, ... model calls (see the module docstring).
    turns: tuple[float, ...] = (1.0,)
    # While the trainer works and an engine runs, each goes at this share of its own
    # speed: one machine's cores shared between them (1: separate devices).
    sharing: float = 1.0

    def __post_init__(self) -> None:
        for name in ("latency", "latency_sigma"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name}={value}: must be a finite number >= 0")
        if self.tasks < 1 or self.group < 1:
            raise ValueError(f"tasks={self.tasks} and group={self.group} must be >= 1")
        if not (self.T >= 0 and math.isfinite(self.T)):
            raise ValueError(f"T={self.T}: must be a finite number of seconds >= 0")
        if not 0 < self.sharing <= 1:
            raise ValueError(f"sharing={self.sharing}: must be in (0, 1]")
        if self.engines < 1:
            raise ValueError(f"engines={self.engines}: must be >= 1")
        if not self.turns or min(self.turns) < 0 or not sum(self.turns) > 0:
            raise ValueError(f"turns={self.turns}: shares of 1, 2, ... calls, >= 0, not all 0")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup={self.warmup}: must be in [0, steps={self.steps})")

    @classmethod
    def relative(cls, preset_name: str, tasks: int, group: int, t_ratio: float, **kw) -> Scenario:
        """A scenario whose ``T`` is ``t_ratio`` x a batch's generation time at full speed."""
        p = preset(preset_name)
        engine = kw.get("engine", EngineConfig())
        return cls(p, tasks, group, t_ratio * generation_time(p, tasks, group, engine), **kw)

    @property
    def full_throughput(self) -> float:
        """Tokens per second with every slot of every engine busy."""
        return self.engine.full_throughput * self.engines

    def draws(self) -> LengthDraws:
        return LengthDraws(self.preset, self.seed, quantum=self.quantum)


class _Latencies:
    """Seconds outside the engine per ``(task, sample, attempt, call)``, seeded like the
    lengths: one generator per ``(task, attempt, call)`` draws the whole group's at
    once."""

    def __init__(self, sc: Scenario, block: int) -> None:
        self.median, self.sigma = sc.latency, sc.latency_sigma
        self.seed, self.block = sc.seed, block
        self._rows: dict[tuple[int, int, int], list[float]] = {}

    def get(self, task: int, sample: int, attempt: int, call: int = 0) -> float:
        if self.median == 0.0:
            return 0.0
        row = self._rows.get((task, attempt, call))
        if row is None:
            # the first call's seeding is the single-turn one: those plans draw as before
            seed = [self.seed, task, attempt, 1 << 20] + ([call] if call else [])
            z = np.random.default_rng(seed).normal(size=self.block)  # [block]
            row = (self.median * np.exp(self.sigma * z)).tolist()
            self._rows[(task, attempt, call)] = row
        return row[sample]


_MEAN_LENGTH: dict[LengthPreset, float] = {}


def generation_time(
    p: LengthPreset, tasks: int, group: int, engine: EngineConfig, engines: int = 1
) -> float:
    """Seconds ``engines`` saturated engines take for ``tasks x group`` samples of mean
    length."""
    if p not in _MEAN_LENGTH:
        _MEAN_LENGTH[p] = p.mean_length()
    return tasks * group * _MEAN_LENGTH[p] / (engine.full_throughput * engines)


def limit_steps(scenario: Scenario, draws: LengthDraws) -> list[float]:
    """Per step, ``max(T, nominal batch tokens / full throughput)``."""
    tasks, group = scenario.tasks, scenario.group
    full = scenario.full_throughput
    return [
        max(scenario.T, draws.first_tokens(k * tasks, tasks, group) / full)
        for k in range(scenario.steps)
    ]


def policy_for(config: SchedulerConfig, scenario: Scenario) -> SchedulerConfig:
    """``config`` with ``groups`` set to the scenario's group: the knobs a run uses."""
    if not isinstance(config, SchedulerConfig):
        raise TypeError(f"policy: expected a SchedulerConfig, got {type(config).__name__}")
    if config.groups == scenario.group:
        return config
    return dataclasses.replace(config, groups=scenario.group)


class _Run:
    """One planned run: the admission state machine driven by the engine model."""

    def __init__(self, policy: SchedulerConfig, sc: Scenario) -> None:
        if policy.timeout is not None:
            raise ValueError(
                f"timeout={policy.timeout!r}: the planner does not model rollout timeouts"
            )
        self.sc = sc
        self.config = policy_for(policy, sc)
        self.adm = Admission(self.config)
        self.served: int | None = None
        self.engine: EngineModel | FleetModel = (
            EngineModel(sc.engine) if sc.engines == 1 else FleetModel([sc.engine] * sc.engines)
        )
        self.draws = sc.draws()
        self.latencies = _Latencies(sc, self.draws.block)
        # rollouts generated and being scored: (time scored, tiebreak, key, version)
        self.verifying: list[tuple[float, int, RolloutKey, int]] = []
        self._tiebreak = 0
        # key -> (task, task id, length, truncated) of every started attempt
        self.info: dict[RolloutKey, tuple[Task, int, int, bool]] = {}
        self.ledgers: defaultdict[int, BatchLedger] = defaultdict(BatchLedger)
        self.registered = 0
        self._calls: dict[tuple[int, bool], Call] = {}  # (version, truncated) -> shared call
        # Multi-turn rollouts (scenario.turns > 1): each key's turns still to run, the
        # length of the one in the engine, and the version of its first.
        self._left: dict[RolloutKey, list[int]] = {}
        self._turn: dict[RolloutKey, int] = {}
        self._first: dict[RolloutKey, int] = {}
        self._calls_of: dict[RolloutKey, int] = {}
        shares = np.asarray(sc.turns, dtype=np.float64)
        self._multi = len(sc.turns) > 1
        self._cumulative = (np.cumsum(shares) / shares.sum()).tolist()

    def _split(self, key: RolloutKey, length: int) -> int:
        """Draw a multi-turn rollout's calls and split its ``length`` over them; the
        first call's length."""
        # a uniform draw from the key and the seed alone, so every plan draws alike
        mixed = key.group * 1_000_003 + key.sample * 10_007 + key.attempt * 101 + self.sc.seed
        u = (mixed * 2_654_435_761 % 2**32) / 2**32
        calls = next(i for i, c in enumerate(self._cumulative, 1) if u < c or c >= 1.0)
        turns = self._calls_of[key] = min(calls, length)
        base, extra = divmod(length, turns)
        parts = [base + 1] * extra + [base] * (turns - extra)
        self._left[key] = parts[1:]
        self._turn[key] = parts[0]
        return parts[0]

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
                engine.add(key, self._split(key, length) if self._multi else length)
                info[key] = (action.task, tid, length, truncated)
                if tid // tasks != batch:  # a submission's starts are all of one batch
                    batch = tid // tasks
                    drawn = ledgers[batch].drawn
                drawn.append(length)
            else:
                out = engine.cancel(key)
                if out is not None and out[0]:  # a queued request had generated nothing
                    ledgers[info[key][1] // tasks].generated += out[0]
                if self._multi:  # between two turns it does not come back
                    self._left.pop(key, None)
                    self._turn.pop(key, None)
                    self._first.pop(key, None)
                    self._calls_of.pop(key, None)

    def _generated(self, key: RolloutKey, at: float, version: int) -> int | None:
        """The engine finished ``key`` (a turn of it, multi-turn): admit it, or queue
        it for its verifier (or its tool, before the next turn); returns the batch when
        it was admitted now."""
        _, tid, length, _ = self.info[key]
        if self._multi:  # each call's own wait: its index is how many are done
            call = self._calls_of[key] - len(self._left.get(key, ())) - 1
            latency = self.latencies.get(tid, key.sample, key.attempt, call)
            length = self._turn.pop(key)
            version = self._first.setdefault(key, version)  # its oldest call's
            if self._left.get(key):
                self.ledgers[tid // self.sc.tasks].generated += length
                self._tiebreak += 1  # a tool's latency, then the next turn (version -1)
                heapq.heappush(self.verifying, (at + latency, self._tiebreak, key, -1))
                return None
            del self._first[key]
            self._left.pop(key, None)
            self._calls_of.pop(key, None)
        else:
            latency = self.latencies.get(tid, key.sample, key.attempt)
        self.ledgers[tid // self.sc.tasks].generated += length
        if latency == 0.0:
            return self._finished(key, at, version)
        self._tiebreak += 1
        heapq.heappush(self.verifying, (at + latency, self._tiebreak, key, version))
        return None

    def _next_turn(self, key: RolloutKey) -> None:
        """A multi-turn rollout's tool answered: its next turn joins the engine, unless
        it was cancelled meanwhile."""
        left = self._left.get(key)
        if not left:
            self._first.pop(key, None)
            self._calls_of.pop(key, None)
            return
        self._turn[key] = length = left.pop(0)
        self.engine.add(key, length)

    def _next_event(self, t: float) -> tuple[bool, int | None]:
        """Process the next completion or score at or before ``t``; ``(whether one
        came, the batch of a rollout admitted by it)``. Without one, time moves to
        ``t`` (or stays, for ``t = inf``)."""
        scored = self.verifying[0][0] if self.verifying else math.inf
        done = self.engine.next_until(min(t, scored))
        if done is not None:
            return True, self._generated(*done)
        if scored <= t:  # the engine's clock stands at the score's time
            at, _, key, version = heapq.heappop(self.verifying)
            if version < 0:
                self._next_turn(key)
                return True, None
            return True, self._finished(key, at, version)
        return False, None

    def _finished(self, key: RolloutKey, at: float, version: int) -> int:
        """Admit one scored rollout; returns its batch."""
        task, tid, _, truncated = self.info[key]
        batch = tid // self.sc.tasks
        call = self._calls.get((version, truncated))
        if call is None:  # calls are immutable: one per (version, finish) serves every rollout
            reason = "length" if truncated else "stop"
            call = self._calls[(version, truncated)] = Call(
                _PROMPT, _ONE, _ONE_LP, version, finish_reason=reason
            )
        rollout = simulated_rollout(
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
        adm = self.adm
        while True:
            came, admitted = self._next_event(t)
            if not came:
                return
            if admitted is not None and admitted == batch and adm.ready():
                return

    def train_shared(self, work: float) -> None:
        """The trainer's ``work`` seconds on cores it shares with the engines: while any
        engine runs, the trainer and the engines each go at ``sharing`` of their speed.
        Completions and scores on the way are processed as they come."""
        engine, share = self.engine, self.sc.sharing
        engine.slowdown = 1.0 / share
        while work > 1e-12:
            rate = share if engine.active else 1.0
            done = engine.now + work / rate
            scored = self.verifying[0][0] if self.verifying else math.inf
            nxt = engine.next_completion()
            event = min(scored, math.inf if nxt is None else nxt)
            if done <= event:
                self.run_until(done)  # nothing comes before: the clock moves to it
                break
            start = engine.now
            self._next_event(event)
            work -= (engine.now - start) * rate
        engine.slowdown = 1.0

    def register_until(self, n: int) -> None:
        tasks = self.sc.tasks
        while self.registered < n:
            b = self.registered
            self.adm.register([Task(str(b * tasks + i)) for i in range(tasks)], b)
            self.registered += 1

    def step(self, k: int) -> StepTrace:
        engine, adm = self.engine, self.adm
        call = engine.now
        self.register_until(k + self.config.ahead + 1)  # what the trainer's prefetch read
        if self.served is None or k - self.served >= self.config.sync_every:
            engine.served = self.served = k
            adm.pushed(k)
        self.execute(adm.call(k, call))
        consumed: list[Consumed | None] = [None]

        def try_consume() -> bool:
            consumed[0], actions = adm.consume(k, engine.now)
            self.execute(actions)
            return consumed[0] is not None

        while not try_consume():
            if engine.next_completion() is None and not self.verifying:
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
        if self.sc.sharing == 1.0:
            self.run_until(ready + self.sc.T)
        else:
            self.train_shared(self.sc.T)
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


def simulate(policy: SchedulerConfig, scenario: Scenario) -> Trace:
    """The planned run's trace, step by step (simulated seconds)."""
    # A plan allocates a few objects per simulated rollout, nearly all freed by reference
    # counting; collector passes over them were a large share of a plan's time
    # (bench/RESULTS.md, "garbage collector"). The run is dropped before the collector
    # is back, so its first pass does not walk it.
    with paused():
        run = _Run(policy, scenario)
        steps = [run.step(k) for k in range(scenario.steps)]
        trace = Trace(
            steps=steps,
            batches=dict(run.ledgers),
            limit_steps=limit_steps(scenario, run.draws),
            nominal_samples=scenario.tasks * scenario.group,
            full_throughput=scenario.full_throughput,
            generated_at_start=0.0,
        )
        del run
    return trace


def plan(policy: SchedulerConfig, scenario: Scenario) -> Figures:
    """Predicted steady-state figures of ``policy`` on ``scenario``."""
    return summarize(simulate(policy, scenario), scenario.warmup)


def recommend(
    rows: Sequence[tuple[SchedulerConfig, Figures]], max_bias: float = 0.02
) -> SchedulerConfig:
    """The policy of ``rows`` to run: the most admitted samples per second among those
    whose length bias is within ``max_bias`` of 1.

    A policy that cuts the tail (oversample, admit) admits short answers first; past a
    small bias it trains on a different length distribution than the task's, so speed
    alone is not the criterion. Policies within 2% of the fastest count as equally
    fast; among them the one with the least lag wins (fresher data for the same speed),
    then the one that wastes the fewest tokens. When every policy is past ``max_bias``
    the least biased one is returned.
    """
    if not rows:
        raise ValueError("rows: no planned policy to recommend from")
    if not (max_bias >= 0 and math.isfinite(max_bias)):
        raise ValueError(f"max_bias={max_bias}: must be a finite number >= 0")
    fair = [(p, f) for p, f in rows if abs(f.length_bias - 1.0) <= max_bias]
    if not fair:
        return min(rows, key=lambda r: abs(r[1].length_bias - 1.0))[0]
    best = max(f.samples_per_s for _, f in fair)
    fast = [(p, f) for p, f in fair if f.samples_per_s >= 0.98 * best]
    return min(fast, key=lambda r: (r[1].lag, r[1].wasted))[0]
