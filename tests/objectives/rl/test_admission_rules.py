"""Each rule of the admission state machine, driven event by event.

The hypothesis machine in ``test_admission_state.py`` checks invariants over random
interleavings; these tests pin the exact outcome of one rule at a time (which attempt
starts, which is cancelled, what is counted and handed over), at its boundaries.
"""

from __future__ import annotations

from typing import Any

import pytest

from dew.core import Call, Rollout, RolloutKey, Status, Task
from dew.objectives.rl.admission import Admission, Cancel, Start
from dew.objectives.rl.config import SchedulerConfig

Action = Start | Cancel


def raw_reward(rewards: Any, trained: Any) -> Any:
    return rewards


def admission(**knobs: Any) -> Admission:
    """An audited state machine; a function estimator allows groups of one."""
    knobs.setdefault("groups", 1)
    knobs.setdefault("ahead", 0)
    knobs.setdefault("max_lag", knobs["ahead"])
    adm = Admission(SchedulerConfig(estimator=raw_reward, **knobs))
    adm.audit = {}
    return adm


def rollout(
    key: RolloutKey,
    status: Status = Status.COMPLETED,
    *,
    versions: tuple[int, ...] = (0,),
    reward: float | None = 1.0,
    error: str | None = None,
) -> Rollout:
    calls = [Call(prompt=[1], completion=[2], log_probs=[-0.5], version=v) for v in versions]
    scored = status in (Status.COMPLETED, Status.AGENT_ERROR, Status.TRUNCATED)
    return Rollout(
        key=key,
        task=Task(str(key.group)),
        status=status,
        calls=calls if scored else [],
        reward=reward,
        truncation="length" if status is Status.TRUNCATED else None,
        error=error,
    )


def starts(actions: list[Action]) -> list[RolloutKey]:
    return [a.key for a in actions if isinstance(a, Start)]


def cancels(actions: list[Action]) -> list[RolloutKey]:
    return [a.key for a in actions if isinstance(a, Cancel)]


def K(group: int, sample: int, attempt: int = 0) -> RolloutKey:
    return RolloutKey(group, sample, attempt)


def finish(
    adm: Admission, key: RolloutKey, status: Status = Status.COMPLETED, now: float = 1.0, **kw: Any
) -> list[Action]:
    return adm.finished(key, rollout(key, status, **kw), now)


# ---------------------------------------------------------------- batches and calls


def test_register_numbers_batches_and_oldest_is_the_first_handle() -> None:
    adm = admission()
    assert adm.oldest() is None and adm.registered == 0
    assert adm.register([Task("a")], handle="h0") == 0
    assert adm.register([Task("b")], handle="h1") == 1
    assert adm.registered == 2 and adm.oldest() == "h0"
    adm.call(0, 0.0)
    finish(adm, K(0, 0))
    consumed, _ = adm.consume(0, 1.0)
    assert consumed is not None
    # The consumed batch is forgotten; the next one is now the oldest.
    assert adm.registered == 1 and adm.oldest() == "h1"


def test_call_without_a_registered_batch_is_refused() -> None:
    with pytest.raises(RuntimeError, match=r"^no registered batch: read the batch from"):
        admission().call(0, 0.0)


def test_call_submits_the_handed_batch_and_ahead_more_each_once() -> None:
    adm = admission(groups=2, oversample=1, ahead=1)
    for name in "abc":
        adm.register([Task(name), Task(name.upper())])
    actions = adm.call(0, 0.0)
    # Batches 0 and 1 (ahead=1): two tasks each, groups + oversample = 3 samples each.
    assert [a.task.id for a in actions if isinstance(a, Start)] == list("aaaAAAbbbBBB")
    assert starts(actions) == [K(g, s) for g in range(4) for s in range(3)]
    assert adm.in_flight == 12
    # A second call re-submits nothing: both batches are already running.
    assert adm.call(0, 0.0) == []


