"""The job recipe: ``dew train`` and ``dew demo`` build their stacks through it alike, and
nothing else in the house assembles one."""

from __future__ import annotations

import ast
import json
from contextlib import ExitStack
from pathlib import Path

import pytest

from dew.recipe import Job, Recipe, RecipeError, assemble, join_pool

SRC = Path(__file__).resolve().parents[1] / "src" / "dew"

# One set of settings, written for each entrypoint.
SEED, GROUPS, OVERSAMPLE, AHEAD, TASKS, TEMPERATURE, MAX_TOKENS = 3, 4, 1, 1, 2, 0.7, 3


def _train_config(tmp_path: Path) -> Path:
    from dew.demo.model import make_model, make_tokenizer

    model = tmp_path / "model"
    make_model("qwen2", "tiny", seed=SEED, max_positions=64).save_pretrained(model)
    make_tokenizer().save_pretrained(model)
    reward = tmp_path / "reward.py"
    reward.write_text("def reward(prompts, completions, **kw):\n    return [1.0] * len(prompts)\n")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i:03d}"}) + "\n" for i in range(16)))
    config = tmp_path / "run.toml"
    config.write_text(
        f"""
[model]
path = "{model}"
[data]
path = "{data}"
[[rewards]]
function = "{reward}:reward"
[sampling]
max_tokens = {MAX_TOKENS}
temperature = {TEMPERATURE}
[scheduler]
groups = {GROUPS}
oversample = {OVERSAMPLE}
ahead = {AHEAD}
max_lag = {AHEAD}
[training]
steps = 1
tasks = {TASKS}
seed = {SEED}
[output]
run_dir = "{tmp_path / "run"}"
"""
    )
    return config


@pytest.mark.timeout(300)
def test_dew_train_and_dew_demo_with_the_same_settings_build_the_same_stack(
    tmp_path: Path,
) -> None:
    from dew.demo.run import DemoConfig, demo_recipe
    from dew.job._reward_pool import RewardPool
    from dew.job.config import load_config
    from dew.job.run import _recipe, prepare

    demo = DemoConfig(
        seed=SEED,
        group_size=GROUPS,
        oversample=OVERSAMPLE,
        ahead=AHEAD,
        max_lag=AHEAD,
        batch_size=TASKS,
        temperature=TEMPERATURE,
        max_tokens=MAX_TOKENS,
    )
    prepared = prepare(load_config(_train_config(tmp_path)))
    recipes = {
        "demo": demo_recipe(demo),
        "train": _recipe(prepared, tmp_path / "run", RewardPool(prepared.rewards)),
    }
    with ExitStack() as stack:
        jobs = {
            name: assemble(recipe, stack, join_pool(recipe.parallel, stack))
            for name, recipe in recipes.items()
        }
        # Engine sizing: every rollout in flight, oversampled ones counted.
        in_flight = TASKS * (GROUPS + OVERSAMPLE) * (AHEAD + 1)
        for name, job in jobs.items():
            assert job.needs.in_flight == in_flight, name
            assert job.engine._max_batch == in_flight, name  # the in-process engine's room
            # The seed rule: the run's seed plus the process's rank.
            assert (job.pool, job.needs.rank, job.needs.seed) == (None, 0, SEED), name
            # Pool joining: single process, so the scheduler carries no hooks.
            assert job.scheduler.hooks.agree is None and job.scheduler.hooks.publisher is None
            # The objective's temperature is the sampling's.
            assert job.objective.temperature == job.needs.sampling.temperature == TEMPERATURE
            assert job.scheduler.config.in_flight_per_task == (GROUPS + OVERSAMPLE) * (AHEAD + 1)
            assert job.dataset.batch_size == TASKS
        demo_knobs, train_knobs = (jobs[n].scheduler.config for n in ("demo", "train"))
        for knob in ("groups", "oversample", "ahead", "max_lag"):
            assert getattr(demo_knobs, knob) == getattr(train_knobs, knob), knob


def test_in_flight_per_task_counts_oversample_and_the_batches_ahead() -> None:
    from dew.objectives.rl.config import SchedulerConfig

    assert SchedulerConfig(groups=4).in_flight_per_task == 8  # ahead 1: two batches
    assert SchedulerConfig(groups=4, oversample=2, ahead=2, max_lag=2).in_flight_per_task == 18
    assert SchedulerConfig(groups=8, ahead=0, max_lag=0).in_flight_per_task == 8


