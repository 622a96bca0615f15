"""PromptSource with a GroupVerifier, on a real RolloutServer: a group's completions
are scored in one call once none of the group is still generating; the gathering's
bookkeeping keeps its invariants under any order of events."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dew.core import Call, RolloutKey, SamplingParams, Status, Task
from dew.demo.model import make_model
from dew.objectives.rl.sources import GroupVerifier, PromptSource
from dew.objectives.rl.sources._gather import Gathering
from dew.serving import RolloutServer

WAIT = 60.0
SAMPLING = SamplingParams(max_tokens=3, stop_ids=())


@pytest.fixture(scope="module")
def server() -> Iterator[RolloutServer]:
    srv = RolloutServer(make_model("qwen2", "tiny", seed=2), seed=0)
    yield srv
    srv.close()


class Gate:
    """The real engine, with each answer held until the test releases it: the order
    in which a group's generations finish is the test's to choose."""

    def __init__(self, engine: RolloutServer) -> None:
        self.engine = engine
        self.sent: list[tuple[Future[Call], Future[Call]]] = []

    @property
    def version(self) -> int:
        return self.engine.version

    def submit(self, prompt: Any, params: Any, *, stop: Any = None, affinity: Any = None) -> Any:
        outer: Future[Call] = Future()
        self.sent.append((self.engine.submit(prompt, params, stop=stop, affinity=affinity), outer))
        return outer

    def abort(self, future: Future[Call]) -> None:
        pass

    def release(self, i: int) -> None:
        inner, outer = self.sent[i]
        error = inner.exception(timeout=WAIT)
        if error is None:
            outer.set_result(inner.result())
        else:
            outer.set_exception(error)


class Batches(GroupVerifier):
    """Scores each completion by its index in the call (or fails it), recording calls."""

    def __init__(self, fail: Any = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.fail = fail
        self.lock = threading.Lock()

    def score_group(
        self, task: Task, completions: Sequence[Any], calls: Sequence[Call]
    ) -> list[Any]:
        with self.lock:
            self.calls.append((task.id, len(completions)))
        if self.fail == "raise":
            raise RuntimeError("the reward model is down")
        if self.fail == "short":
            return [1.0]
        out: list[Any] = [float(i) for i in range(len(completions))]
        if self.fail == "second":
            out[1] = ValueError("row 1 is malformed")
        return out


def start(source: PromptSource, group: int, n: int, task: str = "0") -> list[Any]:
    return [source.start(Task(task), RolloutKey(group, i, 0)) for i in range(n)]


def test_a_group_is_scored_in_one_call_once_its_last_completion_is_in(
    server: RolloutServer,
) -> None:
    gate, verifier = Gate(server), Batches()
    with PromptSource(gate, [[5, 6], [7]], verifier, sampling=SAMPLING) as source:
        group = start(source, 0, 3)
        other = start(source, 1, 1, task="1")
        gate.release(0)
        gate.release(1)
        assert verifier.calls == [] and not any(s.done() for s in group)
        gate.release(3)  # the other group, alone: scored without waiting for group 0
        assert other[0].result(timeout=WAIT).reward == 0.0
        gate.release(2)
        rollouts = [s.result(timeout=WAIT) for s in group]
    assert verifier.calls == [("1", 1), ("0", 3)]
    assert [r.reward for r in rollouts] == [0.0, 1.0, 2.0]  # each its own result, in order
    assert all(r.status is Status.TRUNCATED and len(r.calls) == 1 for r in rollouts)


@pytest.mark.parametrize(
    ("fail", "errors"),
    [
        ("second", [None, "verifier failed: ValueError: row 1 is malformed", None]),
        ("raise", ["verifier failed: RuntimeError: the reward model is down"] * 3),
        ("short", ["verifier failed: ValueError: score_group returned 1 results for 3"] * 3),
    ],
)
def test_a_failure_lands_on_the_rollouts_it_belongs_to(
    server: RolloutServer, fail: str, errors: list[str | None]
) -> None:
    gate = Gate(server)
    with PromptSource(gate, [[5, 6]], Batches(fail), sampling=SAMPLING) as source:
        group = start(source, 0, 3)
        for i in range(3):
            gate.release(i)
        rollouts = [s.result(timeout=WAIT) for s in group]
    for rollout, error in zip(rollouts, errors, strict=True):
        if error is None:
            assert rollout.status is Status.TRUNCATED and rollout.error is None
        else:
            assert rollout.status is Status.INFRA_ERROR and rollout.reward is None
            assert rollout.error is not None and rollout.error.startswith(error)


def test_a_rollout_cancelled_while_it_waits_for_its_group_resolves_at_once(
    server: RolloutServer,
) -> None:
    gate, verifier = Gate(server), Batches()
    with PromptSource(gate, [[5, 6]], verifier, sampling=SAMPLING) as source:
        first, second = start(source, 0, 2)
        gate.release(0)  # finished; it waits for the second
        first.cancel()
        assert first.result(timeout=WAIT).status is Status.CANCELLED  # not held by it
        assert not second.done()
        gate.release(1)
        assert second.result(timeout=WAIT).reward == 0.0
    assert verifier.calls == [("0", 1)]  # the cancelled one was never scored


def test_a_member_aborted_or_lost_lets_the_rest_be_scored(server: RolloutServer) -> None:
    gate, verifier = Gate(server), Batches()
    slow = SamplingParams(max_tokens=200, stop_ids=())
    with PromptSource(gate, [[5, 6]], verifier, sampling=slow) as source:
        kept, cut = start(source, 0, 2)
        cut.cancel()  # the engine aborts its generation
        gate.release(1)
        assert cut.result(timeout=WAIT).status is Status.CANCELLED
        gate.release(0)
        assert kept.result(timeout=WAIT).status is Status.TRUNCATED
    assert verifier.calls == [("0", 1)]


def test_with_a_group_size_late_starters_join_and_oversampled_ones_are_not_waited_for(
    server: RolloutServer,
) -> None:
    gate, verifier = Gate(server), Batches()
    with PromptSource(gate, [[5, 6]], verifier, sampling=SAMPLING, group_size=3) as source:
        early = start(source, 0, 1)
        gate.release(0)  # in before its siblings started: with group_size it waits
        assert not early[0].done()
        late = [source.start(Task("0"), RolloutKey(0, i, 0)) for i in (1, 2, 3)]  # 1 extra
        gate.release(1)
        gate.release(2)  # 3 in: scored, the oversampled 4th still generating
        assert [s.result(timeout=WAIT).reward for s in early + late[:2]] == [0.0, 1.0, 2.0]
        assert not late[2].done()
        gate.release(3)
        assert late[2].result(timeout=WAIT).reward == 0.0  # scored on its own
        retry = source.start(Task("0"), RolloutKey(0, 1, 1))  # a retry after the flush
        gate.release(4)
        assert retry.result(timeout=WAIT).reward == 0.0  # not held for a group of 3
    assert verifier.calls == [("0", 3), ("0", 1), ("0", 1)]
    with pytest.raises(ValueError, match="group_size must be an int >= 1, got 0"):
        PromptSource(gate, [[5]], verifier, sampling=SAMPLING, group_size=0)


def test_close_resolves_a_waiting_rollout(server: RolloutServer) -> None:
    gate, verifier = Gate(server), Batches()
    source = PromptSource(gate, [[5, 6]], verifier, sampling=SAMPLING)
    waiting, _ = start(source, 0, 2)
    gate.release(0)
    closer = threading.Thread(target=source.close)
    closer.start()
    gate.release(1)  # the engine answers the second (cancelled) one after the close began
    closer.join(WAIT)
    assert not closer.is_alive()
    assert waiting.result(timeout=WAIT).status is Status.CANCELLED
    assert verifier.calls == []


# ------------------------------------------------------------------ the bookkeeping

EVENT = st.tuples(
    st.sampled_from(["start", "retry", "generated", "dropped", "withdraw"]), st.integers(0, 5)
)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from([None, 1, 2, 3]), st.lists(EVENT, max_size=60))
def test_every_completion_comes_back_once_and_groups_flush_when_in(
    expect: int | None, events: list[tuple[str, int]]
) -> None:
    gathering: Gathering[int, int] = Gathering(expect)
    model: dict[int, dict[str, Any]] = {}  # group -> its expected state
    given_in: list[int] = []
    came_back: list[int] = []
    for event, key in events:
        group = key // 3  # keys 0-2 are group 0, 3-5 group 1
        state = model.get(group)
        busy = state is not None and (key in state["generating"] or key in state["waiting"])
        if event in ("start", "retry") and not busy:
            gathering.started(group, key, retry=event == "retry")
            if state is None:
                state = model[group] = {
                    "expect": 1 if event == "retry" else expect,
                    "generating": set(),
                    "waiting": set(),
                    "ended": 0,
                }
            state["generating"].add(key)
        elif event in ("generated", "dropped") and state and key in state["generating"]:
            state["generating"].discard(key)
            state["ended"] += 1
            if event == "generated":
                given_in.append(len(given_in))
                state["waiting"].add(key)
                out = gathering.generated(group, key, given_in[-1])
            else:
                out = gathering.dropped(group, key)
            want, waiting, generating = state["expect"], state["waiting"], state["generating"]
            if want is None:
                ready = bool(waiting) and not generating
            else:
                full = len(waiting) >= want or (not generating and state["ended"] >= want)
                ready = bool(waiting) and full
            assert len(out) == (len(waiting) if ready else 0)
            if ready:
                waiting.clear()
            came_back.extend(out)
        elif event == "withdraw":
            got = gathering.withdraw(group, key)
            assert (got is not None) == (state is not None and key in state["waiting"])
            if got is not None:
                state["waiting"].discard(key)  # type: ignore[index]
                came_back.append(got)
        for g, st_ in list(model.items()):
            if not st_["generating"] and not st_["waiting"]:
                del model[g]  # forgotten by the gathering too
        assert len(gathering) == len(model)  # only groups in flight are held
    for group, state in model.items():  # every generation ends: everything comes back
        for key in sorted(state["generating"]):
            came_back.extend(gathering.dropped(group, key))
        for key in sorted(state["waiting"]):
            got = gathering.withdraw(group, key)
            if got is not None:
                came_back.append(got)
    assert sorted(came_back) == given_in  # each exactly once
    assert len(gathering) == 0