def test_a_closed_machine_refuses_work_and_reports_why() -> None:
    adm = admission()
    adm.register([Task("a")])
    (key,) = starts(adm.call(0, 0.0))
    assert cancels(adm.close()) == [key]
    assert adm.closed and adm.audit == {key: "closed"} and adm.in_flight == 0
    assert adm.registered == 0
    with pytest.raises(RuntimeError, match=r"^the scheduler is closed$"):
        adm.register([Task("b")])
    with pytest.raises(RuntimeError, match=r"^the scheduler is closed$"):
        adm.call(0, 0.0)


def test_reopen_cancels_everything_and_forgets_the_served_version() -> None:
    adm = admission(groups=2, timeout=5.0)
    adm.pushing(3)
    adm.pushed(3)
    adm.register([Task("a")])
    keys = starts(adm.call(3, 0.0))
    finish(adm, keys[0], versions=(3,))
    assert cancels(adm.reopen()) == [keys[1]]
    # The admitted rollout of the forgotten batch is discarded, the running one cancelled.
    assert adm.audit == {keys[0]: "discarded", keys[1]: "reopened"}
    assert adm.served is None and adm.pushing_version is None
    assert adm.registered == 0 and adm.in_flight == 0 and adm.next_deadline() is None
    assert adm.closed is False
    # After a resume the engines may serve anything: no bound until the next push.
    adm.register([Task("b")])
    adm.call(0, 0.0)
    assert finish(adm, K(1, 0), versions=(7,)) == []


# ---------------------------------------------------------------- finishing


def test_a_finish_for_an_unknown_or_superseded_attempt_is_ignored() -> None:
    adm = admission(max_attempts=2)
    adm.register([Task("a")])
    adm.call(0, 0.0)
    assert finish(adm, K(0, 0, 5)) == []
    assert starts(finish(adm, K(0, 0), Status.INFRA_ERROR)) == [K(0, 0, 1)]
    # The failed attempt reporting again is not the current one.
    assert finish(adm, K(0, 0, 0)) == []
    assert adm.in_flight == 1


def test_a_rollout_labelled_with_another_key_is_refused() -> None:
    adm = admission()
    adm.register([Task("a")])
    adm.call(0, 0.0)
    wrong = rollout(K(0, 0, 1))
    with pytest.raises(ValueError, match=r"group=0, sample=0, attempt=0\): the source returned"):
        adm.finished(K(0, 0), wrong, 1.0)


@pytest.mark.parametrize("status", [Status.COMPLETED, Status.AGENT_ERROR])
def test_a_scored_status_without_a_reward_is_refused(status: Status) -> None:
    adm = admission()
    adm.register([Task("a")])
    adm.call(0, 0.0)
    with pytest.raises(ValueError, match=rf"status {status.name} needs a reward from the verifier"):
        finish(adm, K(0, 0), status, reward=None)
    # The refused result changed nothing: the attempt is still running.
    assert adm.in_flight == 1


def test_the_future_check_names_the_call_and_allows_the_newest_version() -> None:
    adm = admission(ahead=1, max_lag=1, groups=2)
    adm.pushed(2)
    adm.register([Task("a")])
    adm.call(2, 0.0)
    # A call at exactly the served version is fine.
    assert finish(adm, K(0, 0), versions=(1, 2)) == []
    with pytest.raises(ValueError, match=r"calls\[1\]\.version=3 is from the future"):
        finish(adm, K(0, 1), versions=(2, 3))


def test_an_older_announced_push_does_not_lower_the_bound() -> None:
    # pushing() was announced for version 1 only; version 2 is then served without an
    # announcement (as the planner serves every version): the bound is 2, not the stale 1.
    adm = admission()
    adm.pushing(1)
    adm.pushed(1)
    adm.pushed(2)
    adm.register([Task("a")])
    adm.call(2, 0.0)
    assert starts(finish(adm, K(0, 0), versions=(2,))) == []
    consumed, _ = adm.consume(2, 1.0)
    assert consumed is not None and len(consumed.groups) == 1


