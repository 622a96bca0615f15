"""EngineFleet over real vLLM servers it launched: training, and a SIGKILL mid-run.

Two vLLM servers (vLLM's CPU build) serve a tiny Qwen2; the demo's copy task trains on
them through the fleet, with weights pushed every step. Mid-run one server is SIGKILLed
while it holds calls: the run still ends with every task trained once or recorded, the
lost calls come back as ``infra_error`` resubmissions, the supervisor starts the server
again and the fleet brings it to its version before it gets work, and the reward rises.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from dew.core import SamplingParams
from dew.serving.fleet import EngineFleet

from ._fleet_helpers import (
    check_exactly_once,
    kill_while_it_holds_calls,
    rewards,
    train,
    wait_for,
)
from ._helpers import chaos_seed
from ._vllm import ARGS, ENV, SIZE, python, save_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BACK = 300.0  # seconds for a killed vLLM server to be restarted and rejoin


def test_a_vllm_fleet_trains_and_loses_nothing_to_a_killed_server(tmp_path: Path) -> None:
    steps = 60
    seed = chaos_seed()
    rng = random.Random(seed)
    kill_at = rng.randint(10, 25)  # after this many steps, plus a random delay
    delay = rng.uniform(0.0, 0.3)
    note = f"seed {seed}: SIGKILL after step {kill_at} + {delay:.2f}s"
    model = save_model(tmp_path / "model")
    seen: list[int] = []
    killed: list[int] = []
    over = threading.Event()  # the run ended: the killer gives up
    fleet = EngineFleet.launch(
        2, model=model, engine="vllm", python=python(), args=ARGS, env=ENV,
        health_interval=0.5, startup_timeout=300,
    )  # fmt: skip
    with fleet:
        index = rng.randrange(2)
        victim = fleet.members()[index]
        assert victim.pid is not None

        def kill() -> None:
            while len(seen) < kill_at and not over.wait(0.01):
                pass
            if not over.wait(delay) and kill_while_it_holds_calls(
                fleet, index, victim.pid, over, 600
            ):
                killed.append(len(seen))

        killer = threading.Thread(target=kill)
        killer.start()
        try:
            records, dataset = train(
                fleet, tmp_path / "run", steps, size=SIZE, log=[lambda r: seen.append(1)]
            )
        finally:
            over.set()
            killer.join()
        assert killed, f"the server was never killed ({note})"
        check_exactly_once(records, dataset, steps)
        infra = sum(r["scheduler"]["resubmitted"].get("infra_error", 0) for r in records)
        assert infra > 0, (note, [r["scheduler"]["resubmitted"] for r in records])
        # The supervisor restarted it; the fleet brought it to its version first.
        members = wait_for(
            fleet,
            lambda ms: all(m.state == "up" and m.version == fleet.version for m in ms),
            BACK,
            "the killed server did not rejoin at the fleet's version",
        )
        assert fleet.version == steps - 1
        back = members[index]
        assert back.restarts == 1 and back.pid != victim.pid
        calls = [fleet.submit([7, 8, i], SamplingParams(max_tokens=4)) for i in range(8)]
        assert {f.result(timeout=60).version for f in calls} == {fleet.version}
        assert all(m.dispatched > 0 for m in fleet.members())
    got = rewards(records)
    first, last = sum(got[:10]) / 10, sum(got[-10:]) / 10
    assert last > 2 * first and last > first + 0.05, (note, first, last)