def test_a_process_alone_refuses_a_parallel_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    with ExitStack() as stack:
        assert join_pool({"tensor": 1}, stack) is None
        with pytest.raises(RecipeError, match="parallel: data=None, tensor=2 needs that many"):
            join_pool({"tensor": 2}, stack)


def test_tasks_that_do_not_split_over_the_data_axis_are_refused() -> None:
    class TwoShares:
        rank, shares = 0, 2

    recipe = Recipe(
        model=lambda: None,
        engine=lambda needs, stack: None,
        source=lambda engine, needs: None,  # type: ignore[arg-type,return-value]
        sampling=None,  # type: ignore[arg-type]
        scheduler=None,  # type: ignore[arg-type]
        rows=8,
        tasks=3,
        lr=1e-3,
    )
    with ExitStack() as stack, pytest.raises(RecipeError, match="tasks: 3 tasks per step"):
        assemble(recipe, stack, TwoShares())


# What assembling a training stack calls; only the recipe may call them (their own
# modules and the tests aside).
_ASSEMBLY = {
    "init_pool",
    "shard_model",
    "scheduler_hooks",
    "attach",
    "AdamW",
    "from_config",
}
_OWNERS = {
    "recipe.py",
    "pool/_pool.py",
    "pool/_shard.py",
    "pool/_hooks.py",
    "pool/__init__.py",
    # The planner's simulator drives a scheduler alone (a stand-in trainer, a simulated
    # engine): no model, optimizer or pool, so no training stack.
    "plan/sim.py",
}


def test_only_the_recipe_assembles_a_training_stack() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        name = str(path.relative_to(SRC))
        if name in _OWNERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                scheduler = "RolloutScheduler" in ast.unparse(func)
                if called in _ASSEMBLY - {"from_config"} or (called == "from_config" and scheduler):
                    found.append(f"{name}:{node.lineno}: {ast.unparse(func)}")
                if called == "RolloutScheduler":
                    found.append(f"{name}:{node.lineno}: RolloutScheduler(...)")
    assert found == []


@pytest.mark.timeout(300)
def test_each_recipe_option_takes_effect(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from dew.demo.run import DemoConfig, demo_recipe

    monkeypatch.setenv("WORLD_SIZE", "1")
    base = demo_recipe(DemoConfig(steps=1, batch_size=2, group_size=2, tasks=64))

    def build(**options: object) -> Job:
        return assemble(dataclasses.replace(base, **options), stack)

    def first_batch(job: Job) -> list[int]:
        return [int(i) for i in next(iter(job.dataset.stream(0)))["task_id"]]

    with ExitStack() as stack:
        default = build()
        # objective: GRPOObjective's settings (the temperature stays the sampling's)
        assert build(objective={"clip": 0.1}).objective.clip == 0.1 != default.objective.clip
        # reference: the frozen policy of a KL term, made from the starting model
        made = build(reference=lambda model: model).objective
        assert made.reference is not None and default.objective.reference is None
        # weight_decay reaches AdamW
        decayed = build(weight_decay=0.25).optimizer.param_groups[0]["weight_decay"]
        assert decayed == 0.25 != default.optimizer.param_groups[0]["weight_decay"]
        # seed: the engine's seed (plus the rank) and torch's
        assert (build(seed=5).needs.seed, default.needs.seed) == (5, 0)
        # data_seed: the task order alone (None: the seed's)
        assert first_batch(build(data_seed=7)) != first_batch(default)
        assert first_batch(build(data_seed=None, seed=1)) == first_batch(build(data_seed=1))
        # device: where a single process's model trains (None: left where it was built)
        moves: list[tuple[object, ...]] = []

        def watched() -> object:
            model = base.model()
            to = model.to
            model.to = lambda *where: (moves.append(where), to(*where))[1]  # type: ignore[method-assign]
            return model

        build(model=watched)
        assert moves == []
        build(model=watched, device="cpu")
        assert moves == [("cpu",)]
        # parallel: a layout of several processes needs torchrun
        with pytest.raises(RecipeError, match="parallel"):
            join_pool(dataclasses.replace(base, parallel={"tensor": 2}).parallel, stack)
        # wrap: the trained model and the publisher pushes go through
        published: list[int] = []

        class Tap:
            def __init__(self, engine: object) -> None:
                self.engine = engine

            def load(self, variables: object, version: int) -> None:
                published.append(version)
                self.engine.load(variables, version)  # type: ignore[attr-defined]

        tapped = build(wrap=lambda model, engine: (model, Tap(engine)))
        assert isinstance(tapped.scheduler.weights, Tap)
        assert not isinstance(default.scheduler.weights, Tap)