def test_a_push_under_way_is_the_bound_before_any_version_is_served() -> None:
    adm = admission(groups=3, max_lag=5)
    adm.register([Task("a")])
    adm.call(0, 0.0)
    # Nothing served, nothing announced: no bound at all.
    assert finish(adm, K(0, 0), versions=(4,)) == []
    adm.pushing(1)
    assert finish(adm, K(0, 1), versions=(1,)) == []
    with pytest.raises(ValueError, match=r"version=2 is from the future .*version 1 at most"):
        finish(adm, K(0, 2), versions=(2,))


def test_a_group_completes_at_its_groups_th_finish_and_cancels_the_surplus() -> None:
    adm = admission(groups=2, oversample=2)
    adm.register([Task("a")])
    assert len(starts(adm.call(0, 0.0))) == 4
    assert finish(adm, K(0, 3)) == []
    assert not adm.ready()
    actions = finish(adm, K(0, 1))
    assert actions == [Cancel(K(0, 0)), Cancel(K(0, 2))]
    assert adm.cancelled == 2 and adm.ready()
    assert adm.audit == {K(0, 0): "surplus", K(0, 2): "surplus"}
    consumed, _ = adm.consume(0, 2.0)
    assert consumed is not None
    # Members in finish order.
    assert [[r.key for r in g] for g in consumed.groups] == [[K(0, 3), K(0, 1)]]
    assert adm.audit[K(0, 3)] == adm.audit[K(0, 1)] == "consumed"


# ---------------------------------------------------------------- failures


@pytest.mark.parametrize(
    ("status", "reward", "truncation", "cause"),
    [
        (Status.INFRA_ERROR, None, "mask", "infra_error"),
        (Status.CANCELLED, None, "mask", "cancelled"),
        (Status.TRUNCATED, None, "score", "unscored"),
    ],
)
def test_a_failed_attempt_is_resubmitted_with_its_cause(
    status: Status, reward: float | None, truncation: str, cause: str
) -> None:
    adm = admission(max_attempts=2, truncation=truncation)
    adm.register([Task("a")])
    adm.call(0, 0.0)
    actions = finish(adm, K(0, 0), status, reward=reward, error="boom")
    assert actions == [Start(Task("a"), K(0, 0, 1))]
    assert adm.audit == {K(0, 0): f"failed:{cause}"}
    assert adm.resubmitted == {cause: 1} and adm.cancelled == 0
    finish(adm, K(0, 0, 1))
    consumed, _ = adm.consume(0, 2.0)
    assert consumed is not None
    assert consumed.errors == [f"rollout(group=0, sample=0, attempt=0): {cause}: boom"]
    assert [[r.key for r in g] for g in consumed.groups] == [[K(0, 0, 1)]]


@pytest.mark.parametrize("truncation", ["mask", "zero"])
def test_a_truncation_the_policy_trains_on_is_admitted(truncation: str) -> None:
    adm = admission(truncation=truncation)
    adm.register([Task("a")])
    adm.call(0, 0.0)
    assert finish(adm, K(0, 0), Status.TRUNCATED, reward=None) == []
    consumed, _ = adm.consume(0, 1.0)
    assert consumed is not None and consumed.groups[0][0].status is Status.TRUNCATED
    assert consumed.errors == [] and adm.resubmitted == {}


def test_a_sample_fails_max_attempts_times_then_its_group_is_abandoned() -> None:
    adm = admission(groups=1, oversample=0, max_attempts=3)
    adm.register([Task("a"), Task("b")])
    adm.call(0, 0.0)
    assert starts(finish(adm, K(0, 0), Status.INFRA_ERROR)) == [K(0, 0, 1)]
    assert starts(finish(adm, K(0, 0, 1), Status.CANCELLED)) == [K(0, 0, 2)]
    assert adm.abandoned == 0
    # The third failure is the last one allowed: nothing more starts.
    assert finish(adm, K(0, 0, 2), Status.INFRA_ERROR, error="down") == []
    assert adm.abandoned == 1 and adm.cancelled == 0
    assert adm.resubmitted == {"infra_error": 1, "cancelled": 1}
    assert not adm.ready()
    finish(adm, K(1, 0))
    consumed, _ = adm.consume(0, 2.0)
    assert consumed is not None
    assert consumed.abandoned == [Task("a")] and consumed.dropped == []
    assert [[r.key for r in g] for g in consumed.groups] == [[K(1, 0)]]
    assert consumed.errors == [
        "rollout(group=0, sample=0, attempt=0): infra_error",
        "rollout(group=0, sample=0, attempt=1): cancelled",
        "rollout(group=0, sample=0, attempt=2): infra_error: down",
    ]


