"""Hypothesis drives the admission state machine through random interleavings.

Finishes of every status, deadlines, pushes, calls, consumption, reopens and a final
close, checking the bookkeeping invariants after every step.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from dew.core import Call, Rollout, RolloutKey, Status, Task
from dew.objectives.rl.admission import Admission, Cancel, Start
from dew.objectives.rl.config import SchedulerConfig
from dew.objectives.rl.truncation import truncation_policy

CANCELLING = {"surplus", "abandoned", "dropped", "cancelled:stale", "reopened", "closed"}


def make_rollout(
    key: RolloutKey, status: Status, version: int, reward: float | None, length: int = 3
) -> Rollout:
    call = Call(
        prompt=[1, 2],
        completion=list(range(3, 3 + length)),
        log_probs=[-0.5] * length,
        version=version,
    )
    calls = [call] if status in (Status.COMPLETED, Status.AGENT_ERROR, Status.TRUNCATED) else []
    return Rollout(
        key=key,
        task=Task(str(key.group)),
        status=status,
        calls=calls,
        reward=reward if status is not Status.INFRA_ERROR else None,
        truncation="length" if status is Status.TRUNCATED else None,
    )


def raw_reward(rewards: np.ndarray, trained: np.ndarray) -> np.ndarray:
    return rewards


class AdmissionMachine(RuleBasedStateMachine):
    @initialize(
        groups=st.integers(1, 3),
        oversample=st.integers(0, 2),
        admit=st.one_of(st.none(), st.integers(1, 3)),
        ahead=st.integers(0, 2),
        sync_every=st.integers(1, 2),
        extra_lag=st.integers(0, 1),
        max_attempts=st.integers(1, 3),
        timeout=st.one_of(st.none(), st.floats(2.0, 8.0)),
        truncation=st.sampled_from(["mask", "score", "zero"]),
    )
    def setup(
        self,
        groups: int,
        oversample: int,
        admit: int | None,
        ahead: int,
        sync_every: int,
        extra_lag: int,
        max_attempts: int,
        timeout: float | None,
        truncation: str,
    ) -> None:
        self.sync_every = sync_every
        self.adm = Admission(
            SchedulerConfig(
                groups=groups,
                oversample=oversample,
                admit=admit,
                max_lag=ahead + sync_every - 1 + extra_lag,
                ahead=ahead,
                sync_every=sync_every,
                max_attempts=max_attempts,
                timeout=timeout,
                truncation=truncation,
                # Admission never computes advantages; a function allows groups of one.
                estimator=raw_reward,
            )
        )
        self.adm.audit = {}
        self.running: dict[RolloutKey, Task] = {}
        self.started: list[RolloutKey] = []
        self.finished: set[RolloutKey] = set()
        self.expected_resubmits: Counter[str] = Counter()
        self.resubmitted: Counter[str] = Counter()
        self.cancelled = 0
        self.abandoned = 0
        self.stale_rollouts = 0
        self.now = 0.0
        self.updates = 0
        self.pending = False
        self.packed_groups: set[int] = set()
        self.abandoned_groups: set[int] = set()
        self.closed = False

    # ------------------------------------------------------------------ helpers

    def apply(self, actions: list[Start | Cancel]) -> None:
        audit = self.adm.audit
        assert audit is not None
        for a in actions:
            if isinstance(a, Start):
                assert a.key not in self.running and a.key not in audit
                if a.key.attempt > 0:
                    prev = RolloutKey(a.key.group, a.key.sample, a.key.attempt - 1)
                    how = audit[prev]
                    if how.startswith("failed:"):
                        self.expected_resubmits[how.split(":", 1)[1]] += 1
                    elif how.endswith(":stale"):
                        self.expected_resubmits["stale"] += 1
                    else:  # a surplus sample revived after a stale discard
                        assert how in CANCELLING, how
                self.running[a.key] = a.task
                self.started.append(a.key)
            else:
                assert a.key in self.running, f"cancel of {a.key} which is not running"
                del self.running[a.key]

    def collect(self) -> None:
        self.resubmitted += self.adm.resubmitted
        self.cancelled += self.adm.cancelled
        self.abandoned += self.adm.abandoned
        self.stale_rollouts += len(self.adm.dropped_rollouts)
        self.adm.reset_counts()

    # ------------------------------------------------------------------ rules

    @precondition(lambda self: not self.closed and self.adm.registered < 4)
    @rule(n=st.integers(1, 3))
    def register(self, n: int) -> None:
        self.adm.register([Task(f"t{i}") for i in range(n)], handle=object())

    @precondition(lambda self: not self.closed and not self.pending and self.adm.registered > 0)
    @rule()
    def call(self) -> None:
        if self.adm.served is None or self.updates - self.adm.served >= self.sync_every:
            self.adm.pushed(self.updates)
        self.apply(self.adm.call(self.updates, self.now))
        self.pending = True

    @precondition(lambda self: not self.closed and self.running)
    @rule(data=st.data(), n=st.integers(1, 8), dt=st.floats(0, 1))
    def finish(self, data: st.DataObject, n: int, dt: float) -> None:
        """Up to ``n`` running rollouts finish, each with a random status and version."""
        self.now += dt
        for _ in range(n):
            if not self.running:
                return
            key = data.draw(st.sampled_from(sorted(self.running)))
            status = data.draw(st.sampled_from(list(Status)))
            reward = data.draw(st.one_of(st.none(), st.floats(0, 1)))
            back = data.draw(st.integers(0, 5))
            served = self.adm.served or 0
            if status in (Status.COMPLETED, Status.AGENT_ERROR) and reward is None:
                reward = 0.5
            del self.running[key]
            self.finished.add(key)
            r = make_rollout(key, status, max(0, served - back), reward)
            self.apply(self.adm.finished(key, r, self.now))
            # The same result again (a duplicate callback) changes nothing.
            assert self.adm.finished(key, r, self.now) == []

    @precondition(lambda self: self.closed)
    @rule()
    def after_close(self) -> None:
        for step in (lambda: self.adm.register([Task("x")]), lambda: self.adm.call(0, self.now)):
            try:
                step()
            except RuntimeError as exc:
                assert "closed" in str(exc)
            else:
                raise AssertionError("a closed state machine accepted work")

    @precondition(lambda self: self.started)
    @rule(data=st.data())
    def late_result(self, data: st.DataObject) -> None:
        """A superseded attempt or a cancelled rollout reporting late is ignored."""
        key = data.draw(st.sampled_from(self.started))
        if key in self.running:
            return
        r = make_rollout(key, Status.COMPLETED, self.adm.served or 0, 1.0)
        assert self.adm.finished(key, r, self.now) == []

    @precondition(lambda self: not self.closed)
    @rule(dt=st.floats(0, 3))
    def clock(self, dt: float) -> None:
        self.now += dt
        self.apply(self.adm.expire(self.now))

    @precondition(lambda self: not self.closed and self.pending)
    @rule()
    def consume(self) -> None:
        out, actions = self.adm.consume(self.updates, self.now)
        self.apply(actions)
        if out is None:
            return
        for group in out.groups:
            assert len(group) == self.adm.config.groups
            gid = group[0].key.group
            assert gid not in self.packed_groups, "a group was handed over twice"
            assert gid not in self.abandoned_groups
            assert len({r.key.sample for r in group}) == len(group)
            for r in group:
                assert r.key.group == gid
                assert self.updates - r.oldest_version <= self.adm.config.max_lag
                # Only what may be trained on is handed over: a finished rollout with its
                # reward, or a truncated one the truncation policy admits.
                assert r.status not in (Status.INFRA_ERROR, Status.CANCELLED), r
                if r.status in (Status.COMPLETED, Status.AGENT_ERROR):
                    assert r.reward is not None, r
                if r.status is Status.TRUNCATED:
                    policy = truncation_policy(self.adm.config.truncation)
                    assert policy(r).resubmit is None, r
                assert self.adm.audit is not None and self.adm.audit[r.key] == "consumed"
            self.packed_groups.add(gid)
        self.collect()
        self.pending = False
        self.updates += 1

    @precondition(lambda self: not self.closed)
    @rule(dice=st.integers(0, 5))
    def reopen(self, dice: int) -> None:
        if dice:  # rarer than the other rules, so runs get far enough to consume
            return
        self.apply(self.adm.reopen())
        self.pending = False
        assert not self.running

    @precondition(lambda self: not self.closed)
    @rule(dice=st.integers(0, 9))
    def close(self, dice: int) -> None:
        if dice:
            return
        self.apply(self.adm.close())
        self.collect()
        self.closed = True
        assert not self.running

    # ------------------------------------------------------------------ invariants

    def check_group(self, g: Any) -> None:
        # A group has groups + oversample samples, so min(needed + oversample, startable)
        # is every sample neither admitted nor out of attempts: a running group runs all
        # of them and can still complete; a resolved group runs none.
        need = self.adm.config.groups
        states = Counter(s.state.name for s in g.samples)
        if g.state.name == "RUNNING":
            assert states["IDLE"] == states["SURPLUS"] == 0, states
            assert states["ADMITTED"] == len(g.admitted) < need, (states, g.admitted)
            assert len(g.samples) - states["EXHAUSTED"] >= need, states
        else:
            assert states["RUNNING"] == 0, (g.state, states)
        if g.state.name == "COMPLETE":
            assert states["ADMITTED"] == len(g.admitted) == need, (states, g.admitted)

    @invariant()
    def bookkeeping(self) -> None:
        if not hasattr(self, "adm"):
            return
        audit = self.adm.audit
        assert audit is not None
        assert set(self.running) == set(self.adm._running)
        held = {
            s.rollout.key
            for b in self.adm._batches
            for g in b.groups
            for s in g.samples
            if s.rollout is not None
        }
        for key in self.started:
            # Exactly one of: running, finished and held for consumption, or ended once
            # (the audit itself refuses a second end).
            places = (key in self.running) + (key in held) + (key in audit)
            assert places == 1, (key, key in self.running, key in held, audit.get(key))
            if key in held:
                assert key in self.finished
        for batch in self.adm._batches:
            # The per-batch counts ready() trusts equal a recount of the groups.
            states = [g.state.name for g in batch.groups]
            assert batch.running == states.count("RUNNING"), (batch.running, states)
            assert batch.complete == states.count("COMPLETE"), (batch.complete, states)
            for g in batch.groups:
                for s in g.samples:
                    assert s.failures <= self.adm.config.max_attempts
                self.check_group(g)
                if g.state.name == "ABANDONED":
                    self.abandoned_groups.add(g.gid)
        # Record counts add up with what the ledger saw.
        total_cancelled = self.cancelled + self.adm.cancelled
        assert total_cancelled == sum(h in CANCELLING for h in audit.values())
        assert self.resubmitted + self.adm.resubmitted == self.expected_resubmits
        assert self.abandoned + self.adm.abandoned == len(self.abandoned_groups)
        stale = self.stale_rollouts + len(self.adm.dropped_rollouts)
        assert stale == sum(h == "resubmitted:stale" for h in audit.values())
        assert all(why == "stale" for why, _ in self.adm.dropped_rollouts)


TestAdmission = AdmissionMachine.TestCase
TestAdmission.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)


def test_a_call_under_a_push_still_in_progress_is_not_from_the_future() -> None:
    # A fleet member can finish a call under the new weights before load() returns on
    # the trainer: between pushing(v) and pushed(v) calls up to v are admitted.
    import pytest

    adm = Admission(SchedulerConfig(groups=1, ahead=0, max_lag=1, estimator=raw_reward))
    adm.pushed(0)
    adm.register([Task("t")])
    starts = [a for a in adm.call(0, 0.0) if isinstance(a, Start)]
    adm.pushing(1)
    (start,) = starts
    adm.finished(start.key, make_rollout(start.key, Status.COMPLETED, 1, 1.0), 1.0)
    consumed, _ = adm.consume(1, 2.0)
    assert consumed is not None and consumed.groups[0][0].calls[0].version == 1
    adm.register([Task("u")])
    (later,) = [a for a in adm.call(1, 3.0) if isinstance(a, Start)]
    with pytest.raises(ValueError, match=r"version=2 is from the future .*version 1 at most"):
        adm.finished(later.key, make_rollout(later.key, Status.COMPLETED, 2, 1.0), 4.0)
