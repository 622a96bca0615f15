"""A simulated engine as a dew SessionSource, in scaled real time, and a run of the real
RolloutScheduler against it.

:class:`SimulatedEngineSource` runs the planner's engine model
(:class:`dew.plan._engine.EngineModel`) against the wall clock: one simulated second
lasts ``scale`` real seconds. Each session is one rollout of one call whose completion
length is drawn from :class:`dew.plan.presets.LengthDraws`; its tokens are constant
ids (one per ``quantum`` simulated tokens, so a long-CoT batch stays cheap to pack),
its version is the version served when it got its engine slot (its first token). The
source is also the :class:`dew.objectives.rl.scheduler.Publisher`: ``load`` sets the
served version.

Concurrency invariants:

* One engine thread, owned by the source and joined by ``close()``, sleeps until the
  next completion (or a notify) and resolves finished sessions, outside the lock.
* The engine model is only touched under ``_cond``, always advanced to the scaled
  wall clock first, so arrivals, cancels and pushes happen at their real time.
* A session resolves exactly once: to its completion (engine thread) or to
  ``CANCELLED`` (the canceller's thread), whichever comes first; callbacks run once,
  after resolution, on the resolving thread. ``close()`` resolves completions the
  engine thread had not handed out yet.
* A rollout that cannot be built resolves its session to the exception (``result()``
  re-raises it, which stops the scheduler). Should the engine thread itself raise,
  every live session resolves to that exception, later ``start`` calls raise, and the
  thread re-raises.

:func:`run_scheduler` is the trainer side: the real scheduler, the trainer's prefetch
and a trainer step that sleeps ``T`` (scaled). The proximal rescoring is a stand-in
(:class:`TrainerStandIn`) that returns zeros: ``T`` models the trainer's whole step, so
what is measured is the scheduling — admission, the driver thread, packing.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from dew._collector import frozen
from dew.core import Call, Rollout, RolloutKey, Session, Status, Task
from dew.data import Dataset, Prefetch
from dew.objectives.rl.config import SchedulerConfig
from dew.objectives.rl.scheduler import RolloutScheduler, SchedulerRecord
from dew.plan._engine import EngineConfig, EngineModel
from dew.plan._trace import BatchLedger, StepTrace, Trace
from dew.plan.planner import Scenario, limit_steps, policy_for
from dew.plan.presets import LengthDraws

__all__ = ["SimulatedEngineSource", "TrainerStandIn", "run_scheduler"]

_PROMPT_TOKENS = 4


class _SimSession:
    """One simulated rollout; resolves once (see the module invariants)."""

    def __init__(self, source: SimulatedEngineSource, task: Task, key: RolloutKey) -> None:
        self.source = source
        self.task = task
        self.key = key
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._result: Rollout | BaseException | None = None
        self._callbacks: list[Callable[[Session], None]] = []

    def cancel(self) -> None:
        if self._done.is_set():
            return
        self.source._cancel(self)
        self._resolve(
            Rollout(key=self.key, task=self.task, status=Status.CANCELLED, error="cancelled")
        )

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Rollout:
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.key}: not finished after {timeout} s")
        if isinstance(self._result, BaseException):
            raise self._result
        assert self._result is not None
        return self._result

    def add_done_callback(self, fn: Callable[[Session], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _resolve(self, rollout: Rollout | BaseException) -> bool:
        with self._lock:
            if self._done.is_set():
                return False
            self._result = rollout
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)
        return True


class SimulatedEngineSource:
    """SessionSource and Publisher backed by the engine model in scaled real time.

    ``draws`` gives each ``(task id, sample, attempt)`` its length; task ids must be
    decimal integers. ``tasks`` (task ids per batch) groups the ledgers by batch
    (``task id // tasks``). ``scale`` is real seconds per simulated second.
    """

    def __init__(
        self,
        draws: LengthDraws,
        *,
        scale: float,
        tasks: int = 1,
        engine: EngineConfig | None = None,
    ) -> None:
        if not (scale > 0 and math.isfinite(scale)):
            raise ValueError(f"scale={scale}: must be a positive number of real seconds")
        if tasks < 1:
            raise ValueError(f"tasks={tasks}: must be >= 1")
        self.draws = draws
        self.scale = scale
        self.tasks = tasks
        self.engine = EngineModel(engine or EngineConfig())
        self.ledgers: defaultdict[int, BatchLedger] = defaultdict(BatchLedger)
        self.versions_loaded: list[int] = []
        cap = -(-draws.preset.cap // draws.quantum) + 1
        self._zeros_i = np.zeros(cap, dtype=np.int64)  # views of these are the token ids
        self._zeros_f = np.zeros(cap, dtype=np.float64)
        self._cond = threading.Condition()
        self._live: dict[RolloutKey, tuple[_SimSession, int, int, bool]] = {}
        self._pending: list[tuple[_SimSession, Rollout | BaseException]] = []
        self._closed = False
        self._failure: BaseException | None = None
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="dew-sim-engine", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- clock

    def now(self) -> float:
        """Simulated seconds since the source started."""
        return (time.monotonic() - self._t0) / self.scale

    def to_sim(self, monotonic: float) -> float:
        """A ``time.monotonic()`` reading in simulated seconds."""
        return (monotonic - self._t0) / self.scale

    def _advance(self) -> None:
        """Bring the engine to the wall clock; queue completions for the engine thread."""
        for key, _, version in self.engine.advance(self.now()):
            entry = self._live.pop(key, None)
            if entry is None:
                continue
            session, tid, length, truncated = entry
            self.ledgers[tid // self.tasks].generated += length
            try:
                outcome: Rollout | BaseException = self._rollout(
                    session, version, length, truncated
                )
            except Exception as exc:  # a rollout the source cannot build: the session raises it
                outcome = exc
            self._pending.append((session, outcome))
        if self._pending:
            self._cond.notify_all()

    def _rollout(self, session: _SimSession, version: int, length: int, truncated: bool) -> Rollout:
        key, tid = session.key, int(session.task.id)
        n = length // self.draws.quantum
        call = Call(
            prompt=self._zeros_i[:_PROMPT_TOKENS],
            completion=self._zeros_i[:n],
            log_probs=self._zeros_f[:n],
            version=version,
            finish_reason="length" if truncated else "stop",
        )
        return Rollout(
            key=key,
            task=session.task,
            status=Status.TRUNCATED if truncated else Status.COMPLETED,
            calls=(call,),
            reward=float((tid + key.sample) % 2),
            truncation="length" if truncated else None,
        )

    def generated(self) -> float:
        """Tokens the engine has generated so far (simulated tokens)."""
        with self._cond:
            self._advance()
            return self.engine.generated

    # ---------------------------------------------------------------- source

    def start(self, task: Task, key: RolloutKey) -> Session:
        try:
            tid = int(task.id)
        except ValueError:
            raise ValueError(f"{key}: task id {task.id!r} is not a decimal integer") from None
        if tid < 0:
            raise ValueError(f"{key}: task id {tid} must be >= 0")
        length, truncated = self.draws.get(tid, key.sample, key.attempt)
        session = _SimSession(self, task, key)
        with self._cond:
            if self._closed or self._failure is not None:
                raise RuntimeError("SimulatedEngineSource is closed") from self._failure
            self._advance()
            idle = self.engine.active == 0
            self.engine.add(key, length)
            self._live[key] = (session, tid, length, truncated)
            self.ledgers[tid // self.tasks].drawn.append(length)
            # An arrival only delays the next completion (one more sequence per
            # iteration), so a waiting engine thread wakes early at worst and sleeps
            # again; it is only woken when there was nothing to wait for. Waking it on
            # every start made it contend for the GIL with the driver's start storm.
            if idle:
                self._cond.notify_all()
        return session

    def _cancel(self, session: _SimSession) -> None:
        with self._cond:
            entry = self._live.pop(session.key, None)
            if entry is None:
                return
            self._advance()
            out = self.engine.cancel(session.key)
            if out is not None:
                self.ledgers[entry[1] // self.tasks].generated += out[0]
            self._cond.notify_all()

    def load(self, variables: Any, version: int) -> None:
        """Serve ``version`` from now on (sequences already decoding keep theirs)."""
        with self._cond:
            self._advance()
            self.engine.served = version
            self.versions_loaded.append(version)

    # ---------------------------------------------------------------- engine thread

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            with self._cond:
                self._failure = exc
                stuck = [entry[0] for entry in self._live.values()]
                stuck += [session for session, _ in self._pending]
                self._live.clear()
                self._pending = []
            for session in stuck:
                session._resolve(exc)
            raise

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._pending:
                    self._advance()
                    if self._pending:
                        break
                    nxt = self.engine.next_completion()
                    wait = None if nxt is None else max((nxt - self.now()) * self.scale, 0.0)
                    self._cond.wait(wait)
                if self._closed:
                    return
                pending, self._pending = self._pending, []
            for session, rollout in pending:
                session._resolve(rollout)

    def close(self) -> None:
        """Cancel every live session and join the engine thread."""
        with self._cond:
            self._closed = True
            live = [entry[0] for entry in self._live.values()]
            self._cond.notify_all()
        self._thread.join()
        with self._cond:
            pending, self._pending = self._pending, []
        for session, rollout in pending:
            session._resolve(rollout)
        for session in live:
            session.cancel()

    def __enter__(self) -> SimulatedEngineSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TrainerStandIn:
    """The objective as the scheduler sees it, minus the model: zero log-probs.

    ``RolloutScheduler`` rescores every packed batch with ``packed_log_probs``; here
    the trainer's whole step (rescoring included) is the sleep of ``T``, so this
    returns zeros of the batch's ``[rows, width]`` shape.
    """

    def packed_log_probs(self, model: Any, batch: Mapping[str, np.ndarray]) -> Any:
        import torch

        return torch.zeros(np.asarray(batch["tokens"]).shape, dtype=torch.float32)


def pack_shape(scenario: Scenario, draws: LengthDraws) -> tuple[int, int]:
    """``(rows, width)`` that hold any step's groups with room to spare."""
    width = -(-scenario.preset.cap // draws.quantum) + _PROMPT_TOKENS
    tasks, group = scenario.tasks, scenario.group
    # Every length is a multiple of the quantum, so the carried tokens of a step are its
    # nominal tokens / quantum, plus one prompt per sample.
    most = max(
        draws.first_tokens(k * tasks, tasks, group) // draws.quantum
        + tasks * group * _PROMPT_TOKENS
        for k in range(scenario.steps)
    )
    return int(1.3 * most / width) + 8, width


def run_scheduler(
    policy: SchedulerConfig,
    scenario: Scenario,
    *,
    scale: float,
    log: Callable[[SchedulerRecord], None] | None = None,
) -> Trace:
    """Run ``scenario.steps`` trainer steps of the real scheduler on the simulated engine.

    The scheduler runs ``policy`` with ``groups`` set to the scenario's group, as the
    planner does (:func:`dew.plan.planner.policy_for`); a ``timeout`` is in simulated
    seconds and is scaled with the clock. Returns the same :class:`Trace` the planner
    returns, in simulated seconds; ``log`` receives the scheduler's record of every step.
    """
    config = policy_for(policy, scenario)
    if scenario.latency:
        raise ValueError(
            f"latency={scenario.latency}: the simulated engine source scores at once; "
            "only the planner models a verifier latency"
        )
    if scenario.engines != 1:
        raise ValueError(
            f"engines={scenario.engines}: the simulated engine source is one engine; "
            "only the planner models a fleet"
        )
    if config.timeout is not None:
        config = dataclasses.replace(config, timeout=config.timeout * scale)
    draws = scenario.draws()
    rows, width = pack_shape(scenario, draws)
    n_batches = scenario.steps + config.ahead + 1
    dataset = Dataset(
        {"task_id": np.arange(n_batches * scenario.tasks)},
        batch_size=scenario.tasks,
        shuffle=False,
    )
    steps: list[StepTrace] = []
    with SimulatedEngineSource(
        draws, scale=scale, tasks=scenario.tasks, engine=scenario.engine
    ) as source:
        scheduler = RolloutScheduler.from_config(
            TrainerStandIn(),  # type: ignore[arg-type]
            source,
            source,
            config,
            width=width,
            rows=rows,
            log=log,
        )
        with scheduler, frozen():  # collector passes skip the set-up heap
            start_generated = source.generated()
            prefetch = Prefetch(scheduler.tasks(dataset).stream(), depth=config.ahead)
            for k in range(scenario.steps):
                call = time.monotonic()
                batch = next(prefetch)
                scheduler(None, batch, updates=k)
                ready = time.monotonic()
                deadline = ready + scenario.T * scale
                while (left := deadline - time.monotonic()) > 0:
                    time.sleep(left)  # the trainer's step
                end = time.monotonic()
                record = scheduler.history[-1]
                if record.cut:
                    raise RuntimeError(
                        f"step {k}: {record.cut} groups did not fit [{rows}, {width}]"
                    )
                samples = record.groups * scenario.group
                m = record.metrics
                steps.append(
                    StepTrace(
                        call=source.to_sim(call),
                        ready=source.to_sim(ready),
                        end=source.to_sim(end),
                        waited=record.waited / scale,
                        samples=samples,
                        tokens=m.get("completion_tokens_mean", 0.0) * samples * draws.quantum,
                        lag=record.lag,
                        token_lag=m.get("token_lag_mean", 0.0),
                        generated_at_end=source.generated(),
                    )
                )
        ledgers = dict(source.ledgers)
    return Trace(
        steps=steps,
        batches=ledgers,
        limit_steps=limit_steps(scenario, draws),
        nominal_samples=scenario.tasks * scenario.group,
        full_throughput=scenario.full_throughput,
        generated_at_start=start_generated,
    )