def test_a_group_keeps_going_while_enough_samples_are_alive() -> None:
    adm = admission(groups=2, oversample=1, max_attempts=1)
    adm.register([Task("a")])
    adm.call(0, 0.0)
    # One sample out of attempts leaves exactly groups alive: not abandoned, and nothing
    # is left to start.
    assert finish(adm, K(0, 0), Status.INFRA_ERROR) == []
    assert adm.abandoned == 0
    # A second one leaves fewer than groups: abandoned, the last one cancelled, the
    # admitted one discarded.
    finish(adm, K(0, 1))
    assert finish(adm, K(0, 2), Status.CANCELLED) == []
    assert adm.abandoned == 1
    assert adm.audit == {
        K(0, 0): "failed:infra_error",
        K(0, 1): "discarded",
        K(0, 2): "failed:cancelled",
    }


def test_abandoning_cancels_the_running_samples_and_discards_the_admitted() -> None:
    adm = admission(groups=3, oversample=0, max_attempts=1)
    adm.register([Task("a")])
    adm.call(0, 0.0)
    finish(adm, K(0, 0))
    actions = finish(adm, K(0, 1), Status.INFRA_ERROR)
    assert actions == [Cancel(K(0, 2))]
    assert adm.abandoned == 1 and adm.cancelled == 1
    assert adm.audit == {K(0, 1): "failed:infra_error", K(0, 0): "discarded", K(0, 2): "abandoned"}
    assert adm.in_flight == 0 and adm.ready()
    consumed, _ = adm.consume(0, 1.0)
    assert consumed is not None and consumed.groups == [] and consumed.abandoned == [Task("a")]


def test_errors_keep_the_latest_ones_and_are_handed_over_once() -> None:
    adm = admission(max_attempts=100, max_lag=1)
    adm.register([Task("a")])
    adm.register([Task("b")])
    adm.call(0, 0.0)
    for attempt in range(70):
        finish(adm, K(0, 0, attempt), Status.INFRA_ERROR, error=str(attempt))
    finish(adm, K(0, 0, 70))
    consumed, _ = adm.consume(0, 1.0)
    assert consumed is not None
    assert consumed.errors == [  # the latest 64
        f"rollout(group=0, sample=0, attempt={i}): infra_error: {i}" for i in range(6, 70)
    ]
    adm.call(1, 1.0)
    finish(adm, K(1, 0))
    consumed, _ = adm.consume(1, 2.0)
    assert consumed is not None and consumed.errors == []


def test_reset_counts_starts_a_new_window() -> None:
    adm = admission(groups=1, oversample=1, max_attempts=2)
    adm.register([Task("a")])
    adm.call(0, 0.0)
    finish(adm, K(0, 0), Status.INFRA_ERROR)
    finish(adm, K(0, 1))
    assert adm.resubmitted == {"infra_error": 1} and adm.cancelled == 1
    adm.reset_counts()
    assert adm.resubmitted == {} and adm.cancelled == 0 and adm.abandoned == 0
    assert adm.dropped_rollouts == []


# ---------------------------------------------------------------- admit


