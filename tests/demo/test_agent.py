"""The agent demo: the unmodified agent script trained through the gateway by the scheduler."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from dew.core import RolloutKey, Status, Task
from dew.data import Dataset
from dew.demo.agent import build_agent_source, make_tasks, max_chain, replies, score
from dew.demo.agent_script import next_digit
from dew.demo.model import make_model, make_tokenizer
from dew.objectives.rl.chains import chains
from dew.objectives.rl.grpo import GRPOObjective
from dew.objectives.rl.scheduler import RolloutScheduler, SchedulerRecord
from dew.serving import RolloutServer
from dew.train import fit

TOK = make_tokenizer()
WAIT = 60.0


@pytest.fixture(scope="module")
def model() -> Any:
    return make_model(max_positions=128, seed=0)


@pytest.fixture
def server(model: Any) -> Iterator[RolloutServer]:
    with RolloutServer(model, max_batch=16) as s:
        yield s


def test_next_digit_and_score():
    assert next_digit("7abc", 2) == 8 and next_digit("9", 0) == 0 and next_digit("x", 4) == 5
    assert next_digit("", 9) == 0 and next_digit("٣", 1) == 2  # only ASCII digits count
    assert score(3, ["3", "4"]) == pytest.approx({"format": 0.4, "copy": 0.6})
    assert score(3, ["5x", "6"]) == pytest.approx({"format": 0.4, "copy": 0.3})
    assert score(3, ["a", "4"]) == pytest.approx({"format": 0.2, "copy": 0.3})
    assert score(3, ["3"]) == pytest.approx({"format": 0.2, "copy": 0.3})  # crashed half-way
    assert score(3, []) == {"format": 0.0, "copy": 0.0}


def test_a_subprocess_agent_takes_no_processes(server):
    with pytest.raises(ValueError, match="processes=2"):
        build_agent_source(server, TOK, tasks=8, subprocess=True, processes=2)


def test_tasks_are_keyed_by_the_trainers_task_ids():
    tasks = make_tasks(50, seed=3)
    assert list(tasks) == [str(i) for i in range(50)]
    assert all(t.id == k and 0 <= t.data["digit"] <= 9 for k, t in tasks.items())
    assert make_tasks(50, seed=3) == tasks and make_tasks(50, seed=4) != tasks
    with pytest.raises(ValueError, match="n must be"):
        make_tasks(0)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("subprocess", "processes"), [(False, 0), (True, 0), (False, 1)])
def test_episodes_record_one_chain_each_and_are_scored(server, subprocess, processes):
    demo = build_agent_source(
        server, TOK, tasks=8, max_tokens=3, workers=4, subprocess=subprocess, processes=processes
    )
    try:
        if processes:  # the agent runs over there
            assert len(demo.source._procs.pids()) == processes  # type: ignore[union-attr]
        n = 2 if subprocess else 4
        sessions = [demo.source.start(Task(str(i)), RolloutKey(0, i, 0)) for i in range(n)]
        rollouts = [s.result(WAIT) for s in sessions]
    finally:
        demo.close()
    for i, r in enumerate(rollouts):
        assert r.status is Status.COMPLETED, r.error
        assert len(r.calls) == 2
        (chain,) = chains(r.calls)
        assert len(chain.tokens) <= demo.max_chain == max_chain(TOK, 3)
        digit = demo.tasks[str(i)].data["digit"]
        expected = score(digit, replies(TOK, r.calls))
        assert dict(r.components) == expected and r.reward == pytest.approx(sum(expected.values()))
        assert all(c.temperature == 1.0 and len(c.completion) <= 3 for c in r.calls)


@pytest.mark.timeout(240)
def test_the_scheduler_trains_the_agent_through_the_gateway(model):
    records: list[SchedulerRecord] = []
    batch, groups = 2, 2
    torch.manual_seed(0)
    policy = make_model(max_positions=128, seed=0)
    with RolloutServer(policy, max_batch=16) as server:
        demo = build_agent_source(server, TOK, tasks=16, max_tokens=3, workers=8)
        try:
            objective = GRPOObjective()
            scheduler = RolloutScheduler(
                objective,
                demo.source,
                server,
                width=demo.max_chain,
                rows=batch * groups,
                groups=groups,
                ahead=1,
                max_lag=1,
                log=records.append,
            )
            try:
                dataset = Dataset({"task_id": np.arange(16)}, batch_size=batch, seed=1)
                optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
                result = fit(
                    policy,
                    optimizer,
                    dataset,
                    scheduler,
                    objective,
                    steps=2,
                    checkpoint_every=None,
                    tensorboard=False,
                )
            finally:
                scheduler.close()
        finally:
            demo.close()
    assert result.updates == 2 and len(records) == 2
    for record in records:
        assert record.groups == batch
        assert record.metrics["merge_ratio"] == 1.0
        # The reward is the sum of the verifier's two components, each averaged alike.
        m = record.metrics
        assert m["reward/mean"] == pytest.approx(m["reward/format"] + m["reward/copy"])
    json.dumps([r.metrics for r in records])  # plain numbers, ready for records.jsonl
