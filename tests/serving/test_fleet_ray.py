"""EngineFleet placed by Ray on a real local cluster of two nodes (``ray start`` on
this machine, each node offering one ``engine`` resource and a resource naming it; Ray
turns a loopback ``--node-ip-address`` into the machine's own address, so the engines
listen there, behind the fleet's key).

One engine lands on each node. The demo's copy task trains through the fleet while, in
turn: one engine's server process is SIGKILLed (its actor starts another), its Ray actor
is killed (Ray restarts the actor, the fleet asks it for a server), and the second node
is killed whole (its engine cannot be placed again: the fleet runs on with one engine
and says so). Every task is trained once or recorded, the lost calls come back as
``infra_error`` resubmissions, each engine that came back served the fleet's version
before it got work, and the reward rises.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from dew.core import EngineError, SamplingParams
from dew.serving.fleet import EngineFleet
from dew.serving.fleet._ray import NAMESPACE

from ._fleet_helpers import (
    ONE_THREAD,
    check_exactly_once,
    kill_while_it_holds_calls,
    rewards,
    train,
    wait_for,
)
from ._helpers import chaos_seed
from ._ray_cluster import ray_cluster, ray_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HEAD = {"engine": 1, "node_a": 1}
OTHER = {"engine": 1, "node_b": 1}
BACK = 120.0  # seconds for an engine to be started again and rejoin


def _node_with(resource: str) -> str:
    import ray

    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"])


def test_a_ray_fleet_places_one_engine_per_node_and_trains_through_its_faults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = 100
    seed = chaos_seed()
    rng = random.Random(seed)
    gap = rng.randint(2, 4)  # steps between one fault's recovery and the next fault
    note = f"seed {seed}: {gap} steps between faults"
    seen: list[int] = []
    done: list[str] = []
    over = threading.Event()
    env = ray_env()
    for name, value in env.items():  # this process joins as a Ray client
        monkeypatch.setenv(name, value)
    import ray  # after its settings: Ray reads them once, when imported

    with ray_cluster(env, HEAD, OTHER, cpus=1) as (address, nodes):
        fleet = EngineFleet.on_ray(
            2, demo="tiny", env=ONE_THREAD, resources={"engine": 1}, address=address,
            health_interval=0.5, startup_timeout=45,
        )  # fmt: skip
        with fleet:
            a, b = _node_with("node_a"), _node_with("node_b")
            members = fleet.members()
            assert {m.node for m in members} == {a, b}, members  # one per node
            on_a = next(i for i, m in enumerate(members) if m.node == a)
            on_b = 1 - on_a
            first_actor = members[on_a].actor
            assert first_actor is not None

            def after(k: int) -> bool:  # False: the run ended first
                while len(seen) < k:
                    if over.wait(0.01):
                        return False
                return True

            def back(restarts: int) -> None:
                wait_for(
                    fleet,
                    lambda ms: ms[on_a].restarts >= restarts and ms[on_a].state == "up",
                    BACK,
                    f"engine {on_a} did not come back ({note})",
                )

            def faults() -> None:
                if not after(gap):
                    return
                pid = fleet.members()[on_a].pid
                assert pid is not None
                if not kill_while_it_holds_calls(fleet, on_a, pid, over, 120):
                    return
                done.append("server")
                back(1)
                if not after(len(seen) + gap):
                    return
                # Ray restarts the actor (not the fleet): its name stays, its pid changes.
                actor_pid = fleet._members[on_a].local.actor_pid  # type: ignore[union-attr]
                ray.kill(ray.get_actor(first_actor, namespace=NAMESPACE), no_restart=False)
                done.append("actor")
                back(2)
                assert fleet.members()[on_a].actor == first_actor
                assert fleet._members[on_a].local.actor_pid != actor_pid  # type: ignore[union-attr]
                if not after(len(seen) + gap):
                    return
                nodes[1].kill()  # the second machine is gone
                done.append("node")

            chaos = threading.Thread(target=faults, name="test-chaos")
            chaos.start()
            try:
                records, dataset = train(
                    fleet, tmp_path / "run", steps, lr=3e-3, log=[lambda r: seen.append(1)]
                )
            finally:
                over.set()
                chaos.join()
            assert done == ["server", "actor", "node"], (done, note)
            check_exactly_once(records, dataset, steps)
            infra = sum(r["scheduler"]["resubmitted"].get("infra_error", 0) for r in records)
            assert infra > 0, (note, [r["scheduler"]["resubmitted"] for r in records])
            # The engine on the lost node cannot be placed again: out, saying why.
            members = wait_for(
                fleet,
                lambda ms: ms[on_b].state == "out" and "Ray" in ms[on_b].reason,
                BACK,
                f"the engine of the lost node was not reported ({note})",
            )
            survivor = members[on_a]
            assert survivor.state == "up" and survivor.version == fleet.version
            assert survivor.restarts >= 2 and survivor.node == a
            calls = [fleet.submit([7, 8, i], SamplingParams(max_tokens=4)) for i in range(6)]
            assert {f.result(timeout=60).version for f in calls} == {fleet.version}
    got = rewards(records)
    first, last = sum(got[:10]) / 10, sum(got[-10:]) / 10
    assert last > 2 * first and last > first + 0.02, (note, first, last)


@pytest.mark.timeout(600)
def test_dew_train_runs_the_ray_example_on_a_local_cluster_of_its_own(tmp_path: Path) -> None:
    """``address = "local"``: the run starts a Ray instance of its own on this machine,
    places its two engines there and trains on both."""
    import json
    import os
    import subprocess
    import sys

    examples = Path(__file__).parents[2] / "examples"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(OMP_NUM_THREADS="1", **ray_env())
    made = subprocess.run(
        [sys.executable, str(examples / "make_assets.py")], cwd=tmp_path, env=env, check=False
    )
    assert made.returncode == 0
    argv = [sys.executable, "-m", "dew.cli", "train", str(examples / "ray.toml"), "--no-progress"]
    argv += ["--rewards.0.function", f"{examples / 'copy_reward.py'}:copy_reward"]
    argv += ["--training.steps", "4", "--output.checkpoint_every", "4"]
    argv += ["--engine.address", "local"]
    done = subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "examples" / "ray"
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    engines = {e["name"] for r in records for e in r["profile"].get("engines") or ()}
    assert len(engines) == 2, engines  # both engines served, each by its own URL


def test_each_placement_option_takes_effect(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a one-node cluster of one CPU and no GPU: an engine asking for a GPU, or for
    two CPUs, is never placed (one line naming what it asked for); with
    ``max_restarts=0`` Ray leaves a killed actor dead and the fleet makes a new one."""
    env = ray_env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    import ray

    with ray_cluster(env, {"engine": 1}, cpus=1) as (address, _):
        for asked, match in (({"num_gpus": 1}, "num_gpus=1"), ({"num_cpus": 2}, "not placed")):
            with pytest.raises(EngineError, match=match):
                EngineFleet.on_ray(1, demo="tiny", address=address, startup_timeout=8, **asked)
        fleet = EngineFleet.on_ray(
            1, demo="tiny", env=ONE_THREAD, max_restarts=0, address=address,
            health_interval=0.3, startup_timeout=60,
        )  # fmt: skip
        with fleet:
            first = fleet.members()[0].actor
            assert first is not None
            ray.kill(ray.get_actor(first, namespace=NAMESPACE), no_restart=False)
            members = wait_for(
                fleet,
                lambda ms: ms[0].restarts >= 1 and ms[0].state == "up",
                BACK,
                "the engine of a killed actor that Ray may not restart did not come back",
            )
            assert members[0].actor not in (None, first)  # a new actor, made by the fleet
            call = fleet.submit([7, 8, 9], SamplingParams(max_tokens=4))
            assert call.result(timeout=60).version == fleet.version


def test_a_vllm_engine_placed_by_ray_serves_the_fleets_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``engine="vllm"``: the actor starts a vLLM server from the vLLM environment on its
    node, behind the fleet's key; a push reaches it and its calls come back at the
    pushed version."""
    from ._vllm import ARGS, ENV, START, lively, python, save_model

    env = ray_env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    model = save_model(tmp_path / "model")
    with ray_cluster(env, {"engine": 1}, cpus=1) as (address, _):
        fleet = EngineFleet.on_ray(
            1, model=model, engine="vllm", python=python(), args=ARGS, env=ENV,
            resources={"engine": 1}, address=address, startup_timeout=START,
        )  # fmt: skip
        with fleet:
            (member,) = fleet.members()
            assert member.state == "up" and member.node is not None and member.actor
            fleet.load(lively(1), 5)
            calls = [fleet.submit([7, 8, i], SamplingParams(max_tokens=4)) for i in range(3)]
            assert {f.result(timeout=120).version for f in calls} == {5}