def test_admit_drops_the_groups_still_running_once_enough_completed() -> None:
    adm = admission(groups=1, oversample=1, admit=2)
    adm.register([Task("a"), Task("b"), Task("c")])
    adm.call(0, 0.0)
    assert finish(adm, K(2, 1)) == [Cancel(K(2, 0))]
    assert not adm.ready()
    finish(adm, K(1, 0, 0), Status.INFRA_ERROR)
    # The second completion reaches admit: group 0 is dropped, all its samples cancelled.
    actions = finish(adm, K(0, 0))
    assert actions == [Cancel(K(0, 1)), Cancel(K(1, 0, 1)), Cancel(K(1, 1))]
    assert adm.ready() and adm.cancelled == 4
    assert adm.audit is not None
    assert adm.audit[K(1, 1)] == adm.audit[K(1, 0, 1)] == "dropped"
    consumed, _ = adm.consume(0, 1.0)
    assert consumed is not None
    assert consumed.dropped == [Task("b")] and consumed.abandoned == []
    # Complete groups in completion order, not group order.
    assert [g[0].key.group for g in consumed.groups] == [2, 0]


def test_admit_discards_what_a_dropped_group_had_admitted() -> None:
    adm = admission(groups=2, admit=1)
    adm.register([Task("a"), Task("b")])
    adm.call(0, 0.0)
    finish(adm, K(1, 0))
    finish(adm, K(0, 0))
    assert finish(adm, K(0, 1)) == [Cancel(K(1, 1))]
    assert adm.audit is not None and adm.audit[K(1, 0)] == "discarded"


def test_without_admit_a_batch_waits_for_every_group() -> None:
    adm = admission(groups=1)
    adm.register([Task("a"), Task("b"), Task("c")])
    adm.call(0, 0.0)
    finish(adm, K(0, 0))
    finish(adm, K(2, 0))
    assert not adm.ready()
    assert adm.consume(0, 1.0) == (None, [])
    finish(adm, K(1, 0))
    assert adm.ready()


def test_a_registered_batch_not_yet_submitted_is_not_ready() -> None:
    adm = admission(admit=1)
    adm.register([Task("a")])
    assert not adm.ready()


# ---------------------------------------------------------------- staleness


def test_a_running_sample_past_max_lag_is_cancelled_and_resubmitted_at_the_call() -> None:
    adm = admission(groups=1, ahead=1, max_lag=1)
    adm.pushed(0)
    for name in "abc":
        adm.register([Task(name)])
    assert starts(adm.call(0, 0.0)) == [K(0, 0), K(1, 0)]
    finish(adm, K(0, 0))
    assert adm.consume(0, 1.0)[0] is not None
    adm.pushed(1)
    # At updates 1 the oldest fresh version is 0: b's version-0 attempt is still fresh.
    assert adm.call(1, 1.0) == [Start(Task("c"), K(2, 0))]
    adm.pushed(2)
    # At updates 2 it is 1: b's attempt restarts under version 2; c's (version 1) is kept.
    # (The call sweeps every live batch, not only the one handed over.)
    assert adm.call(2, 2.0) == [Cancel(K(1, 0)), Start(Task("b"), K(1, 0, 1))]
    assert adm.resubmitted == {"stale": 1} and adm.cancelled == 1
    assert adm.audit == {K(0, 0): "consumed", K(1, 0): "cancelled:stale"}
    assert finish(adm, K(1, 0, 1), versions=(2,)) == []
    consumed, actions = adm.consume(2, 3.0)
    assert actions == [] and consumed is not None
    assert consumed.groups[0][0].key == K(1, 0, 1)


def test_before_any_push_submissions_count_as_version_0() -> None:
    adm = admission(groups=1, ahead=0, max_lag=0)
    adm.register([Task("a")])
    adm.call(0, 0.0)
    assert adm.call(0, 0.0) == []
    assert cancels(adm.call(1, 1.0)) == [K(0, 0)]


