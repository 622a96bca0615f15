"""SchedulerConfig (the knobs, validated once), SchedulerHooks and the scheduler's seams."""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

import numpy as np
import pytest

from dew.data import Prefetch
from dew.objectives.rl import scheduler as scheduler_module
from dew.objectives.rl.config import SchedulerConfig, SchedulerHooks, check_shape
from dew.objectives.rl.scheduler import RolloutScheduler, SchedulerRecord

from .conftest import RecordingPublisher, ScriptedSource, task_dataset

pytestmark = pytest.mark.timeout(60)


class _Objective:
    """packed_log_probs of zeros: these tests never train."""

    def packed_log_probs(self, model: Any, batch: Any) -> Any:
        import torch

        return torch.zeros(np.asarray(batch["tokens"]).shape)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"groups": 0}, "groups=0: must be an int >= 1"),
        ({"groups": 2.0}, "groups=2.0: must be an int >= 1"),
        ({"groups": True}, "groups=True: must be an int >= 1"),
        ({"oversample": -1}, "oversample=-1: must be an int >= 0"),
        ({"admit": 0}, "admit=0: must be None or an int >= 1"),
        ({"max_lag": -1}, "max_lag=-1: must be an int >= 0"),
        ({"ahead": -1}, "ahead=-1: must be an int >= 0"),
        ({"sync_every": 0}, "sync_every=0: must be an int >= 1"),
        ({"max_attempts": 0}, "max_attempts=0: must be an int >= 1"),
        ({"timeout": 0}, "timeout=0: must be None or > 0 seconds"),
        ({"timeout": "1"}, "timeout='1': must be None or > 0 seconds"),
        ({"estimator": "ppo"}, "estimator='ppo'"),
        ({"truncation": "drop"}, "truncation='drop'"),
        ({"support_capacity": 0}, "support_capacity=0: must be None or an int >= 1"),
        ({"max_lag": 0}, "max_lag=0 < ahead + sync_every - 1 = 1"),
        ({"ahead": 2, "sync_every": 2, "max_lag": 2}, "max_lag=2 < ahead + sync_every - 1 = 3"),
    ],
)
def test_each_knob_is_refused_with_its_name_value_and_rule(
    kw: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SchedulerConfig(**kw)


def test_shape_is_checked_by_the_same_rules() -> None:
    check_shape(width=8, rows=1)
    with pytest.raises(ValueError, match=re.escape("width=0: must be an int >= 1")):
        check_shape(width=0, rows=1)
    with pytest.raises(ValueError, match=re.escape("rows=1.5: must be an int >= 1")):
        check_shape(width=8, rows=1.5)


def test_defaults_are_the_reference_pages_and_written_once() -> None:
    config = SchedulerConfig()
    assert dataclasses.asdict(config) == {
        "groups": 4,
        "oversample": 0,
        "admit": None,
        "max_lag": 1,
        "ahead": 1,
        "sync_every": 1,
        "max_attempts": 3,
        "timeout": None,
        "estimator": "group",
        "truncation": "mask",
        "support_capacity": None,
    }
    sig = inspect.signature(RolloutScheduler)
    for f in dataclasses.fields(SchedulerConfig):
        assert sig.parameters[f.name].default == getattr(config, f.name), f.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.ahead = 2  # type: ignore[misc]


def test_tight_fills_the_smallest_max_lag() -> None:
    assert SchedulerConfig.tight().max_lag == 1
    assert SchedulerConfig.tight(ahead=0).max_lag == 0
    assert SchedulerConfig.tight(ahead=2, oversample=1).max_lag == 2
    tight = SchedulerConfig.tight(ahead=2, sync_every=3)
    assert tight.max_lag == 4 == tight.lag_floor
    assert tight == SchedulerConfig(ahead=2, sync_every=3, max_lag=4)
    with pytest.raises(TypeError, match="max_lag"):
        SchedulerConfig.tight(max_lag=3)
    with pytest.raises(ValueError, match=re.escape("ahead='x': must be an int >= 0")):
        SchedulerConfig.tight(ahead="x")


def test_name_labels_the_knobs_that_shape_throughput() -> None:
    assert SchedulerConfig.tight(ahead=0).name == "sync"
    assert SchedulerConfig().name == "ahead 1"
    assert SchedulerConfig.tight(ahead=1, oversample=2).name == "ahead 1 + oversample 2"
    assert SchedulerConfig(admit=3, max_lag=2).name == "ahead 1 + admit 3 + max_lag 2"
    assert SchedulerConfig.tight(sync_every=2).name == "ahead 1 + sync_every 2"


# ---------------------------------------------------------------- the scheduler's seams


@pytest.fixture
def made() -> Any:
    out: list[RolloutScheduler] = []
    yield out
    for s in out:
        s.close()


def test_non_default_knobs_take_effect(source: ScriptedSource, publisher, made) -> None:
    config = SchedulerConfig(groups=2, oversample=1, ahead=0, max_lag=0, timeout=5.0)
    s = RolloutScheduler.from_config(_Objective(), source, publisher, config, width=16, rows=2)
    made.append(s)
    assert s.config == config and s.ahead == 0
    built = RolloutScheduler(
        _Objective(), source, publisher, width=16, rows=2, groups=3, sync_every=2, max_lag=2
    )
    made.append(built)
    assert built.config == SchedulerConfig(groups=3, sync_every=2, max_lag=2)
    stream = Prefetch(s.tasks(task_dataset(batch_size=1)).stream(), depth=0)
    batch = next(stream)
    # groups + oversample samples start for the one task, and nothing ahead (ahead=0).
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(s, None, batch, updates=0)
        source.wait_started(3)
        assert len(source.sessions) == 3
        source.finish_all()
        fut.result(10)
    for name in ("groups", "oversample", "max_lag", "timeout", "estimator", "width", "rows"):
        assert not hasattr(s, name), name  # the knobs are read from s.config only
    with pytest.raises(TypeError, match="SchedulerConfig"):
        RolloutScheduler.from_config(_Objective(), source, publisher, {}, width=16, rows=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("rows=0")):
        RolloutScheduler.from_config(_Objective(), source, publisher, config, width=16, rows=0)
    with pytest.raises(TypeError, match="ahead come from config"):
        RolloutScheduler.from_config(
            _Objective(), source, publisher, config, width=16, rows=2, ahead=1
        )


def test_hooks_wrap_the_publisher_and_are_refused_once_the_stream_opened(
    source: ScriptedSource, publisher: RecordingPublisher, made
) -> None:
    s = RolloutScheduler(_Objective(), source, publisher, width=16, rows=2, groups=2)
    made.append(s)
    assert s.hooks == SchedulerHooks() and s.weights is publisher

    class Wrapped:
        def __init__(self, inner: RecordingPublisher) -> None:
            self.inner = inner

        def load(self, variables: Any, version: int) -> None:
            self.inner.load(variables, version)

    hooks = SchedulerHooks(publisher=Wrapped)
    s.connect(hooks)
    s.connect(hooks)  # before the stream opens: replaces, never wraps twice
    assert isinstance(s.weights, Wrapped) and s.weights.inner is publisher
    assert s.hooks is hooks
    s.tasks(task_dataset()).stream()  # opening the stream fixes the hooks
    with pytest.raises(RuntimeError, match="already opened"):
        s.connect(SchedulerHooks())
    with pytest.raises(ValueError, match="needs a share hook"):
        SchedulerHooks(samples=False)


def test_a_later_reader_starts_nothing_and_trains_on_the_shared_rows(
    source: ScriptedSource, publisher: RecordingPublisher, made
) -> None:
    shared = {"tokens": np.zeros((2, 16), dtype=np.int64)}
    agreed: list[BaseException | None] = []
    hooks = SchedulerHooks(agree=agreed.append, share=lambda b: dict(shared), samples=False)
    s = RolloutScheduler.from_config(
        _Objective(), source, publisher, SchedulerConfig(), width=16, rows=2, hooks=hooks
    )
    made.append(s)
    stream = Prefetch(s.tasks(task_dataset()).stream(), depth=1)
    out = s(None, next(stream), updates=0)
    np.testing.assert_array_equal(out["tokens"], shared["tokens"])
    assert out["proximal_log_probs"].shape == (2, 16)
    assert agreed == [None] and source.sessions == {} and len(s.history) == 0
    assert publisher.loads == [0]


def test_history_is_read_only_and_restored_through_a_method(
    source: ScriptedSource, publisher: RecordingPublisher, made
) -> None:
    s = RolloutScheduler(_Objective(), source, publisher, width=16, rows=2)
    made.append(s)
    assert len(s.history) == 0 and list(s.history) == []
    records = [SchedulerRecord(u, u, 0, 1, {}, 0, 0, 0, 0.0, {}) for u in range(3)]
    s.restore_history(records)
    assert list(s.history) == records and s.history[-1] is records[-1]
    assert list(s.history[1:]) == records[1:]
    assert not hasattr(s.history, "append") and not hasattr(s.history, "clear")
    records.append(records[0])  # the caller's list is not the history
    assert len(s.history) == 3
    s.restore_history(records[:1])  # a second resume replaces it
    assert list(s.history) == records[:1]
    with pytest.raises(TypeError, match="SchedulerRecord"):
        s.restore_history([{"updates": 0}])  # type: ignore[list-item]
    assert list(s.history) == records[:1]


def test_the_scheduler_is_the_trainer_rollout_fit_reads_and_restores_from_step_records(
    source: ScriptedSource, publisher: RecordingPublisher, made
) -> None:
    from dew.train import TrainerRollout

    s = RolloutScheduler(_Objective(), source, publisher, width=16, rows=2)
    made.append(s)
    assert isinstance(s, TrainerRollout)
    kept = [SchedulerRecord(u, u, 0, 1, {"stale": u}, 0, 0, 0, 0.5, {}) for u in range(2)]
    steps = [{"step": 1, "scheduler": dataclasses.asdict(kept[0])}, {"step": 2}]
    steps.append({"step": 3, "scheduler": dataclasses.asdict(kept[1])})
    s.restore(steps)  # fit's step records: only those with a scheduler record count
    assert list(s.history) == kept


def test_scheduler_module_keeps_only_the_reference_names() -> None:
    assert set(scheduler_module.__all__) == {
        "Publisher",
        "RolloutScheduler",
        "SchedulerRecord",
        "task_ids",
    }


def _halves(rewards: np.ndarray, trained: np.ndarray) -> np.ndarray:
    return np.where(trained, rewards / 2, 0.0)


def _keep_as_is(rollout: Any) -> Any:
    from dew.objectives.rl.truncation import truncation_policy

    return truncation_policy("score")(rollout)


def test_estimator_and_truncation_take_a_function_or_a_name() -> None:
    config = SchedulerConfig(estimator=_halves, truncation=_keep_as_is)
    assert config.estimator is _halves and config.truncation is _keep_as_is
    assert SchedulerConfig(estimator="rloo", truncation="zero").estimator == "rloo"
    with pytest.raises(ValueError, match=re.escape("estimator=42")):
        SchedulerConfig(estimator=42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("truncation=None")):
        SchedulerConfig(truncation=None)  # type: ignore[arg-type]


def test_integral_numpy_scalars_are_ints_floats_and_bools_are_not() -> None:
    import numpy as np

    config = SchedulerConfig(groups=np.int64(4), ahead=np.int32(1), max_lag=np.int64(2))
    assert (config.groups, config.ahead, config.max_lag) == (4, 1, 2)
    assert all(type(v) is int for v in (config.groups, config.ahead, config.max_lag))
    assert check_shape(width=np.int64(16), rows=np.uint8(8)) == (16, 8)
    for name, value in (("groups", True), ("groups", 4.0), ("ahead", np.float64(1.0))):
        with pytest.raises(ValueError, match=f"{name}="):
            SchedulerConfig(**{name: value})
    with pytest.raises(ValueError, match=r"width=16\.0: must be an int >= 1"):
        check_shape(width=16.0, rows=8)
    with pytest.raises(ValueError, match="timeout='5': must be None or > 0 seconds"):
        SchedulerConfig(timeout="5")  # type: ignore[arg-type]


def test_a_group_of_one_is_refused_where_it_can_learn_nothing() -> None:
    for estimator in ("group", "group_std", "rloo"):
        with pytest.raises(ValueError, match=r"groups=1: estimator .* a group of one always"):
            SchedulerConfig(groups=1, estimator=estimator)
    # A function of the user's own may make sense of one rollout: accepted.
    assert SchedulerConfig(groups=1, estimator=lambda r, t: r).groups == 1