def test_an_admitted_rollout_past_max_lag_is_discarded_at_consumption() -> None:
    adm = admission(groups=2, oversample=1, ahead=0, max_lag=1)
    adm.pushed(0)
    adm.register([Task("a")])
    adm.call(0, 0.0)
    adm.pushed(2)
    old = rollout(K(0, 0), versions=(2, 0))
    adm.finished(K(0, 0), old, 1.0)
    finish(adm, K(0, 2), versions=(1,))
    assert adm.ready()
    # At updates 2 the oldest fresh version is 1: the rollout with a version-0 call is
    # discarded; the group runs again: the stale sample and the revived surplus one.
    consumed, actions = adm.consume(2, 3.0)
    assert consumed is None
    assert actions == [Start(Task("a"), K(0, 0, 1)), Start(Task("a"), K(0, 1, 1))]
    assert adm.dropped_rollouts == [("stale", old)]
    assert adm.resubmitted == {"stale": 1}
    assert adm.audit == {K(0, 1): "surplus", K(0, 0): "resubmitted:stale"}
    assert not adm.ready()
    assert finish(adm, K(0, 1, 1), versions=(2,)) == [Cancel(K(0, 0, 1))]
    consumed, actions = adm.consume(2, 4.0)
    assert consumed is not None and actions == []
    assert [[r.key for r in g] for g in consumed.groups] == [[K(0, 2), K(0, 1, 1)]]


def test_an_admitted_rollout_at_exactly_max_lag_is_kept() -> None:
    adm = admission(groups=1, ahead=0, max_lag=1)
    adm.pushed(0)
    adm.register([Task("a")])
    adm.call(0, 0.0)
    finish(adm, K(0, 0), versions=(0,))
    consumed, actions = adm.consume(1, 1.0)
    assert actions == [] and consumed is not None and len(consumed.groups) == 1


def test_a_complete_group_with_a_stale_member_runs_again_at_the_next_call() -> None:
    adm = admission(groups=1, oversample=1, admit=1, max_attempts=1)
    adm.pushed(0)
    adm.register([Task("a"), Task("b")])
    adm.call(0, 0.0)
    finish(adm, K(0, 0), Status.INFRA_ERROR)
    finish(adm, K(0, 1), Status.INFRA_ERROR)  # group 0 abandoned
    assert finish(adm, K(1, 0)) == [Cancel(K(1, 1))]  # group 1 complete: admit reached
    assert adm.ready()
    adm.pushed(5)
    # Group 1's rollout is past the bound: discarded, and the group runs again with its
    # stale sample and its revived surplus one; the abandoned group 0 starts nothing.
    assert starts(adm.call(5, 1.0)) == [K(1, 0, 1), K(1, 1, 1)]
    assert not adm.ready()
    assert adm.resubmitted == {"stale": 1}
    assert [why for why, _ in adm.dropped_rollouts] == ["stale"]
    finish(adm, K(1, 1, 1), versions=(5,))
    consumed, _ = adm.consume(5, 2.0)
    assert consumed is not None and consumed.abandoned == [Task("a")]
    assert [[r.key for r in g] for g in consumed.groups] == [[K(1, 1, 1)]]


def test_a_complete_group_sent_back_by_staleness_counts_as_running_again() -> None:
    # ready() trusts the batch's count of running groups: a group going back from
    # complete to running must add to it, not reset it.
    adm = admission(groups=1, ahead=0, max_lag=0)
    adm.pushed(0)
    adm.register([Task("a"), Task("b"), Task("c")])
    adm.call(0, 0.0)
    finish(adm, K(0, 0))
    adm.pushed(1)
    # Group 0's rollout is stale at updates 1, as are the running attempts of 1 and 2.
    assert starts(adm.call(1, 1.0)) == [K(0, 0, 1), K(1, 0, 1), K(2, 0, 1)]
    assert adm.cancelled == 2 and adm.resubmitted == {"stale": 3}
    finish(adm, K(1, 0, 1), versions=(1,))
    assert not adm.ready()
    finish(adm, K(2, 0, 1), versions=(1,))
    assert not adm.ready()
    finish(adm, K(0, 0, 1), versions=(1,))
    assert adm.ready()


def test_a_stale_rollout_found_at_consume_restarts_under_a_deadline_from_then() -> None:
    adm = admission(groups=1, ahead=0, max_lag=0, timeout=5.0)
    adm.pushed(0)
    adm.register([Task("a")])
    adm.call(0, 0.0)
    finish(adm, K(0, 0), versions=(0,))
    assert adm.ready()
    adm.pushed(1)
    # The consume finds the rollout past the bound: nothing is handed over, the sample
    # restarts, and its deadline counts from the consume's own time.
    consumed, actions = adm.consume(1, 7.0)
    assert consumed is None and starts(actions) == [K(0, 0, 1)]
    assert adm.resubmitted == {"stale": 1} and adm.next_deadline() == 12.0


# ---------------------------------------------------------------- timeouts


def test_deadlines_are_timeout_seconds_after_each_submission() -> None:
    adm = admission(groups=1, oversample=1, timeout=5.0, max_attempts=2)
    assert adm.next_deadline() is None
    adm.register([Task("a")])
    adm.register([Task("b")])
    adm.call(0, 10.0)
    assert adm.next_deadline() == 15.0
    # A finished attempt's deadline no longer counts.
    finish(adm, K(0, 0), now=11.0)
    assert adm.next_deadline() is None
    adm.call(1, 12.0)
    assert adm.next_deadline() == 17.0


def test_expire_fails_attempts_at_their_deadline_and_resubmits_them() -> None:
    adm = admission(groups=2, timeout=5.0, max_attempts=2)
    adm.register([Task("a")])
    adm.call(0, 0.0)
    finish(adm, K(0, 0), Status.INFRA_ERROR, now=1.0)  # resubmitted at 1.0: deadline 6.0
    assert adm.expire(4.9) == []
    actions = adm.expire(5.0)
    assert actions == [Cancel(K(0, 1)), Start(Task("a"), K(0, 1, 1))]
    assert adm.next_deadline() == 6.0
    assert adm.resubmitted == {"infra_error": 1, "timeout": 1}
    assert adm.audit == {K(0, 0): "failed:infra_error", K(0, 1): "failed:timeout"}
    # A deadline passed is counted as a failure, not as a cancel.
    assert adm.cancelled == 0
    finish(adm, K(0, 0, 1), now=5.5)
    finish(adm, K(0, 1, 1), now=5.5)
    consumed, _ = adm.consume(0, 6.0)
    assert consumed is not None
    assert (
        consumed.errors[-1]
        == "rollout(group=0, sample=1, attempt=0): timeout: still running 5 s in"
    )


def test_expire_skips_finished_attempts_and_reaches_the_later_ones() -> None:
    adm = admission(groups=1, timeout=2.5, max_attempts=2)
    adm.register([Task("a"), Task("b")])
    adm.call(0, 0.0)
    adm.register([Task("c")])
    adm.call(0, 0.0)  # nothing new: the batch is already submitted
    finish(adm, K(0, 0))
    actions = adm.expire(3.0)
    assert actions == [Cancel(K(1, 0)), Start(Task("b"), K(1, 0, 1))]
    assert adm.next_deadline() == 5.5


def test_timeouts_that_exhaust_a_group_at_once_abandon_it_without_a_start() -> None:
    adm = admission(groups=2, oversample=1, timeout=1.0, max_attempts=1)
    adm.register([Task("a")])
    adm.call(0, 0.0)
    actions = adm.expire(1.0)
    assert actions == [Cancel(K(0, 0)), Cancel(K(0, 1)), Cancel(K(0, 2))]
    assert adm.abandoned == 1 and adm.cancelled == 0 and adm.in_flight == 0


# ---------------------------------------------------------------- audit


def test_the_audit_refuses_a_second_end_of_one_key() -> None:
    adm = admission()
    adm._end(K(0, 0), "consumed")
    with pytest.raises(AssertionError, match=r"attempt=0\) ended twice: 'consumed' then 'surplus'"):
        adm._end(K(0, 0), "surplus")


def test_without_an_audit_nothing_is_recorded() -> None:
    adm = Admission(SchedulerConfig(groups=1, ahead=0, max_lag=0, estimator=raw_reward))
    assert adm.audit is None
    adm.register([Task("a")])
    adm.call(0, 0.0)
    finish(adm, K(0, 0))
    consumed, _ = adm.consume(0, 1.0)
    assert consumed is not None and adm.audit is None
